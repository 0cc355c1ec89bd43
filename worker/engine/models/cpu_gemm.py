"""Prepacked weights for the linear layers on CPU: oneDNN's, or our native bf16 GEMM's.

A scheme (``PackedLinears``) says how a projection weight is packed once after loading,
how a step multiplies by it, and how it is unpacked exactly (weight updates).  The
model composes whichever scheme ``resolve_cpu_linear`` picked; nothing else knows which.

``native`` (bf16 only; worker/engine/kernels/bf16_gemm.cpp): our GEMM over a weight packed
for bf16 dot products (AVX512-BF16) or widened in registers (AVX2), one kernel for every
row count, so results are batch-invariant.  ``auto`` picks it for bf16 where oneDNN has
no fast bf16 path: CPUs without AMX.  Measured with benchmarks/cpu_gemm_bench.py (one
thread): on a 2-core AVX2 EPYC (no bf16 instructions) torch's bf16 linear ran 2x slower
than fp32 at one row and 7-10x slower at 32-512 rows, and oneDNN refuses to pack bf16
there; native bf16 ran 2-2.5x faster than the fp32 oneDNN GEMM at one row (it streams
half the bytes: decode is bandwidth-bound) and 0.8-1x its speed at 32-512 rows.  With
AMX, oneDNN's tiles win from a few rows up, so ``auto`` keeps it.

oneDNN: ``F.linear`` on CPU calls MKL sgemm, which re-reads the weight in its row-major
layout every call.  oneDNN can reorder a weight once into its blocked layout
(``_reorder_linear_weight``) and then run every matmul against that layout: on a
2-core AVX2 EPYC this measured 10-25 % faster for prefill-sized steps (M = 512-2048
rows) and about even for decode-sized ones.  vLLM's CPU backend does the same
(``onednn_mm`` over weights packed for M = 32).

oneDNN builds (JIT-compiles) one primitive per input shape and keeps 1024 in an
LRU cache.  A server sees every row count from 1 to the step budget, and once the
cache thrashes each call pays the build again (measured: 5x slower than MKL
overall).  So row counts are rounded up to 8 buckets per octave (exact up to 16):
at most 72 shapes per weight up to 2048 rows, padding waste <= 12.5 %, and the
usual sizes (powers of two, a full step budget) are exact.

bf16 weights are packed the same way (bf16 GEMM, fp32 accumulation, bf16 output).
Measured on a 2-core Sapphire Rapids (AMX) with torch.utils.benchmark, one thread,
[1536, 512] / [512, 1536] / [4096, 512] weights: the packed bf16 GEMM ran 4-8x faster
than the packed fp32 one at M = 32 and 512, and 1.3-4x at M = 1 (noisy machine), and
within noise of, or faster than, bf16 ``F.linear`` at every M, so bf16 uses it for every
shape (torch's own bf16 linear reorders the weight on each call).

Results differ from MKL's in the last bits (~1e-4 relative on logits of a random
model), so the engine exposes the choice (``cpu_linear``: ``onednn`` / ``torch``),
and parity tests against HF transformers allow for it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from common.dtype_policy import cpu_flags, cpu_has_native_bf16

log = logging.getLogger(__name__)

LinearFn = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]

# Batch-size hint for the packed layout.  Measured on the decode (M 1-128) and
# prefill (M 512-2048) shapes, a layout packed for 32 rows is within noise of the
# best one for each M; vLLM packs for 32 as well.
PACK_ROWS = 32


def row_bucket(rows: int) -> int:
    """``rows`` rounded up to one of 8 steps per power of two (exact up to 16)."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)  # 1/8 of the octave [2^k, 2^(k+1)) holding rows
    return -(-rows // step) * step


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    rows = x.shape[0]
    padded = row_bucket(rows)
    if padded != rows:
        # Rows are independent in a GEMM: the zero rows only cost their own compute.
        xp = x.new_empty((padded, x.shape[1]))
        xp[:rows] = x
        xp[rows:].zero_()
        return torch.ops.mkldnn._linear_pointwise(xp, packed, bias, "none", [], "")[:rows]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a ``[out, in]`` weight (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS)


def onednn_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """fp32, or bf16 on a CPU with native bf16 dot products (AMX-BF16 / AVX512-BF16:
    oneDNN picks the AMX kernels where the CPU has them), on a CPU torch built with
    oneDNN; the op must also accept a trial call."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype not in (torch.float32, torch.bfloat16) or (dtype == torch.bfloat16 and not cpu_has_native_bf16()):
        return False
    try:
        w = torch.randn(8, 16).to(dtype)
        x = torch.randn(3, 16).to(dtype)
        ref = F.linear(x.float(), w.float())
        # bf16 results are rounded to 8 significant bits: allow for that rounding only.
        atol = 1e-4 if dtype == torch.float32 else 0.05 * float(ref.abs().max())
        return torch.allclose(onednn_linear(x, pack_weight(w), None).float(), ref, atol=atol)
    except (RuntimeError, AttributeError) as e:  # op missing or dtype unsupported by this build
        log.info("oneDNN linear unavailable (%s); using torch's", e)
        return False


@dataclass(frozen=True)
class PackedExperts:
    """How a scheme keeps a MoE layer's expert stacks (``w13 [E, 2I, H]``, ``w2 [E, H, I]``)
    whole: ``pack`` each stack once, ``run(x, w13, w2, topk_weights, topk_ids, act)`` the
    routed experts' weighted sum ``[T, H]`` every step, ``unpack`` back to the dense stack
    (weight updates).  Quantizing schemes use it (online FP8: the fused-MoE W8A8 kernel on
    CUDA, its emulation on CPU); the router then stays in the model dtype, as in vLLM."""

    pack: Callable[[torch.Tensor], Any]
    run: Callable[..., torch.Tensor]
    unpack: Callable[[Any], torch.Tensor]


@dataclass(frozen=True)
class PackedLinears:
    """How a CPU GEMM scheme keeps projection weights: ``pack`` once after loading (the
    result replaces the ``[out, in]`` weight), ``linear(x, packed, bias)`` every step,
    ``unpack`` back to the exact dense weight (weight updates write into that).
    ``packs_experts``: MoE expert stacks are packed too, one weight per expert (the
    native GEMM per expert group beat torch's grouped GEMM 10x in bf16 on an AVX2 CPU;
    oneDNN would build a primitive per expert and row count, so its experts stay dense).
    ``accepts``: whether a ``[out, in]`` weight can be packed (the native layout pairs
    input columns, so the input dimension must be even)."""

    name: str
    pack: Callable[[torch.Tensor], torch.Tensor]
    linear: LinearFn
    unpack: Callable[[torch.Tensor], torch.Tensor]
    packs_experts: bool = False
    accepts: Callable[[torch.Tensor], bool] = lambda weight: True
    # The LM head's packing when it differs (a quantizing scheme keeps the head in the
    # model dtype, as vLLM does); None: this scheme.
    head: Optional["PackedLinears"] = None
    # Expert stacks packed whole (PackedExperts) instead of one weight per expert; needs
    # packs_experts.
    experts: Optional[PackedExperts] = None

    @property
    def head_scheme(self) -> "PackedLinears":
        return self.head if self.head is not None else self


ONEDNN = PackedLinears("onednn", pack_weight, onednn_linear, lambda packed: packed.to_dense())
DENSE = PackedLinears("torch", lambda w: w, F.linear, lambda w: w)  # dense weights, torch's GEMM


def native_linears(kernels: Any) -> PackedLinears:
    """Our bf16 GEMM (worker/engine/kernels/bf16_gemm.cpp) from the loaded kernel library."""
    gemm = kernels.bf16_linear

    def linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return gemm(x if x.stride(-1) == 1 else x.contiguous(), packed, bias)

    return PackedLinears("native", kernels.pack_bf16_weight, linear, kernels.unpack_bf16_weight, packs_experts=True,
                         accepts=lambda weight: weight.shape[-1] % 2 == 0)


def _native_kernels() -> Optional[Any]:
    from worker.engine.kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    if kernels is None or not hasattr(kernels, "native_bf16_gemm_isa") or not kernels.native_bf16_gemm_isa():
        return None
    return kernels


def native_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """bf16 on a CPU the native GEMM was built for, and a trial against an fp32 GEMM of
    the same operands (row and column tails included) passes: a kernel that computes
    wrong on this CPU is never used."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    kernels = _native_kernels()
    if kernels is None:
        return False
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 36, generator=g).bfloat16()
    b = torch.randn(40, generator=g).bfloat16()
    scheme = native_linears(kernels)
    packed = scheme.pack(w)
    if not torch.equal(scheme.unpack(packed), w):
        return False
    for rows in (1, 5):
        x = torch.randn(rows, 36, generator=g).bfloat16()
        ref = F.linear(x.float(), w.float(), b.float())
        bound = 2 ** -7 * F.linear(x.float().abs(), w.float().abs(), b.float().abs()) + 1e-6
        if not ((scheme.linear(x, packed, b).float() - ref).abs() <= bound).all():
            log.warning("the native bf16 GEMM (%s) failed its trial on this CPU; not using it",
                        kernels.native_bf16_gemm_isa())
            return False
    return True


