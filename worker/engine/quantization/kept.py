"""Checkpoint-quantized weights kept quantized in memory (issue 43): on CUDA FP8
checkpoints on the Triton W8A8 GEMM, int4 ones (AWQ, GPTQ act-order included,
compressed-tensors W4A16) on the Triton W4A16 GEMM (kernels/triton/quant_gemm.py); on CPU
int4 ones on the C++ W4A16 GEMM (below).  This module is the packing scheme and its
bookkeeping; the kept weights' forms (records, quantizing, unpacking, the CUDA linear) are
kept_forms.py, the MoE expert stacks kept_experts.py.

How the quantized tensors get here.  The reader (reader.dequantize_stream) still hands
the model dense weights -- each family's name mapping, q/k/v and gate/up fusing and
expert stacking only know dense tensors -- and, through its ``keep`` hook, each quantized
layer's scales (and zero points) as a ``ScaleRecord``.  After loading, ``bind`` finds,
through the model's public ``weight_targets`` (checkpoint name -> the view of the fused
parameter it was copied into), which rows of which parameter each record covers.
Packing a parameter then recovers the checkpoint's integers exactly from the dense
values: a dense value is ``q * s`` (FP8) or ``(q - z) * s`` (int4) rounded to the model
dtype, at worst 2^-9 relative off, far inside half a quantization step (FP8 e4m3 steps
are 2^-3 relative; int4 ones are ``s`` with ``|q - z| <= 15``), so dividing by the
scale and rounding gives back ``q`` bit for bit (tests assert it against the file).
The resident weights are then the checkpoint's FP8 bytes or int4 nibbles plus scales;
the dense copy exists only while loading: each projection (and expert stack) is packed as
soon as the loader reports its rows copied (``filled``) and its dense pages handed back --
on CPU in place, for a GPU from host memory, where the projections are staged while loading
(models/layers.staged_projections), onto the GPU.

Per-part scales of a fused parameter are laid out per output row, so q/k/v parts with
different per-tensor scales stay exact (vLLM re-quantizes them to the largest scale
instead): FP8 per-tensor and per-channel become one scale per row, 128 x 128 blocks
become one scale per row and 128-column group (the W8A8 kernel's ``block=(1, 128)``).

RL weight updates: the update unpacks (dense again), writes the trainer's weights and
packs: a weight that was quantized is re-quantized from its new values (FP8: one scale
per row, as online FP8; int4: round-to-nearest per group with a zero point), one that
was dense (the config's ignore list) stays dense.

MoE experts: an expert stack ``[E, N, K]`` is one parameter whose rows are every expert's
parts, so it is bound like a fused projection.  CUDA: where FP8 records cover it, it is
kept FP8 or int4 (``pack_stack``: each expert from its own record) and run by the
fused-MoE kernel's W8A8 mode (per channel or per block) or its W4A16 mode (act-order
experts reading their input through their own permutation; kernels/triton/fused_moe.py).
CPU: int4 experts are kept one W4A16 weight per expert (``pack_int4_stack``: each expert's
own record, act-order included), run per expert group like the dense experts.

On CPU (``cpu_int4_kernels``) int4 layers are kept for the C++ W4A16 GEMM
(kernels/int4_gemm.cpp, ``CpuInt4Weight``): batch-1 decode streams the weights, and a
quarter of the bytes measured faster than the dequantized bf16 model (benchmarks/README.md).
FP8 layers load dequantized there: the CPU has no FP8 dot products and converting per call
measured ~50x slower than the dense GEMM.  Every layer not kept (FP8, ignored, refused,
the LM head, FP8 or dense MoE experts) runs on the CPU linear scheme the engine chose (``inner``: the
native bf16 GEMM where it runs), not on torch's bf16 linear.  ``TOKSERVE_KEEP_QUANTIZED=1``
instead runs CUDA's Triton scheme on CPU tensors (under TRITON_INTERPRET=1, for tests).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from common.malloc_tuning import release_pages, trim_freed_memory
from worker.engine.models.cpu_gemm import DENSE, PackedExperts, PackedLinears
from worker.engine.quantization.config import CheckpointQuantization, WeightScheme
from worker.engine.quantization.kept_experts import Int4Experts, run_experts, stack_experts, unpack_experts
from worker.engine.quantization.kept_forms import (CpuInt4Weight, Fp8BlockWeight, Int4Weight, ScaleRecord,
                                                   cpu_int4_fits, fp8_from, int4_from, kept_linear, record_for,
                                                   requantize_int4, unpack_kept, weight_bytes)
from worker.engine.quantization.online_fp8 import Fp8Weight, quantize_rows, quantize_stack

__all__ = ["INT4_METHODS", "FORCE_ENV", "keeps_quantized", "cpu_int4_kernels", "KeptQuantized", "CpuInt4Weight",
           "Fp8BlockWeight", "Int4Weight", "Int4Experts", "weight_bytes"]

log = logging.getLogger(__name__)

# Methods whose checkpoints may hold int4 layers (kept int4 on CPU; compressed-tensors may
# hold FP8 instead, whose layers then load dequantized there).
INT4_METHODS = ("awq", "gptq", "compressed-tensors")

# Tests only: run the kept schemes on CPU tensors (under TRITON_INTERPRET=1) as CUDA does.
FORCE_ENV = "TOKSERVE_KEEP_QUANTIZED"


def keeps_quantized(device: torch.device) -> bool:
    """Whether checkpoint-quantized weights stay quantized on ``device``: on CUDA (the
    Triton GEMMs); on CPU only when a test forces it (``TOKSERVE_KEEP_QUANTIZED=1``)."""
    return device.type == "cuda" or os.environ.get(FORCE_ENV) == "1"


def cpu_int4_kernels(device: torch.device):
    """The kernel library when int4 layers can stay int4 on ``device`` (a CPU with the
    native kernels built, the Triton path not forced), else None (they load dequantized)."""
    if device.type != "cpu" or keeps_quantized(device):
        return None
    from worker.engine.kernels import load_cpu_kernels

    kernels = load_cpu_kernels()
    return kernels if kernels is not None and hasattr(kernels, "int4_linear") else None


# --- the scheme ----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Requantize:
    """How a weight an RL update unpacked is quantized again when packed: FP8 one scale per
    row (keeping a static input scale: the update sends none, the calibrated input range
    is the checkpoint's, as in vLLM), or int4 round-to-nearest per ``group`` columns."""

    kind: str  # "fp8" | "int4"
    group: Optional[int] = None
    input_scale: Optional[torch.Tensor] = None


class KeptQuantized:
    """Collects the reader's records (``keep``), binds them to the model's parameters
    (``bind``) and is the packing scheme (``scheme``) that keeps them quantized."""

    def __init__(self, quant: CheckpointQuantization, cpu_kernels=None, device: Optional[torch.device] = None):
        """``cpu_kernels``: the CPU kernel library (``cpu_int4_kernels``): int4 layers kept
        for its GEMM, FP8 ones left dense; None: CUDA's Triton scheme for both.  ``device``:
        where the model runs, when its projections are staged elsewhere while loading
        (models/layers.staged_projections: in host memory, for a GPU): every packed weight,
        kept or dense, is put there."""
        self.quant = quant
        self.cpu_kernels = cpu_kernels
        self.device = device
        self.dense_here: dict[str, str] = {}  # layer -> why it is dense on this device (by design, not refused)
        self.records: dict[str, ScaleRecord] = {}  # checkpoint layer name -> record
        self.refused: dict[str, str] = {}  # layer -> why it loads dense
        self._bound: dict[int, list[tuple[int, int, ScaleRecord]]] = {}  # storage ptr -> (row, rows, record)
        self._requant: dict[int, _Requantize] = {}  # storage ptr of weights an update unpacked -> how to pack them
        self.kept = 0
        self.kinds: set[str] = set()
        # Packed while loading (CPU, ``filled``): storage identity -> the kept weight ``pack`` returns.
        self._early: dict[int, object] = {}
        self._targets: Optional[dict[str, torch.Tensor]] = None
        self._projections: dict[int, torch.Tensor] = {}  # storage ptr -> projection weight (CPU)
        self._slices: Optional[dict[str, tuple[int, int, int]]] = None  # tensor parallelism: what this rank holds
        self._rows_in: dict[int, int] = {}  # storage ptr -> rows of records filled so far

    # the reader's hook
    def keep(self, layer: str, scheme: WeightScheme, parts: dict[str, torch.Tensor]) -> None:
        rec = record_for(scheme, parts)
        if rec is not None and self.cpu_kernels is not None and rec.kind != "int4":
            self.dense_here[layer] = f"{rec.kind} on CPU"  # no FP8 GEMM worth running here
            return
        if rec is None:
            why = f"{scheme.kind} {scheme.num_bits}-bit, {scheme.strategy}"
            if scheme.kind == "fp8":
                why = f"fp8 stored as {parts['weight'].dtype}"
            elif scheme.num_bits == 4 and (parts.get("g_idx") is not None or parts.get("weight_g_idx") is not None):
                why = f"{scheme.kind} 4-bit with act-order groups of uneven size (g_idx)"
            self.refused[layer] = why
        else:
            self.records[layer] = rec

    def _rank_part(self, model, name: str, rec: ScaleRecord) -> tuple[Optional[ScaleRecord], str]:
        """``rec`` cut to the part of the layer this tensor-parallel rank holds (the slice the
        loader narrowed the dense weight to: rows, or columns in whole groups), and why not
        (the record None: the layer then stays dense) when the rank's columns start or end
        inside a group, or cut an act-order layer's input (its groups are spread over all of it)."""
        if self._slices is None:
            self._slices = model.weight_slices()
        cut = self._slices.get(name)
        if cut is None:
            return rec, ""
        dim, start, length = cut
        if dim == 0:
            scale = rec.row_scales().narrow(0, start, length)
            zero = rec.zero.narrow(0, start, length) if rec.zero is not None else None
            return ScaleRecord(rec.kind, scale, rec.group, zero, perm=rec.perm, input_scale=rec.input_scale), ""
        if rec.group is None:  # one scale per row: every column of the row shares it
            return rec, ""
        if rec.perm is not None:
            return None, "an act-order layer split along its input by tensor parallelism"
        if start % rec.group or length % rec.group:
            return None, "a tensor-parallel shard boundary inside a quantization group"
        g0, gn = start // rec.group, length // rec.group
        zero = rec.zero.narrow(1, g0, gn) if rec.zero is not None else None
        return ScaleRecord(rec.kind, rec.scale.narrow(1, g0, gn), rec.group, zero, rec.block_rows), ""

    def _bind_view(self, view: torch.Tensor, rec: ScaleRecord) -> int:
        key = view.untyped_storage().data_ptr()
        self._bound.setdefault(key, []).append((view.storage_offset() // view.stride(0), view.shape[0], rec))
        self.kinds.add(rec.kind)
        return key

    # the loader's hook
    def filled(self, model, name: str) -> None:
        """``name`` has been copied into the model.  Once every row of a projection (or of
        an expert stack) in host memory is covered by records, it is packed now and its
        dense pages handed back (``release_pages``: it stays the model's parameter, with its
        address and shape, until ``pack`` swaps the packed weight in, and nothing reads it
        before), so loading a kept-quantized model peaks near its packed size plus the layer
        in flight, not at the dense model's size.  On CPU that is the model itself; for a
        GPU the projections are staged in host memory while loading (``device``) and each is
        quantized onto the GPU here, so the GPU never holds the dense model either."""
        layer = name[: -len(".weight")] if name.endswith(".weight") else None
        rec = self.records.get(layer) if layer is not None else None
        if rec is None:
            return
        if self._targets is None:
            self._targets = model.weight_targets()
            # only what pack() (projections) and the experts' pack (whole stacks) will be handed
            self._projections = {w.untyped_storage().data_ptr(): w for w in
                                 model.projection_weights() + model.expert_stacks()
                                 if w.device.type == "cpu"}
        view = self._targets.get(name)
        whole = self._projections.get(view.untyped_storage().data_ptr()) if view is not None else None
        if whole is None or view.dim() != 2 or view.stride(0) != whole.stride(-2):
            return  # bound after loading instead
        del self.records[layer]
        rec, why = self._rank_part(model, name, rec)
        if rec is None:
            self.refused[layer] = why
            return
        key = self._bind_view(view, rec)
        self._rows_in[key] = self._rows_in.get(key, 0) + view.shape[0]
        if self._rows_in[key] < whole.numel() // whole.shape[-1]:
            return
        del self._rows_in[key]
        packed = self._kept_form(whole) if whole.dim() == 2 else self._kept_stack(whole)
        if packed is not None:
            self._early[whole.untyped_storage()._cdata] = packed
            release_pages(whole)
            # The dequantizing and packing temporaries (several times the layer in fp32 and
            # int64) are freed but sit in the heap between the kept layers (the CPU worker
            # never trims on its own, common/malloc_tuning.py): hand them back per layer,
            # or the load still peaks at several times the packed model.
            trim_freed_memory()

    @property
    def packed_while_loading(self) -> list:
        """The weights ``filled`` has packed so far, not yet handed to ``pack`` (each
        projection and expert stack, as soon as the loader filled it)."""
        return list(self._early.values())

    def bind(self, model) -> None:
        """Map each record ``filled`` did not already pack to the rows of the parameter its
        dense weight was copied into."""
        for name, view in model.weight_targets().items():
            if not name.endswith(".weight") or view.dim() != 2:
                continue
            rec = self.records.get(name[: -len(".weight")])
            if rec is None:
                continue
            part, why = self._rank_part(model, name, rec)
            if part is None:
                self.refused[name[: -len(".weight")]] = why
                continue
            self._bind_view(view, part)
        self.records.clear()  # what is bound lives on in _bound until packed
        self._rows_in.clear()  # parameters only partly covered by records: packed whole below
        if self.dense_here:
            log.info("%d %s layer(s) load dequantized (CPU: no FP8 dot products; converting per call measured "
                     "~50x slower than the dense GEMM)", len(self.dense_here), "/".join(sorted(set(
                         v.split()[0] for v in self.dense_here.values()))))
        if self.refused:
            log.warning("%d quantized layer(s) load dequantized (no kept-quantized kernel for %s)",
                        len(self.refused), ", ".join(sorted(set(self.refused.values()))))

    def _fused(self, w: torch.Tensor) -> Optional[ScaleRecord]:
        """The record covering every row of ``w`` (parts concatenated), None when some
        rows have none (a dense layer) or the parts disagree on their layout."""
        parts = self._bound.pop(w.untyped_storage().data_ptr(), None)
        if not parts:
            return None
        parts.sort(key=lambda p: p[0])
        return self._merged(w, parts, w.storage_offset() // w.stride(0))

    def _per_expert(self, stack: torch.Tensor) -> Optional[list[ScaleRecord]]:
        """One record per expert of a stack ``[E, N, K]`` (each expert's parts merged on
        their own: GPTQ quantizes every expert from the tokens routed to it, so act-order
        gives each its own column order), None unless every expert is covered."""
        parts = self._bound.pop(stack.untyped_storage().data_ptr(), None)
        if not parts:
            return None
        parts.sort(key=lambda p: p[0])
        e, n, _ = stack.shape
        base = stack.storage_offset() // stack.stride(1)
        mine: list[list] = [[] for _ in range(e)]  # one pass: a stack can hold hundreds of experts
        for part in parts:
            x = (part[0] - base) // n
            if 0 <= x < e:
                mine[x].append(part)
        recs = [self._merged(stack[x], mine[x], base + x * n) if mine[x] else None for x in range(e)]
        return None if any(r is None for r in recs) else recs

    def _merged(self, w: torch.Tensor, parts: list, base: int) -> Optional[ScaleRecord]:
        """The parts' records (sorted by row, from row ``base``) merged into one covering
        ``w``'s rows, None when they leave rows uncovered or disagree on their layout."""
        row = base
        for start, rows, _ in parts:
            if start != row:
                return None
            row += rows
        if row - base != w.shape[0]:
            return None
        recs = [p[2] for p in parts]
        kinds, groups = {r.kind for r in recs}, {r.group for r in recs}
        if len(kinds) != 1:
            return None
        perm = recs[0].perm
        if any((r.perm is None) != (perm is None) or (perm is not None and not torch.equal(r.perm, perm))
               for r in recs[1:]):
            # Fused parts (q/k/v, gate/up) read one input, so act-order quantization gives them one
            # column order; parts in different orders cannot share one kept weight: dense.
            log.warning("fused int4 parts with different act-order column orders load dequantized")
            return None
        if recs[0].kind == "fp8" and len(groups) > 1:  # per-channel beside blocks: rows by groups
            group = next(g for g in groups if g is not None)
            ngroups = -(-w.shape[1] // group)
            recs = [r if r.group else ScaleRecord("fp8", r.scale[:, None].expand(-1, ngroups).contiguous(), group)
                    for r in recs]
        elif len(groups) != 1:
            return None
        block_rows = {r.block_rows for r in recs}
        if len(block_rows) == 1 and all(rows % recs[0].block_rows == 0 for _, rows, _ in parts[:-1]):
            # whole blocks in every part (q/k/v of 128-row multiples): the scales stay per block
            r = recs[0].block_rows
        else:  # a part ends inside a block: one scale per row and column group instead
            recs = [ScaleRecord(x.kind, x.row_scales()[:rows], x.group, x.zero) for x, (_, rows, _) in zip(recs, parts)]
            r = 1
        # records are read on the host; the weight may be on the GPU
        zero = torch.cat([x.zero for x in recs]).to(w.device) if recs[0].zero is not None else None
        # static activations: one input scale for the fused input, the parts' largest (vLLM's
        # choice: no part's calibrated range is clipped); dynamic unless every part has one
        inputs = [p[2].input_scale for p in parts]
        static = torch.stack(inputs).max().to(w.device) if all(s is not None for s in inputs) else None
        return ScaleRecord(recs[0].kind, torch.cat([x.scale for x in recs]).to(w.device), recs[0].group, zero, r,
                           perm.to(w.device) if perm is not None else None, static)

    def finish(self) -> None:
        """Drop the records no packing took (CPU's MoE experts, int4 experts): call after packing."""
        self._bound.clear()
        self._early.clear()
        self._targets = None
        self._projections = {}

    def pack(self, w: torch.Tensor, inner: PackedLinears = DENSE):
        """``w`` kept quantized where a record covers it, else packed by ``inner``."""
        again = self._requant.pop(w.untyped_storage().data_ptr(), None)
        if again is not None:  # an RL update wrote new dense weights: quantize them afresh
            if again.kind == "fp8":
                q, scale = quantize_rows(w)
                return Fp8Weight(q, scale, w.dtype, again.input_scale)
            return requantize_int4(w, again.group, cpu=self.cpu_kernels is not None)
        early = self._early.pop(w.untyped_storage()._cdata, None)
        if early is not None:
            return early
        kept = self._kept_form(w)
        return inner.pack(self._on_device(w)) if kept is None else kept

    def _kept_form(self, w: torch.Tensor):
        """``w`` quantized as its records say, None where it stays dense."""
        rec = self._fused(w)
        if rec is not None and self.cpu_kernels is not None and not cpu_int4_fits(w, rec.group):
            log.warning("an int4 weight %s with group %d loads dequantized (the CPU kernel needs whole groups of a "
                        "multiple of 8 columns and fp32/bf16)", tuple(w.shape), rec.group)
            rec = None
        if rec is None:
            return None
        self.kept += 1
        return self._quantize(w, rec)

    def _quantize(self, w: torch.Tensor, rec: ScaleRecord):
        """``w`` quantized as ``rec`` says, where the model runs (a weight staged in host
        memory moves there first)."""
        w = self._on_device(w)
        rec = rec.to(w.device)
        return fp8_from(w, rec) if rec.kind == "fp8" else int4_from(w, rec, cpu=self.cpu_kernels is not None)

    def _unpacked(self, dense: torch.Tensor, again: _Requantize) -> torch.Tensor:
        """``dense`` (a weight an update unpacked) remembered for re-quantization on pack."""
        self._requant[dense.untyped_storage().data_ptr()] = again
        return dense

    def _on_device(self, w: torch.Tensor) -> torch.Tensor:
        return w if self.device is None or w.device == self.device else w.to(self.device)

    def _kept_stack(self, stack: torch.Tensor):
        """An expert stack packed as the scheme's experts will be (``filled``), None where
        it stays dense for now (then packed with the rest after loading)."""
        kept = self.pack_int4_stack(stack) if self.cpu_kernels is not None else self.pack_stack(stack)
        return None if kept is None or kept is stack or isinstance(kept, torch.Tensor) else kept

    def unpack(self, w, inner: PackedLinears = DENSE):
        if isinstance(w, (Fp8Weight, Fp8BlockWeight)):
            again = _Requantize("fp8", input_scale=getattr(w, "input_scale", None))
        elif isinstance(w, Int4Weight):
            again = _Requantize("int4", w.group)
        elif isinstance(w, CpuInt4Weight):
            again = _Requantize("int4", w.packed.group)
        else:  # a layer kept dense (packed by inner)
            return inner.unpack(w)
        return self._unpacked(unpack_kept(w), again)

    def scheme(self, inner: Optional[PackedLinears] = None) -> PackedLinears:
        """The packing scheme.  On CPU (``cpu_kernels``) the layers not kept int4, the LM
        head and experts not kept int4 go through ``inner`` (the engine's CPU linear scheme; torch's
        when None); CUDA's Triton scheme keeps them in the model dtype on torch's GEMM."""
        if self.cpu_kernels is None:
            what = " and ".join(sorted({"fp8": "FP8 W8A8", "int4": "int4 W4A16"}[k] for k in self.kinds)) or "none"
            # Expert stacks go through the fused-MoE kernel: kept FP8 or int4 where the records cover them.
            return PackedLinears(f"{self.quant.method} kept quantized (Triton {what})", self.pack, kept_linear,
                                 self.unpack, head=DENSE, packs_experts=True,
                                 experts=PackedExperts(self.pack_stack, run_experts, self.unpack_stack))
        return _cpu_scheme(self, inner or DENSE)

    def pack_stack(self, stack: torch.Tensor):
        """CUDA: an expert stack ``[E, N, K]`` kept quantized where the checkpoint's records
        cover every expert (each expert's own: FP8 per tensor, channel or block; int4 with
        its scales, zero points and act-order), else left dense."""
        early = self._early.pop(stack.untyped_storage()._cdata, None)
        if early is not None:
            return early
        again = self._requant.pop(stack.untyped_storage().data_ptr(), None)
        if again is not None and again.kind == "fp8":
            return quantize_stack(stack)  # an RL update: one scale per expert and row, as online FP8
        if again is not None:  # int4: round to nearest per group, expert by expert
            return stack_experts([requantize_int4(stack[e], again.group) for e in range(stack.shape[0])])
        recs = self._per_expert(stack)
        if recs is None or len({r.kind for r in recs}) != 1:
            return self._on_device(stack)
        # expert by expert, each moved where it runs first (staged stacks sit in host memory)
        kept = stack_experts([self._quantize(stack[e], r) for e, r in enumerate(recs)])
        if kept is None:
            log.info("an expert stack %s stays dense (its experts' quantization layouts differ)", tuple(stack.shape))
            return self._on_device(stack)
        self.kept += 1
        return kept

    def unpack_stack(self, w) -> torch.Tensor:
        if isinstance(w, torch.Tensor):
            return w
        return self._unpacked(unpack_experts(w), _Requantize("int4", w.stack.group) if isinstance(w, Int4Experts)
                              else _Requantize("fp8"))

    def pack_int4_stack(self, stack: torch.Tensor) -> Optional[list]:
        """CPU: an expert stack ``[E, N, K]`` as one int4 weight per expert where int4
        records cover every expert (each with its own scales, zero points and act-order),
        else None (the stack stays dense)."""
        early = self._early.pop(stack.untyped_storage()._cdata, None)
        if early is not None:
            return early
        again = self._requant.pop(stack.untyped_storage().data_ptr(), None)
        if again is not None:  # an RL update: round to nearest per group, expert by expert
            return [requantize_int4(stack[e], again.group, cpu=True) for e in range(stack.shape[0])]
        recs = self._per_expert(stack)
        if recs is None or any(r.kind != "int4" or not cpu_int4_fits(stack[0], r.group) for r in recs):
            return None
        self.kept += 1
        return [self._quantize(stack[e], r) for e, r in enumerate(recs)]

    def unpack_int4_stack(self, ws: list) -> torch.Tensor:
        return self._unpacked(torch.stack([unpack_kept(w) for w in ws]), _Requantize("int4", ws[0].packed.group))


def _cpu_scheme(kept: KeptQuantized, inner: PackedLinears) -> PackedLinears:
    """int4 layers on the CPU W4A16 GEMM; every other weight through ``inner``."""
    gemm = kept.cpu_kernels.int4_linear

    def linear(x: torch.Tensor, w, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if not isinstance(w, CpuInt4Weight):
            return inner.linear(x, w, bias)
        p = w.packed
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if w.perm is not None:  # act-order: the columns in the kept weight's order
            x2 = x2.index_select(1, w.perm)
        out = gemm(x2, p.packed, p.scales, p.zeros, p.group, p.out_features, bias)
        return out.reshape(*shape[:-1], p.out_features)

    from worker.engine.models.moe import fused_experts_packed, fused_experts_torch

    dense_linear = inner.linear if inner.packs_experts else F.linear

    def expert_linear(x: torch.Tensor, w, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return linear(x, w, bias) if isinstance(w, CpuInt4Weight) else dense_linear(x, w, bias)

    def pack_stack(stack: torch.Tensor):
        """One weight per expert: int4 where the checkpoint's int4 records cover every
        expert (the W4A16 GEMM per expert group, as the projections), else the inner
        scheme's packed weight (or the dense stack where it packs no experts)."""
        int4 = kept.pack_int4_stack(stack)
        if int4 is not None:
            return int4
        if inner.packs_experts:
            return [inner.pack(stack[e]) for e in range(stack.shape[0])]
        return stack

    def run(x, w13, w2, topk_weights, topk_ids, act):
        if isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor):  # dense stacks, no packing
            return fused_experts_torch(x, w13, w2, topk_weights, topk_ids, act)
        w13 = list(w13.unbind(0)) if isinstance(w13, torch.Tensor) else w13
        w2 = list(w2.unbind(0)) if isinstance(w2, torch.Tensor) else w2
        return fused_experts_packed(x, w13, w2, topk_weights, topk_ids, expert_linear, act)

    def unpack_stack(ws):
        if isinstance(ws, torch.Tensor):
            return ws
        if isinstance(ws[0], CpuInt4Weight):
            return kept.unpack_int4_stack(ws)
        return torch.stack([inner.unpack(w) for w in ws])

    experts = PackedExperts(pack_stack, run, unpack_stack)
    name = f"{kept.quant.method}: int4 layers kept int4 (CPU W4A16 GEMM), other layers {inner.name}"
    return PackedLinears(name, lambda w: kept.pack(w, inner), linear, lambda w: kept.unpack(w, inner),
                         packs_experts=True, accepts=inner.accepts, head=inner, experts=experts)
