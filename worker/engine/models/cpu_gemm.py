"""oneDNN-prepacked weights for the linear layers on CPU.

``F.linear`` on CPU calls MKL sgemm, which re-reads the weight in its row-major
layout every call.  oneDNN can reorder a weight once into its blocked layout
(``_reorder_linear_weight``) and then run every matmul against that layout: on a
2-core AVX2 EPYC this measured 10-25 % faster for prefill-sized steps (M = 512-2048
rows) and about even for decode-sized ones.  vLLM's CPU backend does the same
(``onednn_mm`` over weights packed for M = 32).

Results differ from MKL's in the last bits (~1e-4 relative on logits of a random
model), so the engine exposes the choice (``cpu_linear``: ``onednn`` / ``torch``),
and parity tests against HF transformers allow for it.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

LinearFn = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]

# Batch-size hint for the packed layout.  Measured on the decode (M 1-128) and
# prefill (M 512-2048) shapes, a layout packed for 32 rows is within noise of the
# best one for each M; vLLM packs for 32 as well.
PACK_ROWS = 32


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked copy of a ``[out, in]`` weight (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS)


def onednn_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """fp32 on a CPU torch built with oneDNN; the op must also accept a trial call
    (bf16 needs AVX-512 support in oneDNN, for one)."""
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.randn(8, 16, dtype=dtype)
        x = torch.randn(3, 16, dtype=dtype)
        return torch.allclose(onednn_linear(x, pack_weight(w), None), F.linear(x, w), atol=1e-4)
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
