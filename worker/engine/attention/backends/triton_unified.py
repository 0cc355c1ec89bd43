"""Triton paged attention, the CUDA default: one launch per layer serves every row
of a step (prefill chunks with or without cached context, decode rows) straight
from the block table, GQA, sliding windows, attention sinks, any power-of-two block size (the design
of vLLM's Triton "unified attention").  K/V are written by a Triton
reshape-and-cache kernel.

Its launch grid depends only on host-known shapes and the kernels read lengths
from device tensors, so decode steps are captured in CUDA graphs with the real
per-row lengths: a row's loop covers its own blocks, not the graph's table width.
On CPU tensors the same kernels run under ``TRITON_INTERPRET=1`` (the tests).
"""
from __future__ import annotations

from typing import Any

import torch

from worker.engine.attention.backends.base import AttentionBackend, AttentionImpl, AttentionSpec
from worker.engine.attention.metadata import AttentionMetadata


class TritonImpl(AttentionImpl):
    def __init__(self, spec: AttentionSpec, kernels: Any):
        super().__init__(spec)
        self.kernels = kernels

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, attn: AttentionMetadata) -> None:
        self.kernels.reshape_and_cache(k, v, kv_layer[0], kv_layer[1], attn.slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        out = torch.empty(q.shape[0], self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        self.kernels.unified_attention(q, kv_layer[0], kv_layer[1], out, query_start_loc=attn.query_start_loc,
                                       seq_lens=attn.seq_lens, block_tables=attn.block_tables, scale=self.scale,
                                       sliding_window=self.sliding_window, max_query_len=attn.max_query_len,
                                       sinks=self.sinks)
        return out.view(q.shape[0], -1)


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, kernels: Any):
        self.kernels = kernels
        self.ops = kernels  # Triton RMSNorm, rotary and SwiGLU beside the attention

    def make_impl(self, spec: AttentionSpec) -> AttentionImpl:
        return TritonImpl(spec, self.kernels)  # sinks (GPT-OSS) included: the kernel takes them
