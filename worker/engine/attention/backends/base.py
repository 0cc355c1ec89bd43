"""What every attention backend provides (vLLM v1's AttentionBackend / metadata
builder / impl split, reduced to what this engine needs).

A backend is one object per engine.  Once per step the runner calls ``plan`` on
the step's metadata (the backend's metadata builder: index tensors, masks, groups
of rows; shared by every layer through ``attn.plan``).  Each attention layer gets
its own ``AttentionImpl`` from ``make_impl``, which writes the step's K/V into the
paged cache and attends.  ``ops`` names the fused element-wise kernels (RMSNorm,
rotary, SwiGLU) that go with the backend's device: the compiled CPU module, the
Triton ops, or None for torch's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from worker.engine.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer's shape, as seen by this rank."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: Optional[int] = None  # keys within the last w positions; None = full context
    softmax_scale: Optional[float] = None  # None: 1/sqrt(head_dim); Gemma 3: query_pre_attn_scalar ** -0.5
    # GPT-OSS: a learned logit per query head joins each softmax denominator (with no value);
    # the tensor itself is the layer's parameter, handed to the impl as ``AttentionImpl.sinks``.
    sinks: bool = False

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5 if self.softmax_scale is None else self.softmax_scale


def to_kv_storage(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the KV cache stores it: unchanged in the model dtype; in FP8 (``--kv-cache-dtype``,
    scale 1.0 as vLLM without calibrated scales) saturated to the format's range first, as
    vLLM's CUDA conversion does, instead of overflowing to NaN."""
    if x.dtype == dtype:
        return x
    if dtype.itemsize == 1:
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def as_stored(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded as the cache would store it, back in its own dtype: attention over
    freshly computed K/V then sees what later steps read from the cache."""
    return x if x.dtype == cache_dtype else to_kv_storage(x, cache_dtype).to(x.dtype)


class AttentionImpl:
    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.group = spec.num_heads // spec.num_kv_heads
        self.scale = spec.scale
        self.sliding_window = spec.sliding_window
        self.sinks: Optional[torch.Tensor] = None  # [num_heads] float when spec.sinks (PagedAttention sets it)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, attn: AttentionMetadata) -> None:
        """Store the step's K/V ``[T, kv_heads, D]`` at ``attn.slot_mapping``."""
        flat = kv_layer.view(2, -1, self.num_kv_heads, self.head_dim)
        k, v = to_kv_storage(k, kv_layer.dtype), to_kv_storage(v, kv_layer.dtype)
        if kv_layer.element_size() == 1:  # torch has no FP8 index_copy_ on CPU: move the bytes
            flat, k, v = flat.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
        flat[0].index_copy_(0, attn.slot_mapping, k)
        flat[1].index_copy_(0, attn.slot_mapping, v)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        """q ``[T, heads, D]``, k/v ``[T, kv_heads, D]`` (already in the cache) ->
        ``[T, heads * D]``."""
        raise NotImplementedError

    def reset(self) -> None:
        """Drop state kept across steps (e.g. a decode K/V mirror)."""


class AttentionBackend:
    name = "base"
    # Whether a decode step can be captured in a CUDA graph: its plan and kernels
    # must read lengths from device tensors only, never bake host values into the graph.
    supports_cuda_graphs = False
    ops: Optional[Any] = None

    def plan(self, attn: AttentionMetadata, block_size: int) -> Any:
        return None

    def make_impl(self, spec: AttentionSpec) -> AttentionImpl:
        raise NotImplementedError

    def describe(self) -> str:
        return self.name
