"""int4 weights kept packed in memory on CPU (W4A16), for ``int4_linear`` in
worker/engine/kernels/int4_gemm.cpp.

``pack_int4`` takes a layer's unsigned 4-bit values ``q [N, K]`` (0..15), its group
scales and zero points ``[N, K / group]`` (zero in q units: 8 for a symmetric
checkpoint) and lays them out as the kernel reads them: per block of 8 output columns and
run of 8 consecutive k, 8 int32 words (one 256-bit vector), word j = column j, its nibble
i = k0 + i (``[N / 8, K]`` int32; why this layout: the kernel's header); scales and zeros
as ``[N / 8, G, 8]``, fp32 and uint8.  N is padded to a multiple of 8 with zero columns (scale 0),
which the kernel never writes.  ``unpack_int4`` gives ``q`` back exactly (weight updates).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedInt4:
    packed: torch.Tensor  # [ceil(N/8), K] int32
    scales: torch.Tensor  # [ceil(N/8), G, 8] fp32
    zeros: torch.Tensor  # [ceil(N/8), G, 8] uint8 (q units)
    group: int
    out_features: int
    in_features: int

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.zeros))


def chunk_rows(k: int, elements: int = 1 << 20) -> int:
    """Rows per chunk when quantizing or packing a ``[rows, k]`` weight: about ``elements``
    values at a time (a multiple of 8 rows: the CPU layout's column blocks), so the fp32 and
    int64 temporaries (tens of bytes per value) stay a few tens of MB whatever the layer."""
    return max(8, elements // max(k, 1) // 8 * 8)


def pack_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> PackedInt4:
    n, k = q.shape
    if k % group or scales.shape != (n, k // group) or zeros.shape != scales.shape:
        raise ValueError(f"int4 weight [{n}, {k}] with group {group} needs scales/zeros [{n}, {k // group}], "
                         f"got {tuple(scales.shape)} / {tuple(zeros.shape)}")
    if group % 8:
        raise ValueError(f"int4 groups must be a multiple of 8 columns, got {group}")
    if int(q.min()) < 0 or int(q.max()) > 15 or int(zeros.min()) < 0 or int(zeros.max()) > 15:
        raise ValueError("int4 values and zero points must be unsigned 0..15")
    nb = -(-n // 8)
    pad = nb * 8 - n
    q = torch.nn.functional.pad(q, (0, 0, 0, pad))
    shifts = torch.arange(8, dtype=torch.int64) * 4
    packed = torch.empty(nb, k, dtype=torch.int32)
    # A few thousand rows at a time: the int64 temporaries are ~30 bytes per value, which for
    # a whole 11008 x 4096 layer would be GBs at load.
    step = chunk_rows(k) // 8  # blocks of 8 rows per chunk
    for b0 in range(0, nb, step):
        b1 = min(nb, b0 + step)
        # [blocks, 8 columns j, k / 8 runs, 8 nibbles i] -> words [blocks, k / 8, j]
        qc = q[b0 * 8:b1 * 8].to(torch.int64).reshape(b1 - b0, 8, k // 8, 8)
        words = (qc << shifts).sum(-1).transpose(1, 2)  # nibble i = k0 + i (no carries: disjoint bits)
        packed[b0:b1] = ((words + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32).reshape(b1 - b0, k)

    def blocked(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        t = torch.nn.functional.pad(t.to(dtype), (0, 0, 0, pad))
        return t.reshape(nb, 8, k // group).permute(0, 2, 1).contiguous()

    return PackedInt4(packed, blocked(scales, torch.float32), blocked(zeros.float().round(), torch.uint8), group, n, k)


def unpack_int4(weight: PackedInt4) -> torch.Tensor:
    """The ``q [N, K]`` (int32, 0..15) that ``pack_int4`` packed (exact)."""
    nb, k = weight.packed.shape
    words = weight.packed.reshape(nb, k // 8, 8).transpose(1, 2)  # [nb, column j, run]
    shifts = torch.arange(8, dtype=torch.int32) * 4
    q = (words.unsqueeze(-1) >> shifts) & 0xF  # arithmetic shift, then the nibble's 4 bits
    return q.reshape(nb * 8, k)[:weight.out_features].contiguous()


def dequantized(weight: PackedInt4, dtype: torch.dtype) -> torch.Tensor:
    """``(q - zero) * scale`` per group, in fp32 then rounded once to ``dtype`` ``[N, K]``."""
    n, g = weight.out_features, weight.group
    scales = weight.scales.permute(0, 2, 1).reshape(-1, weight.scales.shape[1])[:n]
    zeros = weight.zeros.permute(0, 2, 1).reshape(-1, weight.zeros.shape[1])[:n].float()
    q = unpack_int4(weight).float()
    return ((q - zeros.repeat_interleave(g, 1)) * scales.repeat_interleave(g, 1)).to(dtype)


def int4_linear(x: torch.Tensor, weight: PackedInt4, bias=None, kernels=None) -> torch.Tensor:
    """``x @ ((q - zero) * scale).T + bias`` over the packed weight; ``x`` [..., K]."""
    if kernels is None:
        from worker.engine.kernels import load_cpu_kernels
        kernels = load_cpu_kernels()
    shape = x.shape
    out = kernels.int4_linear(x.reshape(-1, shape[-1]), weight.packed, weight.scales, weight.zeros, weight.group,
                              weight.out_features, bias)
    return out.reshape(*shape[:-1], weight.out_features)
