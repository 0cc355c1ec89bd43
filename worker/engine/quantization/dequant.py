"""Unpacking quantized weights into dense ones (pure torch, any device).

Each function returns the weight as ``[out_features, in_features]`` float32, the layout
``nn.Linear`` and the loader expect.  The layouts are the formats' own, as their writers
document and produce them: compressed-tensors (``pack_to_int32``: element i of a row at
bit ``i * num_bits``, stored with an offset of ``2**(num_bits - 1)``; zero points packed
along the output dim), AutoAWQ's GEMM layout (``[in, out / 8]`` words whose nibbles hold
columns in the order 0 2 4 6 1 3 5 7), GPTQ (``[in / 8, out]`` words packed along the
input dim, zero points ``[groups, out / 8]``, stored minus one in the v1 format, rows
mapped to groups by ``g_idx`` under act-order), MXFP4 (OCP microscaling as GPT-OSS
stores its experts: ``blocks [..., rows, G, 16]`` bytes each holding two FP4 e2m1 codes,
the low nibble first, ``scales [..., rows, G]`` e8m0 exponents biased by 127, one per 32
values; transformers' ``convert_moe_packed_tensors`` reads them the same way).
"""
from __future__ import annotations

from typing import Optional

import torch

from worker.engine.quantization.config import WeightScheme

# AutoAWQ packs the eight 4-bit columns of a word in this order; nibble i holds column
# order[i], so column j comes from nibble _AWQ_REVERSE[j].
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_REVERSE = tuple(_AWQ_ORDER.index(j) for j in range(8))


def unpack_int32(packed: torch.Tensor, num_bits: int, length: int, dim: int) -> torch.Tensor:
    """Unsigned ``num_bits`` values (4 or 8) packed into int32 words along ``dim``: value
    i of a row sits at bit ``(i % per_word) * num_bits`` of word ``i // per_word``
    (little-endian).  Returns int32 with ``length`` values along ``dim``."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed weights must be int32, got {packed.dtype}")
    if num_bits not in (4, 8):
        raise ValueError(f"{num_bits}-bit packing is not supported (4 and 8 are)")
    per_word = 32 // num_bits
    shifts = torch.arange(0, 32, num_bits, dtype=torch.int32, device=packed.device)
    mask = (1 << num_bits) - 1
    moved = packed.movedim(dim, -1)
    values = (moved.unsqueeze(-1) >> shifts) & mask  # [..., words, per_word]
    values = values.reshape(*moved.shape[:-1], moved.shape[-1] * per_word)
    if values.shape[-1] < length:
        raise ValueError(f"packed tensor holds {values.shape[-1]} values along dim {dim}, expected {length}")
    return values[..., :length].movedim(-1, dim)


def _expand(scale: torch.Tensor, shape: tuple[int, int], scheme: WeightScheme,
            g_idx: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A scale (or zero point) tensor broadcast to the weight's ``[out, in]`` shape."""
    out, inp = shape
    scale = scale.float() if scale.is_floating_point() else scale
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(out, inp)
    if scheme.strategy == "channel" or (scale.dim() >= 1 and scale.shape[-1] == 1 and scale.numel() == out):
        return scale.reshape(out, 1).expand(out, inp)
    if scheme.strategy == "block":
        rows, cols = scheme.block or (128, 128)
        return scale.repeat_interleave(rows, 0)[:out].repeat_interleave(cols, 1)[:, :inp]
    if scheme.strategy == "group":
        if g_idx is not None:
            return scale[:, g_idx.long()]
        group = scheme.group_size or inp
        return scale.repeat_interleave(group, 1)[:, :inp]
    if scheme.strategy == "tensor":
        return scale.reshape(-1)[:1].reshape(1, 1).expand(out, inp)
    raise ValueError(f"scale of shape {tuple(scale.shape)} does not fit a {scheme.strategy} scheme")


def dequant_float(weight: torch.Tensor, scale: torch.Tensor, scheme: WeightScheme,
                  zero_point: Optional[torch.Tensor] = None) -> torch.Tensor:
    """FP8 (or int8) weight stored unpacked, times its scale, minus its zero point."""
    shape = tuple(weight.shape)
    w = weight.float()
    if zero_point is not None and not scheme.symmetric:
        w = w - _expand(zero_point, shape, scheme).float()
    return w * _expand(scale, shape, scheme)


def dequant_packed(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int], scheme: WeightScheme,
                   zero_point: Optional[torch.Tensor] = None, g_idx: Optional[torch.Tensor] = None) -> torch.Tensor:
    """compressed-tensors ``pack-quantized``: ``(q - zero) * scale`` per group."""
    out, inp = shape
    offset = 1 << (scheme.num_bits - 1)
    q = unpack_int32(packed, scheme.num_bits, inp, dim=1) - offset
    w = q.float()
    if zero_point is not None and not scheme.symmetric:
        zp = unpack_int32(zero_point, scheme.num_bits, out, dim=0) - offset if zero_point.dtype == torch.int32 and \
            zero_point.shape[0] != out else zero_point.to(torch.int32)
        w = w - _expand(zp, shape, scheme, g_idx).float()
    return w * _expand(scale, shape, scheme, g_idx)


def dequant_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """AutoAWQ GEMM layout: ``qweight [in, out/8]``, ``qzeros [in/g, out/8]``, ``scales [in/g, out]``."""
    inp, out = qweight.shape[0], scales.shape[1]
    reorder = torch.tensor([8 * (c // 8) + _AWQ_REVERSE[c % 8] for c in range(out)], device=qweight.device)
    q = unpack_int32(qweight, 4, out, dim=1)[:, reorder]
    z = unpack_int32(qzeros, 4, out, dim=1)[:, reorder]
    groups = torch.arange(inp, device=qweight.device) // group_size
    w = (q - z[groups]).float() * scales.float()[groups]
    return w.t().contiguous()


def dequant_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, scheme: WeightScheme,
                 g_idx: Optional[torch.Tensor] = None) -> torch.Tensor:
    """GPTQ: ``qweight [in*bits/32, out]`` packed along the input dim, ``qzeros
    [groups, out*bits/32]``, ``scales [groups, out]``, ``g_idx [in]`` (act-order)."""
    out = scales.shape[1]
    inp = qweight.shape[0] * (32 // scheme.num_bits)
    q = unpack_int32(qweight, scheme.num_bits, inp, dim=0)
    # v1 stores zero - 1 in num_bits (a zero of 0 wraps to all ones): add the one back, modulo.
    z = (unpack_int32(qzeros, scheme.num_bits, out, dim=1) + scheme.zero_offset) & ((1 << scheme.num_bits) - 1)
    if g_idx is None:
        group = scheme.group_size or inp
        g_idx = torch.arange(inp, device=qweight.device) // group
    g = g_idx.long()
    w = (q - z[g]).float() * scales.float()[g]
    return w.t().contiguous()


# The 16 FP4 e2m1 codes: sign bit 3, then exponent (2 bits) and mantissa (1 bit).
_FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``blocks [..., rows, G, B]`` (uint8, two codes a byte, low nibble = the even
    value) with ``scales [..., rows, G]`` (uint8 e8m0: 2 ** (s - 127)) -> float32
    ``[..., rows, G * 2B]``: each row's values in order, each group of 2B times its scale."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(_FP4_E2M1, dtype=torch.float32, device=blocks.device)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1).flatten(-2)
    values = torch.ldexp(values, scales.to(torch.int32).sub_(127).unsqueeze(-1))
    return values.flatten(-2)
