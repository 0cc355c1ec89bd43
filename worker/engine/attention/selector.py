"""Which attention backend an engine runs (``--attention-backend``).

auto: on CUDA, Triton (it ships with PyTorch's CUDA wheels), else FlashAttention
when installed, else torch SDPA; on CPU, the compiled kernels when they build
(``--cpu-attention``), else torch SDPA.  An explicit choice that cannot be served
here is an error, never a silent fallback.
"""
from __future__ import annotations

from typing import Optional

import logging
import os

import torch

from worker.engine.attention.backends.base import AttentionBackend
from worker.engine.config import ATTENTION_BACKEND_CHOICES

log = logging.getLogger(__name__)



def _triton_kernels():
    from worker.engine.kernels import triton as triton_kernels

    return triton_kernels.ops() if triton_kernels.triton_available() else None


def resolve_attention_backend(choice: str, cpu_attention: str, device: torch.device, dtype: torch.dtype,
                              block_size: int, kv_dtype: Optional[torch.dtype] = None,
                              sinks: bool = False, bidirectional_spans: bool = False) -> AttentionBackend:
    """``kv_dtype``: an FP8 KV cache (``--kv-cache-dtype``), None when it holds ``dtype``;
    ``sinks``: the model's attention has sink logits (GPT-OSS), which FlashAttention's
    kernel here does not take; ``bidirectional_spans``: the model opens the causal mask
    within spans of a prompt (Gemma 3's images), which only torch SDPA serves."""
    from worker.engine.attention.backends.torch_sdpa import TorchSDPABackend

    if choice not in ATTENTION_BACKEND_CHOICES:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKEND_CHOICES)}, got {choice!r}")
    if bidirectional_spans and (device.type != "cpu" or choice not in ("auto", "torch", "native")):
        # The CPU backends serve such steps on SDPA (cpu_native.py); the CUDA kernels here
        # (Triton, FlashAttention) have causal masks only: refused, never a silent causal mask.
        if choice not in ("auto", "torch"):
            raise ValueError(f"attention_backend={choice}: this model's image tokens attend to each other both "
                             "ways, which only the torch and native (CPU) backends implement here (use "
                             "--attention-backend torch or auto)")
        return TorchSDPABackend()
    if choice == "torch":
        return TorchSDPABackend()
    if choice == "native" or (choice == "auto" and device.type == "cpu"):
        if device.type != "cpu":
            raise ValueError("attention_backend=native is the compiled CPU kernels; it cannot serve a CUDA device")
        from worker.engine.attention.backends.cpu_native import CpuNativeBackend
        from worker.engine.kernels import resolve_cpu_kernels

        module = resolve_cpu_kernels("native" if choice == "native" else cpu_attention, device, dtype)
        return CpuNativeBackend(module, kv_fp8=kv_dtype is not None) if module is not None else TorchSDPABackend()
    if choice == "triton" or (choice == "auto" and device.type == "cuda"):
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend=triton on CPU tensors needs TRITON_INTERPRET=1 (Triton's interpreter)")
        kernels = _triton_kernels()
        if kernels is not None:
            from worker.engine.attention.backends.triton_unified import TritonBackend

            return TritonBackend(kernels)
        if choice == "triton":
            raise ValueError("attention_backend=triton: the triton package is not installed")
        log.warning("triton is not installed; trying FlashAttention, then torch SDPA for CUDA attention")
    # flash_attn, or auto on CUDA without Triton
    from worker.engine.attention.backends.flash_attn import FlashAttnBackend, load_flash_varlen

    loaded = load_flash_varlen() if device.type == "cuda" else None
    problem = None
    if loaded is None:
        problem = "neither vllm_flash_attn nor flash_attn is importable on a CUDA device"
    elif block_size % loaded[1]:
        problem = f"this FlashAttention build pages only block sizes that are multiples of {loaded[1]}"
    elif dtype not in (torch.float16, torch.bfloat16):
        problem = "FlashAttention needs float16 or bfloat16"
    elif kv_dtype is not None:
        problem = "this engine's FlashAttention path reads model-dtype KV caches, not FP8 (--kv-cache-dtype)"
    elif sinks:
        problem = "this engine's FlashAttention path has no attention sinks (GPT-OSS); the Triton backend has them"
    if problem is None:
        return FlashAttnBackend(loaded)
    if choice == "flash_attn":
        raise ValueError(f"attention_backend=flash_attn: {problem}")
    log.warning("CUDA attention falls back to torch SDPA (%s): decode steps run without CUDA graphs", problem)
    return TorchSDPABackend()
