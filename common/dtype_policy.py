"""What ``--dtype auto`` serves, as vLLM 0.33 resolves it (``_resolve_auto_dtype``):
the checkpoint's ``torch_dtype``, with float32 checkpoints downcast to the
platform's preferred half type.

On CUDA that is bfloat16.  On CPU vLLM downcasts to bfloat16 unconditionally; we do
so only where the CPU has native bf16 dot products (AVX512-BF16 / AMX-BF16 on x86,
the BF16 extension on Arm), because elsewhere oneDNN emulates bf16 and prefill runs
5-20x slower than in float32.  float16 checkpoints are served in bfloat16 on CPU:
our CPU kernels and oneDNN linears have no fp16 path, and bf16 keeps fp16's
storage size with float32's range.
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
    native = cpu_has_native_bf16() if native_bf16 is None else native_bf16
    if stored == torch.bfloat16:
        return torch.bfloat16, "checkpoint's torch_dtype bfloat16" + ("" if native else
                                                                     " (this CPU emulates bf16 dot products)")
    if stored == torch.float16:
        return torch.bfloat16, "float16 checkpoint served in bfloat16 on CPU (no fp16 CPU kernels)"
    if native:
        return torch.bfloat16, "float32 checkpoint downcast to bfloat16: this CPU has native bf16 dot products"
    return torch.float32, "float32 checkpoint kept in float32: this CPU has no native bf16 dot products"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
