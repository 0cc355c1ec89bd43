"""oneDNN-prepacked weights for the linear layers on CPU.

``F.linear`` on CPU calls MKL sgemm, which re-reads the weight in its row-major
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
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from common.dtype_policy import cpu_has_native_bf16

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


def resolve_cpu_linear(choice: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` -> ``onednn`` where supported, else ``torch``; an explicit ``onednn``
    that the build cannot run is an error rather than a silent fallback."""
    if device.type != "cpu":
        return "torch"
    if choice == "torch":
        return "torch"
    ok = onednn_supported(device, dtype)
    if choice == "onednn" and not ok:
        raise ValueError(f"cpu_linear=onednn is not supported for {dtype} on this CPU/torch build")
    return "onednn" if ok else "torch"
