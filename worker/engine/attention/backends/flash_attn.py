"""FlashAttention's varlen kernel reading the paged cache through ``block_table``
(CUDA, fp16/bf16), when ``vllm_flash_attn`` or ``flash_attn`` is installed.

vLLM's fork pages any block size that is a multiple of 16 and takes per-row K
lengths (``seqused_k``); upstream FlashAttention-2 pages only multiples of 256 and
takes cumulative K lengths.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from worker.engine.attention.backends.base import AttentionBackend, AttentionImpl, AttentionSpec
from worker.engine.attention.metadata import AttentionMetadata


def load_flash_varlen() -> Optional[tuple[Any, int, bool]]:
    """(varlen function, block-size multiple it pages with, takes seqused_k) or None."""
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func  # type: ignore

        return flash_attn_varlen_func, 16, True
    except Exception:
        pass
    try:
        from flash_attn import flash_attn_varlen_func  # type: ignore

        return flash_attn_varlen_func, 256, False
    except Exception:
        return None


class FlashAttnImpl(AttentionImpl):
    def __init__(self, spec: AttentionSpec, fn: Any, uses_seqused_k: bool):
        super().__init__(spec)
        self.fn, self.uses_seqused_k = fn, uses_seqused_k
        w = spec.sliding_window
        self.window = (w - 1, 0) if w else (-1, -1)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        if self.uses_seqused_k:
            lens = dict(seqused_k=attn.seq_lens)
        else:
            lens = dict(cu_seqlens_k=F.pad(attn.seq_lens.cumsum(0, dtype=torch.int32), (1, 0)))
        out = self.fn(q, kv_layer[0], kv_layer[1], cu_seqlens_q=attn.query_start_loc,
                      max_seqlen_q=attn.max_query_len, max_seqlen_k=attn.max_seq_len, softmax_scale=self.scale,
                      causal=True,  # FlashAttention aligns the causal mask bottom-right
                      window_size=self.window, block_table=attn.block_tables, **lens)
        return out.reshape(q.shape[0], -1)


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    # max_seqlen_k is a host value baked into a captured launch; a graph is captured
    # with the table's full width, which the kernel only uses as an upper bound.
    supports_cuda_graphs = True

    def __init__(self, loaded: tuple[Any, int, bool]):
        self.fn, self.block_multiple, self.uses_seqused_k = loaded

    def make_impl(self, spec: AttentionSpec) -> AttentionImpl:
        if spec.sinks:  # the selector refuses such models first (resolve_attention_backend's ``sinks``)
            raise ValueError("FlashAttention backend: attention sinks (GPT-OSS) are not supported; use triton")
        return FlashAttnImpl(spec, self.fn, self.uses_seqused_k)
