"""The attention layer a model holds: its shape (``AttentionSpec``) and the
backend's implementation for it, swapped in by ``set_backend`` once the engine has
chosen a backend (models are built before that choice; torch SDPA until then)."""
from __future__ import annotations

from typing import Optional

import torch

from worker.engine.attention.backends.base import AttentionBackend, AttentionImpl, AttentionSpec
from worker.engine.attention.backends.torch_sdpa import TorchSDPABackend
from worker.engine.attention.metadata import AttentionMetadata


class PagedAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: Optional[int] = None,
                 scale: Optional[float] = None, sinks: Optional[torch.Tensor] = None):
        """``sinks``: the layer's per-head sink logits ``[num_heads]`` (GPT-OSS), filled
        in place by the weight loader; every impl made for this layer reads them."""
        self.spec = AttentionSpec(num_heads, num_kv_heads, head_dim, sliding_window, scale, sinks is not None)
        self.sinks = sinks
        # The checkpoint's KV-cache scales (quantization/kv_scales.py), used over an FP8 cache.
        self.kv_scales: Optional[tuple[float, float]] = None
        self.backend: AttentionBackend = TorchSDPABackend()
        self.impl: AttentionImpl = self._make_impl()

    def _make_impl(self) -> AttentionImpl:
        impl = self.backend.make_impl(self.spec)
        impl.sinks = self.sinks
        return impl

    def set_backend(self, backend: AttentionBackend) -> None:
        self.impl.reset()
        self.backend = backend
        self.impl = self._make_impl()

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """Per-tensor scales of an FP8 KV cache (vLLM's ``k_scale`` / ``v_scale``): the cache
        holds ``k / k_scale`` and ``v / v_scale``; ignored over a cache in the model dtype."""
        self.kv_scales = None if (k_scale, v_scale) == (1.0, 1.0) else (float(k_scale), float(v_scale))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                 attn: AttentionMetadata) -> torch.Tensor:
        """q ``[T, heads, D]``, k/v ``[T, kv_heads, D]`` -> ``[T, heads * D]``; the step's
        K/V are stored in ``kv_layer`` ``[2, blocks, block_size, kv_heads, D]`` first."""
        if attn.plan is None:  # metadata built outside the runner (tests, benchmarks)
            attn.plan = self.backend.plan(attn, kv_layer.shape[2])
        if self.kv_scales is not None and kv_layer.element_size() == 1:
            return self._scaled(q, k, v, kv_layer, attn, *self.kv_scales)
        self.impl.write_kv(k, v, kv_layer, attn)
        return self.impl.forward(q, k, v, kv_layer, attn)

    def _scaled(self, q, k, v, kv_layer, attn, k_scale: float, v_scale: float) -> torch.Tensor:
        """Attention over a cache holding K / k_scale and V / v_scale, for every backend
        alike (CPU SDPA and native, Triton, FlashAttention) without touching its kernels:
        scores are q . k = (q * k_scale) . (k / k_scale), and softmax(s) . v = v_scale *
        (softmax(s) . (v / v_scale)), scales being per tensor.  Costs one multiply of q
        and of the output per layer, only over an FP8 cache with calibrated scales."""
        k, v = k / k_scale, v / v_scale
        self.impl.write_kv(k, v, kv_layer, attn)
        return self.impl.forward(q * k_scale, k, v, kv_layer, attn) * v_scale
