"""One attention case for checkpoint KV-cache scales over an FP8 cache, shared by the CPU
backends' test (tests/unit/engine/test_kv_cache_fp8.py) and the Triton backend's under
the interpreter (tests/support/triton_interpreted_quant.py): three chunks (a prefill, a
prefill over cached context, a decode step) whose K/V reach ~2000, past e4m3's 448, so
scale 1.0 saturates and the calibrated scales (amax / 448, as llm-compressor) do not."""
from __future__ import annotations

import torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 4
TABLES = [[3, 7, 1, 9, 2]]
STEPS = [(7, 0), (5, 7), (1, 12)]  # (new tokens, cached context) per chunk


def kv_scale_case(backend_for):
    """``(run, k_scale, v_scale, qkv)``: ``run(cache_dtype, scales)`` attends the chunks
    through a ``PagedAttention`` on ``backend_for(cache_dtype)`` (``scales``: (k, v) or
    None) and returns (output, cache); ``qkv`` the chunks' q, k, v."""
    from worker.engine.attention.layer import PagedAttention
    from worker.engine.attention.metadata import build_attention_metadata

    torch.manual_seed(0)
    qkv = [(torch.randn(n, HEADS, HEAD_DIM) * 0.002, torch.randn(n, KV_HEADS, HEAD_DIM) * 600,
            torch.randn(n, KV_HEADS, HEAD_DIM) * 600) for n, _ in STEPS]
    ks = max(k.abs().max().item() for _, k, _ in qkv) / 448
    vs = max(v.abs().max().item() for _, _, v in qkv) / 448

    def run(cache_dtype, scales):
        layer = PagedAttention(HEADS, KV_HEADS, HEAD_DIM)
        layer.set_backend(backend_for(cache_dtype))
        if scales:
            layer.set_kv_scales(*scales)
        cache = torch.zeros(2, 12, BLOCK, KV_HEADS, HEAD_DIM, dtype=cache_dtype)
        outs = [layer(q, k, v, cache, build_attention_metadata([n], [ctx], TABLES, BLOCK, "cpu"))
                for (q, k, v), (n, ctx) in zip(qkv, STEPS)]
        return torch.cat(outs), cache

    return run, ks, vs, qkv