def auto_prefers_native(flags: Optional[frozenset[str]] = None) -> bool:
    """For bf16, ``auto`` takes the native GEMM unless the CPU has AMX-BF16, where
    oneDNN's tile kernels are faster from a few rows up."""
    return "amx_bf16" not in (cpu_flags() if flags is None else flags)


def resolve_cpu_linear(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` -> for bf16, ``native`` where it runs and the CPU has no AMX, else
    ``onednn`` where supported, else ``torch``; for fp32, ``onednn`` where supported, else
    ``torch``.  An explicit choice the build cannot run is an error, not a fallback."""
    if device.type != "cpu" or choice == "torch":
        return "torch"
    if choice == "native":
        if not native_supported(device, dtype):
            raise ValueError(f"cpu_linear=native is not supported for {dtype} on this CPU/build "
                             "(it serves bfloat16 on CPUs with AVX512-BF16 or AVX2+FMA, with the kernels built)")
        return "native"
    if choice == "auto" and dtype == torch.bfloat16 and auto_prefers_native() and native_supported(device, dtype):
        return "native"
    ok = onednn_supported(device, dtype)
    if choice == "onednn" and not ok:
        raise ValueError(f"cpu_linear=onednn is not supported for {dtype} on this CPU/torch build")
    return "onednn" if ok else "torch"


def linear_scheme(name: str) -> Optional[PackedLinears]:
    """The packing of a resolved choice; None for ``torch`` (dense weights, F.linear)."""
    if name == "onednn":
        return ONEDNN
    if name == "native":
        kernels = _native_kernels()
        assert kernels is not None, "resolve_cpu_linear chose native without the kernels"
        return native_linears(kernels)
    return None
