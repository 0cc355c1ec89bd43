"""The compiled CPU kernels (worker/engine/kernels, float32 or bfloat16 storage): every decode row reads
its blocks in place (no gather, no copy, mixed steps included) and all prefill
chunks of a step, with or without cached context, run in one call of a blocked
causal kernel that packs each sequence's keys and values straight from their blocks.
Over an FP8 KV cache (``--kv-cache-dtype fp8`` / ``fp8_e5m2``) the same kernels read
the one-byte blocks and widen each value to float32 exactly as they load it; the
checkpoint's k/v scales stay outside them (``PagedAttention._scaled``).

The kernels attend over the full context without sinks, so sliding-window layers and
layers with attention sinks (GPT-OSS) are served by torch SDPA inside the same backend
(its plan then also carries SDPA's per-chunk index tensors).  Likewise a step with bidirectional spans (Gemma 3's images: the causal
mask opened within each image, ``AttentionMetadata.attn_spans``) runs every layer on
SDPA, which builds that mask; the kernels' masks are causal.
"""
from __future__ import annotations

from typing import Any

import torch

from worker.engine.attention.backends.base import AttentionBackend, AttentionImpl, AttentionSpec
from worker.engine.attention.backends.torch_sdpa import TorchPlan, TorchSDPAImpl, _DecodeGroup
from worker.engine.attention.metadata import AttentionMetadata


class CpuNativeImpl(AttentionImpl):
    def __init__(self, spec: AttentionSpec, module: Any):
        super().__init__(spec)
        self.module = module
        self._spans = TorchSDPAImpl(spec)  # steps with bidirectional spans

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                attn: AttentionMetadata) -> torch.Tensor:
        if attn.attn_spans:
            return self._spans.forward(q, k, v, kv_layer, attn)
        t = q.shape[0]
        plan: TorchPlan = attn.plan
        if plan.decode is not None and plan.decode.rows is None:  # decode-only step
            return self._decode(q, kv_layer, plan.decode).view(t, -1)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if plan.decode is not None:
            out.index_copy_(0, plan.decode.rows, self._decode(q, kv_layer, plan.decode))
        self.module.paged_prefill_attention(q, kv_layer[0], kv_layer[1], attn.block_tables, attn.seq_lens,
                                            attn.query_start_loc, plan.prefill_ids, self.scale, out)
        return out.view(t, -1)

    def _decode(self, q: torch.Tensor, kv_layer: torch.Tensor, g: _DecodeGroup) -> torch.Tensor:
        qd = q if g.rows is None else q.index_select(0, g.rows)
        return self.module.paged_decode_attention(qd.contiguous(), kv_layer[0], kv_layer[1], g.tables,
                                                  g.seq_lens, self.scale)


class CpuNativeBackend(AttentionBackend):
    name = "native"

    def __init__(self, module: Any, kv_fp8: bool = False):
        self.module = module
        self.ops = module  # the same module holds RMSNorm, SwiGLU and rotary
        self.kv_fp8 = kv_fp8  # the kernels read FP8 caches as they are; only describe() tells
        self._sdpa_layers = False  # set by make_impl when a layer needs SDPA

    def describe(self) -> str:
        """What attends: the kernels (over the FP8 cache when there is one), and whether
        some layers (sliding window, sinks) run on SDPA."""
        notes = (["kernels read the FP8 KV cache"] if self.kv_fp8 else []) + \
            (["sliding-window / sink layers on torch SDPA"] if self._sdpa_layers else [])
        return f"{self.name} ({'; '.join(notes)})" if notes else self.name

    def plan(self, attn: AttentionMetadata, block_size: int) -> TorchPlan:
        return TorchPlan(attn, block_size, native=True, torch_prefills=self._sdpa_layers or bool(attn.attn_spans))

    def make_impl(self, spec: AttentionSpec) -> AttentionImpl:
        if spec.sliding_window or spec.sinks:
            self._sdpa_layers = True
            return TorchSDPAImpl(spec)
        return CpuNativeImpl(spec, self.module)
