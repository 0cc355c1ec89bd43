"""What ``--dtype auto`` serves, as vLLM 0.33 resolves it (``_resolve_auto_dtype``):
the checkpoint's ``torch_dtype``, with float32 checkpoints downcast to the
platform's preferred half type.

On CUDA that is bfloat16.  On CPU vLLM downcasts to bfloat16 unconditionally; we do so
where bf16 runs at least as fast as fp32: CPUs with bf16 dot products (AVX512-BF16 /
AMX-BF16 on x86, the BF16 extension on Arm) and x86 CPUs with AVX2 + FMA, where our
native bf16 GEMM widens bf16 to fp32 in registers (worker/engine/kernels/bf16_gemm.cpp:
measured 2x fp32's speed at batch 1, even at prefill).  Elsewhere (an x86 CPU without
AVX2, an Arm CPU without BF16) bf16 would be emulated and 5-20x slower, so float32
checkpoints stay float32.  float16 checkpoints are served in bfloat16 on CPU: our
CPU kernels and linears have no fp16 path, and bf16 keeps fp16's storage size with
float32's range.
"""
from __future__ import annotations

import functools
import json
import logging
import platform
from pathlib import Path
from typing import Optional

import torch

log = logging.getLogger(__name__)

_CHECKPOINT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags Linux reports (empty where /proc/cpuinfo is absent)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, Arm
            return frozenset(value.split())
    return frozenset()


def cpu_has_native_bf16(flags: Optional[frozenset[str]] = None) -> bool:
    """bf16 dot products in hardware: AMX-BF16 or AVX512-BF16 on x86, BF16 on Arm."""
    flags = cpu_flags() if flags is None else flags
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "bf16" in flags
    return bool({"amx_bf16", "avx512_bf16"} & flags)


def cpu_runs_bf16_fast(flags: Optional[frozenset[str]] = None) -> bool:
    """bf16 at least as fast as fp32 here: native bf16 dot products, or AVX2 + FMA on x86
    (the native bf16 GEMM's widening path)."""
    flags = cpu_flags() if flags is None else flags
    if cpu_has_native_bf16(flags):
        return True
    return platform.machine().lower() in ("x86_64", "amd64") and {"avx2", "fma"} <= flags


def checkpoint_dtype(model_dir: str | Path) -> Optional[torch.dtype]:
    """``torch_dtype`` of ``model_dir``'s config.json (float32 when it names none);
    None when there is no readable config (the loader reports that later)."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return _CHECKPOINT_DTYPES.get(name) if isinstance(name, str) else None


def resolve_auto_dtype(checkpoint: Optional[torch.dtype], device: torch.device,
                       native_bf16: Optional[bool] = None) -> tuple[torch.dtype, str]:
    """(dtype ``auto`` serves, why) for a checkpoint stored in ``checkpoint``."""
    stored = checkpoint or torch.float32
    if device.type == "cuda":
        if stored == torch.float32:
            return torch.bfloat16, "float32 checkpoint downcast to bfloat16 on CUDA, as vLLM"
        return stored, f"checkpoint's torch_dtype {_name(stored)}"
    fast = cpu_runs_bf16_fast() if native_bf16 is None else native_bf16
    if stored == torch.bfloat16:
        return torch.bfloat16, "checkpoint's torch_dtype bfloat16" + ("" if fast else
                                                                     " (this CPU emulates bf16 dot products)")
    if stored == torch.float16:
        return torch.bfloat16, "float16 checkpoint served in bfloat16 on CPU (no fp16 CPU kernels)"
    if fast:
        why = "native bf16 dot products" if cpu_has_native_bf16() else "AVX2+FMA (the native bf16 GEMM)"
        return torch.bfloat16, f"float32 checkpoint downcast to bfloat16 as vLLM: this CPU runs bf16 fast ({why})"
    return torch.float32, "float32 checkpoint kept in float32: this CPU would emulate bf16 (no AVX2+FMA, no bf16)"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
