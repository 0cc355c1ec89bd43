"""Builds the model a rank runs: weights (this rank's shard under tensor
parallelism), the CPU linear choice and the attention backend with its fused ops.
The engine and the tensor-parallel followers share it, so every rank runs the same
kernels."""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch

from worker.engine.attention.backends.base import AttentionBackend
from worker.engine.attention.selector import resolve_attention_backend
from worker.engine.config import EngineConfig
from worker.engine.loading.loader import load_model, safetensors_files
from worker.engine.models.config import ModelConfig
from worker.engine.models.cpu_gemm import linear_scheme, onednn_supported, resolve_cpu_linear
from worker.engine.models.layers import staged_projections
from worker.engine.quantization.config import ONLINE_SUPPORTED
from worker.engine.quantization.kept import INT4_METHODS, KeptQuantized, cpu_int4_kernels, keeps_quantized
from worker.engine.quantization.kv_scales import KvScales
from worker.engine.quantization.online_fp8 import online_fp8_scheme

log = logging.getLogger(__name__)


def build_model(config: EngineConfig, mc: ModelConfig, device: torch.device) -> tuple[Any, AttentionBackend, str]:
    """(model, attention backend, cpu linear choice)."""
    size = sum(f.stat().st_size for f in safetensors_files(config.model))
    dtype, why = config.dtype_choice(device)
    log.info("loading weights from %s (%.2f GB of safetensors) onto %s as %s (%s)", config.model, size / 1e9, device,
             dtype, why)
    started = time.monotonic()
    kept = _kept_quantized(config, mc, device)
    kv_scales = KvScales() if mc.quantization is not None else None
    # A GPU keeping a checkpoint quantized never holds its dense projections: they are
    # staged in host memory and each is quantized onto the GPU once loaded (kept.filled).
    staging = staged_projections("cpu") if kept is not None and device.type != "cpu" else contextlib.nullcontext()
    with staging:
        model = load_model(config.model, dtype=config.torch_dtype, device=device, config=mc,
                           keep=kept.keep if kept is not None else None,
                           kv=kv_scales.add if kv_scales is not None else None,
                           filled=kept.filled if kept is not None else None)
    log.info("weights loaded in %.1f s", time.monotonic() - started)
    if kv_scales is not None:
        kv_scales.apply(model, fp8_cache=config.kv_dtype is not None)
    from worker.engine.loading.weights import weight_spec

    model.weight_spec = weight_spec(model)  # what weight updates may name (cheap before packing)
    cpu_linear = resolve_cpu_linear(config.cpu_linear, device, config.torch_dtype)
    scheme = linear_scheme(cpu_linear)
    if scheme is not None and not model.packable(scheme):
        if config.cpu_linear == cpu_linear:  # asked for by name: say why it cannot be
            raise ValueError(f"--cpu-linear {cpu_linear} cannot pack this model's weights (an odd input "
                             "dimension); use --cpu-linear onednn or torch")
        fallback = "onednn" if cpu_linear != "onednn" and onednn_supported(device, config.torch_dtype) else "torch"
        log.warning("the %s GEMM cannot pack this model's weights (an odd input dimension): %s linears instead",
                    cpu_linear, fallback)
        cpu_linear, scheme = fallback, linear_scheme(fallback)
    if config.quantization in ONLINE_SUPPORTED and mc.quantization is None:
        if mc.moe is not None and mc.moe.expert_bias:
            raise ValueError("--quantization fp8 (online) on a model whose experts have biases (GPT-OSS) is not "
                             "supported: those experts have no FP8 path")
        scheme = online_fp8_scheme(device, scheme)
        log.info("online quantization: %s; weights re-quantized after every weight update", scheme.name)
    if kept is not None:
        kept.bind(model)
        scheme = kept.scheme(scheme)
    if scheme is not None:
        model.pack_linears(scheme)
    if kept is not None:
        kept.finish()
        _check_placed(model, device)
        log.info("quantized checkpoint: %s; %d weight(s) (projections, expert stacks) kept quantized in memory "
                 "(%s), re-quantized after weight updates", mc.quantization.describe(), kept.kept, scheme.name)
    elif cpu_linear == "torch" and device.type == "cpu" and config.torch_dtype == torch.bfloat16 and \
            config.cpu_linear != "torch":
        # auto found neither GEMM for bf16 (kernels not built, no oneDNN bf16): torch's
        # linear emulates it here, several times slower than fp32.
        log.warning("bf16 linears run on torch's emulated path on this CPU (the native bf16 GEMM is not "
                    "available: run `tokserve build-kernels`); --dtype float32 would be faster")
    backend = resolve_attention_backend(config.attention_backend, config.cpu_attention, device,
                                        config.torch_dtype, config.block_size, config.kv_dtype,
                                        sinks=model.config.attention_sinks,
                                        bidirectional_spans=getattr(model, "image_attention", "") == "bidirectional")
    model.use_attention_backend(backend)
    return model, backend, cpu_linear


def _kept_quantized(config: EngineConfig, mc: ModelConfig, device: torch.device):
    """The scheme keeping a quantized checkpoint's weights quantized (quantization/kept.py)
    where it applies (one rank or tensor parallel), a method it has kernels for
    (MXFP4 experts load dequantized): on CUDA FP8 and int4 (Triton); on CPU int4 checkpoints
    (the C++ W4A16 GEMM: faster than the dequantized bf16 model at batch-1 decode, and a
    quarter of its weight bytes; benchmarks/README.md), FP8 ones dequantized."""
    q = mc.quantization
    if q is None or q.method == "mxfp4":
        return None
    cpu_kernels = cpu_int4_kernels(device) if q.method in INT4_METHODS else None
    if not keeps_quantized(device) and cpu_kernels is None:
        if device.type == "cpu" and q.method in INT4_METHODS:
            log.warning("int4 checkpoint: weights dequantized at load (the native CPU kernels are not built: run "
                        "`tokserve build-kernels` to keep them int4)")
        return None
    # Under tensor parallelism each rank cuts the records to its shard (KeptQuantized._rank_part).
    return KeptQuantized(q, cpu_kernels, device)


def _check_placed(model, device: torch.device) -> None:
    """Every parameter where the model runs once packed (staged projections included)."""
    stray = [name for name, p in model.named_parameters() if p.device.type != device.type]
    if stray:
        raise RuntimeError(f"{len(stray)} weight(s) left off {device} after packing: {', '.join(stray[:4])}")
