"""Triton kernels of the CUDA engine path: paged attention over the block table
(prefill chunks with cached context and decode rows in one launch), the KV-cache
write, RMSNorm (+ residual), rotary, SwiGLU, the fused mixture-of-experts GEMM, multi-head latent
attention decode over the latent cache (DeepSeek), the segmented LoRA matmuls, the quantized (FP8, int4) GEMMs,
the vision towers' variable-length attention and the structured-output grammar bitmask.

Importing this package does not import triton (CPU installs may lack it); ``ops()``
loads the kernels.  They also run on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``, read when the kernels are decorated), which is how CI
checks them against torch references, and ``compile_specs`` lists each kernel with
a signature for an ahead-of-time sm_90 compile (tests/unit/kernels/test_triton_compile.py).
"""
from __future__ import annotations

import importlib.util
from types import SimpleNamespace
from typing import Any, Optional

_ops: Optional[Any] = None


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def ops() -> Any:
    """Namespace of ``unified_attention``, ``reshape_and_cache``, ``rms_norm``,
    ``rotary_``, ``silu_and_mul``, ``fused_experts`` and ``varlen_attention`` (the element-wise three with the call semantics
    of the compiled CPU module, so a model uses either interchangeably)."""
    global _ops
    if _ops is None:
        from worker.engine.kernels.triton.attention import unified_attention
        from worker.engine.kernels.triton.bitmask import apply_bitmask_
        from worker.engine.kernels.triton.cache import reshape_and_cache
        from worker.engine.kernels.triton.elementwise import rms_norm, rotary_, silu_and_mul
        from worker.engine.kernels.triton.fused_moe import fused_experts
        from worker.engine.kernels.triton.mla_decode import mla_decode
        from worker.engine.kernels.triton.varlen_attention import varlen_attention

        _ops = SimpleNamespace(unified_attention=unified_attention, reshape_and_cache=reshape_and_cache,
                               rms_norm=rms_norm, rotary_=rotary_, silu_and_mul=silu_and_mul,
                               fused_experts=fused_experts, varlen_attention=varlen_attention,
                               apply_bitmask_=apply_bitmask_, mla_decode=mla_decode)
    return _ops


def compile_specs() -> list[tuple[str, Any, dict, dict]]:
    """(name, jit function, signature, constexprs) of every kernel, for ASTSource."""
    from worker.engine.kernels.triton.attention import compile_specs as attention_specs
    from worker.engine.kernels.triton.bitmask import compile_specs as bitmask_specs
    from worker.engine.kernels.triton.cache import compile_specs as cache_specs
    from worker.engine.kernels.triton.elementwise import compile_specs as elementwise_specs
    from worker.engine.kernels.triton.fused_moe import compile_specs as moe_specs
    from worker.engine.kernels.triton.lora import compile_specs as lora_specs
    from worker.engine.kernels.triton.mla_decode import compile_specs as mla_specs
    from worker.engine.kernels.triton.quant_gemm import compile_specs as quant_specs
    from worker.engine.kernels.triton.varlen_attention import compile_specs as varlen_specs

    return attention_specs() + cache_specs() + elementwise_specs() + moe_specs() + lora_specs() + varlen_specs() + bitmask_specs() + quant_specs() + mla_specs()
