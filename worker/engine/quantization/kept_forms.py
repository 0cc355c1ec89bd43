"""The forms a checkpoint-quantized weight is kept in (quantization/kept.py's scheme):
the record that recovers a layer's integers from its dense weight (``ScaleRecord``, read
from the checkpoint's parts by ``record_for``), the kept weights (FP8 per row or per block,
int4 for the Triton GEMM or the CPU one, act-order with their column order), quantizing a
dense weight into them, unpacking them back, and the CUDA linear over them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from worker.engine.quantization.config import WeightScheme
from worker.engine.quantization.dequant import _AWQ_REVERSE, unpack_int32
from worker.engine.quantization.int4_cpu import PackedInt4, chunk_rows, dequantized, pack_int4
from worker.engine.quantization.online_fp8 import FP8, FP8_MAX, Fp8Weight


@dataclass
class ScaleRecord:
    """What recovers a quantized layer's integers from its dense weight, per output row:
    FP8: ``scale [rows]`` or ``[rows, K / group]``; int4: ``scale`` and ``zero``
    (q units, 0..15) ``[rows, K / group]``."""

    kind: str  # "fp8" | "int4"
    scale: torch.Tensor
    group: Optional[int] = None  # columns per scale (None: one scale per row)
    zero: Optional[torch.Tensor] = None
    block_rows: int = 1  # rows per scale row (FP8 blocks kept compact: scale [rows / block_rows, K / group])
    # int4 act-order (GPTQ ``desc_act``, compressed-tensors ``actorder: group``): the input
    # columns in group order (``argsort(g_idx)``).  The weight is kept with its columns in
    # that order, so every group is contiguous again, and the GEMM reads ``x[..., perm]``:
    # ``x @ W.T == x[:, perm] @ W[:, perm].T`` (Marlin's act-order does the same).
    perm: Optional[torch.Tensor] = None
    # FP8 with static activations: the checkpoint's calibrated input scale (a 0-dim fp32
    # tensor); fused parts share the largest of theirs, as vLLM does.
    input_scale: Optional[torch.Tensor] = None

    def row_scales(self) -> torch.Tensor:
        return self.scale.repeat_interleave(self.block_rows, 0) if self.block_rows > 1 else self.scale

    def to(self, device: torch.device) -> "ScaleRecord":
        def move(t):
            return t.to(device) if t is not None else None

        return ScaleRecord(self.kind, self.scale.to(device), self.group, move(self.zero), self.block_rows,
                           move(self.perm), move(self.input_scale))


@dataclass
class Int4Weight:
    """A projection weight kept as int4 (the layout int4_linear reads)."""

    qweight: torch.Tensor  # [N, K / 8] int32, nibble k % 8 of word k // 8
    scale: torch.Tensor  # [N, K / group] fp32
    zero: Optional[torch.Tensor]  # [N, K / group] uint8 (0..15), None: 8 (symmetric)
    group: int
    dtype: torch.dtype
    perm: Optional[torch.Tensor] = None  # act-order: input columns in group order (ScaleRecord.perm)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.qweight.shape[0], self.qweight.shape[1] * 8))


@dataclass
class CpuInt4Weight:
    """A projection weight kept as int4 for the CPU W4A16 GEMM (int4_cpu's layout)."""

    packed: PackedInt4
    dtype: torch.dtype
    perm: Optional[torch.Tensor] = None  # act-order: input columns in group order (ScaleRecord.perm)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.packed.out_features, self.packed.in_features))

    def nbytes(self) -> int:
        return self.packed.nbytes() + (self.perm.numel() * self.perm.element_size() if self.perm is not None else 0)


@dataclass
class Fp8BlockWeight:
    """An FP8 weight with a scale per ``block`` (rows, columns): 128 x 128 checkpoints, or
    (1, 128) where fused parts do not align to whole blocks."""

    q: torch.Tensor
    scale: torch.Tensor  # [N / block[0], K / block[1]] fp32
    block: tuple[int, int]
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def weight_bytes(w) -> int:
    """Resident bytes of a (kept or dense) projection weight."""
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    if hasattr(w, "nbytes"):
        return w.nbytes()
    return sum(t.numel() * t.element_size() for t in vars(w).values() if isinstance(t, torch.Tensor))


# --- records from the checkpoint's parts ---------------------------------------------------
def record_for(scheme: WeightScheme, parts: dict[str, torch.Tensor]) -> Optional[ScaleRecord]:
    """The record of a quantized layer's ``parts`` (reader's names), or None where this
    path does not keep it (int8, 8-bit GPTQ, act-order groups of uneven size: those load
    dequantized)."""
    if scheme.kind == "fp8":
        scale = parts["scale"].float()
        weight = parts["weight"]
        if weight.dtype != FP8:
            return None  # e5m2 / fnuz values do not all fit e4m3 at the same scale: dequantized
        rows, cols = weight.shape
        static = parts["input_scale"].float().max() if scheme.static_input else None
        if scale.numel() == 1:
            return ScaleRecord("fp8", scale.reshape(1).expand(rows).clone(), input_scale=static)
        if scheme.strategy == "block" or (scale.dim() == 2 and scale.shape[1] > 1):
            r, c = scheme.block or (128, 128)
            return ScaleRecord("fp8", scale.contiguous(), group=c, block_rows=r)
        return ScaleRecord("fp8", scale.reshape(rows), input_scale=static)
    if scheme.kind == "awq" and scheme.num_bits == 4:
        g = scheme.group_size or 128
        out = parts["scales"].shape[1]
        reorder = torch.tensor([8 * (c // 8) + _AWQ_REVERSE[c % 8] for c in range(out)])
        zero = unpack_int32(parts["qzeros"], 4, out, dim=1)[:, reorder]
        return ScaleRecord("int4", parts["scales"].float().t().contiguous(), g, zero.t().contiguous())
    if scheme.kind == "gptq" and scheme.num_bits == 4 and scheme.group_size:
        ok, perm = act_order(parts.get("g_idx"), scheme.group_size)
        if not ok:
            return None
        out = parts["scales"].shape[1]
        zero = (unpack_int32(parts["qzeros"], 4, out, dim=1) + scheme.zero_offset) & 0xF
        return ScaleRecord("int4", parts["scales"].float().t().contiguous(), scheme.group_size, zero.t().contiguous(),
                           perm=perm)
    if scheme.kind == "packed" and scheme.num_bits == 4 and scheme.strategy == "group":
        shape = tuple(int(v) for v in parts["weight_shape"].tolist())
        scale = parts["weight_scale"].float()
        zp = parts.get("weight_zero_point")
        if zp is None or scheme.symmetric:
            zero = torch.full(scale.shape, 8, dtype=torch.int32)
        elif zp.dtype == torch.int32 and zp.shape[0] != shape[0]:
            zero = unpack_int32(zp, 4, shape[0], dim=0)  # packed unsigned: already in q units
        else:
            zero = zp.to(torch.int32) + 8  # signed zero points: q is stored minus 8
        group = scheme.group_size or shape[1]
        ok, perm = act_order(parts.get("weight_g_idx"), group)
        return ScaleRecord("int4", scale, group, zero, perm=perm) if ok else None
    return None


def act_order(g_idx: Optional[torch.Tensor], group: int) -> tuple[bool, Optional[torch.Tensor]]:
    """(keepable, perm) for an int4 layer's ``g_idx`` (input column -> its group): perm
    None where the groups are the columns in order (no act-order, or a trivial g_idx);
    the stable ``argsort(g_idx)`` where sorting the columns makes every group ``group``
    contiguous columns, as act-order quantization writes it (GPTQ quantizes the columns
    in its own order and numbers the groups along it); not keepable otherwise (uneven
    groups: that layer loads dequantized)."""
    if g_idx is None:
        return True, None
    g = g_idx.long().reshape(-1)
    ordered = torch.arange(g.numel()) // group
    if torch.equal(g, ordered):
        return True, None
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], ordered):
        return False, None
    return True, perm.to(torch.int32)


# --- quantizing a dense weight -------------------------------------------------------------
def fp8_from(w: torch.Tensor, rec: ScaleRecord):
    if rec.group is None:
        q = (w.float() / rec.scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return Fp8Weight(q, rec.scale.contiguous(), w.dtype, rec.input_scale)
    s = rec.row_scales()[:w.shape[0]].repeat_interleave(rec.group, 1)[:, :w.shape[1]]
    q = (w.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8BlockWeight(q, rec.scale.contiguous(), (rec.block_rows, rec.group), w.dtype)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` values 0..15 -> ``[N, K / 8]`` int32, value k at bits 4 * (k % 8)."""
    n, k = q.shape
    words = torch.zeros(n, k // 8, dtype=torch.int64, device=q.device)
    for i in range(8):
        words |= q[:, i::8].to(torch.int64) << (4 * i)
    return ((words + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)


def int4_from(w: torch.Tensor, rec: ScaleRecord, cpu: bool = False):
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    perm = rec.perm.to(w.device) if rec.perm is not None else None
    step = chunk_rows(k)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        rows = w[r0:r1] if perm is None else w[r0:r1].index_select(1, perm)  # act-order: groups contiguous
        s = rec.scale[r0:r1].repeat_interleave(rec.group, 1)[:, :k]
        z = rec.zero[r0:r1].repeat_interleave(rec.group, 1)[:, :k].float()
        q[r0:r1] = torch.round(rows.float() / s + z).clamp(0, 15).to(torch.uint8)
    if cpu:  # the CPU kernel's layout (int4_cpu.pack_int4: nibble runs, zero points as bytes)
        return CpuInt4Weight(pack_int4(q, rec.scale, rec.zero.float(), rec.group), w.dtype, perm)
    # uint8 zero points: a quarter of int32's bytes (the kernel widens them per tile)
    zero = None if bool((rec.zero == 8).all()) else rec.zero.to(torch.uint8).contiguous()
    return Int4Weight(pack_nibbles(q), rec.scale.contiguous(), zero, rec.group, w.dtype, perm)


def cpu_int4_fits(w: torch.Tensor, group: int) -> bool:
    """Whether the CPU kernel takes this weight: whole groups of a multiple of 8 columns,
    fp32 or bf16 activations (the model dtype)."""
    return w.dim() == 2 and group % 8 == 0 and w.shape[1] % group == 0 and \
        w.dtype in (torch.float32, torch.bfloat16)


def requantize_int4(w: torch.Tensor, group: int, cpu: bool = False):
    """Round-to-nearest int4 with a zero point per ``group`` columns (an RL update)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    zero = torch.round(-lo / scale).clamp(0, 15).to(torch.int32)
    return int4_from(w, ScaleRecord("int4", scale, group, zero), cpu)


def unpack_kept(w) -> torch.Tensor:
    """The dense weight a kept one holds (FP8 ones also as expert stacks ``[E, N, K]``)."""
    if isinstance(w, (CpuInt4Weight, Int4Weight)) and w.perm is not None:
        # act-order: the kept columns are in group order; put them back where x reads them
        kept = unpack_kept(type(w)(**{**vars(w), "perm": None}))
        dense = torch.empty_like(kept)
        dense[:, w.perm.long()] = kept
        return dense
    if isinstance(w, CpuInt4Weight):
        return dequantized(w.packed, w.dtype)
    if isinstance(w, Fp8Weight):  # one scale per (expert and) row
        return (w.q.float() * w.scale[..., None]).to(w.dtype)
    if isinstance(w, Fp8BlockWeight):
        r, c = w.block
        n, k = w.q.shape[-2:]
        s = w.scale.repeat_interleave(r, -2)[..., :n, :].repeat_interleave(c, -1)[..., :k]
        return (w.q.float() * s).to(w.dtype)
    n, k = w.shape
    q = unpack_int32(w.qweight, 4, k, dim=1).float()
    z = w.zero.float() if w.zero is not None else torch.full_like(w.scale, 8.0)
    return ((q - z.repeat_interleave(w.group, 1)) * w.scale.repeat_interleave(w.group, 1)).to(w.dtype)


def kept_linear(x: torch.Tensor, w, bias: Optional[torch.Tensor]) -> torch.Tensor:
    if isinstance(w, torch.Tensor):  # a layer the checkpoint keeps dense
        return F.linear(x, w, bias)
    from worker.engine.kernels.triton.quant_gemm import fp8_linear, int4_linear

    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).contiguous()
    if getattr(w, "perm", None) is not None:  # act-order int4: the columns in the kept weight's order
        x2 = x2.index_select(1, w.perm)
    if isinstance(w, Fp8Weight):
        out = fp8_linear(x2, w.q, w.scale, bias=bias, input_scale=w.input_scale)
    elif isinstance(w, Fp8BlockWeight):
        out = fp8_linear(x2, w.q, w.scale, block=w.block, bias=bias)
    else:
        out = int4_linear(x2, w.qweight, w.scale, w.zero, w.group, bias=bias)
    return out.reshape(*shape[:-1], out.shape[-1])
