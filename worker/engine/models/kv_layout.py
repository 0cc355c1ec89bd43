"""What the paged KV cache stores per token, as the model family defines it.

The runner preallocates one tensor for all layers and sizes it by the bytes a block
costs; both come from the family's ``KVCacheLayout`` (``kv_cache_layout``), so a
family with another cache content plugs in without the runner knowing:

* ``mha``: K and V of this rank's KV heads (the Llama-family decoder and every family
  built on it): ``(2, layers, blocks, block_size, kv_heads, head_dim)``;
* ``latent``: DeepSeek's multi-head latent attention stores one vector per token and
  layer, the normalised latent ``c_kv`` and the roped key ``k_pe``:
  ``(1, layers, blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim)``.

Both keep blocks on axis 2 and layers on axis 1, so what moves whole blocks (P/D KV
transfer's export, ``index_select(2, blocks)``) or hands a layer's slice to the model
(``kv_cache[:, i]``) is the same for either: P/D KV transfer moves latent blocks
unchanged, and an FP8 cache (``--kv-cache-dtype``) stores either content in FP8.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


def _elem_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KVCacheLayout:
    kind: str  # "mha" | "latent"
    num_layers: int
    entries: int  # tensors per token and layer: 2 (K, V) or 1 (the latent)
    heads: int  # this rank's KV heads (1 for the latent)
    dim: int  # values per head
    # Values per token and layer the same attention would store as expanded per-head K/V
    # (the latent layout's comparison; equal to entries * heads * dim for "mha").
    expanded_values: Optional[int] = None
    what: str = ""  # the stored content, in words (the startup log)

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (self.entries, self.num_layers, num_blocks, block_size, self.heads, self.dim)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes one token costs across all layers."""
        return self.entries * self.num_layers * self.heads * self.dim * _elem_size(dtype)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return block_size * self.bytes_per_token(dtype)

    def expanded_bytes_per_token(self, dtype: torch.dtype) -> int:
        values = self.expanded_values if self.expanded_values is not None else self.entries * self.heads * self.dim
        return self.num_layers * values * _elem_size(dtype)

    def describe(self, dtype: torch.dtype) -> str:
        """One line for the startup log: bytes per token, and against the expanded
        per-head K/V layout when the stored content is smaller."""
        dt = str(dtype).removeprefix("torch.")
        line = (f"KV cache layout {self.kind}: {self.what or 'K/V'}, {self.entries * self.heads * self.dim} values "
                f"per token per layer = {self.bytes_per_token(dtype)} bytes per token over {self.num_layers} layers "
                f"in {dt}")
        expanded = self.expanded_bytes_per_token(dtype)
        if expanded != self.bytes_per_token(dtype):
            line += (f"; the equivalent MHA layout (expanded per-head K/V) would take {expanded} bytes per token "
                     f"({expanded / self.bytes_per_token(dtype):.1f}x)")
        return line


def mha_layout(num_layers: int, kv_heads: int, head_dim: int) -> KVCacheLayout:
    return KVCacheLayout("mha", num_layers, 2, kv_heads, head_dim, what="K and V per KV head")


def kv_cache_layout(model_config: Any) -> KVCacheLayout:
    """The cache layout of a model configuration's family (its implementation class's
    ``kv_cache_layout``, imported on demand as the registry does)."""
    return model_config.family.model_class().kv_cache_layout(model_config)
