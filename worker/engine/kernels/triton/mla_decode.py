"""Multi-head latent attention decode over the paged latent cache (DeepSeek-V2/V3).

The absorbed form (models/mla.py): every query row has already been absorbed into
``W_UK`` (``q_lat = q_nope W_UK``, ``[B, H, rank]``); the kernel scores it and the roped
``q_pe`` against each cached token's ``[c_kv | k_pe]`` row, keeps an online softmax, and
accumulates the probability-weighted latents ``o_lat [B, H, rank]`` (the caller maps them
through ``W_UV``).  All heads read the same latent row, so one program serves
``BLOCK_H`` heads of one sequence and loads every row once for all of them (vLLM's
Triton MLA decode, vllm/v1/attention/ops/triton_decode_attention.py, grouped the same
way).  Keys are looked up through the block table, ``TILE_N`` positions at a time.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's interpreter multiplies bf16 dot operands as their raw bits: interpreted runs take
# the float32 ("ieee") dots, as the other kernels here do; the bf16 dots are compiled (sm_90).
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _mla_decode_kernel(
    q_lat_ptr, q_pe_ptr, cache, block_tables, seq_lens, out_ptr,
    stride_qb, stride_qh, stride_pb, stride_ph, stride_cb, stride_cs, stride_tb, stride_ob, stride_oh,
    num_heads, scale,
    RANK: tl.constexpr, ROPE: tl.constexpr, RANK_PAD: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    offs_r = tl.arange(0, RANK_PAD)
    offs_p = tl.arange(0, ROPE_PAD)
    r_ok, p_ok = offs_r < RANK, offs_p < ROPE
    q_lat = tl.load(q_lat_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_r[None, :],
                    mask=h_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_H, RANK_PAD]
    q_pe = tl.load(q_pe_ptr + b * stride_pb + heads[:, None] * stride_ph + offs_p[None, :],
                   mask=h_ok[:, None] & p_ok[None, :], other=0.0)  # [BLOCK_H, ROPE_PAD]
    seq_len = tl.load(seq_lens + b)
    table = block_tables + b * stride_tb
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, RANK_PAD), tl.float32)
    offs_n = tl.arange(0, TILE_N)
    for start in range(0, seq_len, TILE_N):
        pos = start + offs_n
        n_ok = pos < seq_len
        page = tl.load(table + pos // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        row = cache + page * stride_cb + (pos % BLOCK_SIZE) * stride_cs  # [TILE_N] row starts
        # An FP8 cache (--kv-cache-dtype, scale 1.0) is converted to q's dtype as it is loaded.
        c_kv = tl.load(row[:, None] + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :],
                       other=0.0).to(q_lat.dtype)
        # The same rows loaded transposed for the scores (as the unified kernel loads K).
        c_kv_t = tl.load(row[None, :] + offs_r[:, None], mask=n_ok[None, :] & r_ok[:, None],
                         other=0.0).to(q_lat.dtype)
        k_pe_t = tl.load(row[None, :] + RANK + offs_p[:, None], mask=n_ok[None, :] & p_ok[:, None],
                         other=0.0).to(q_lat.dtype)
        if IEEE:
            s = tl.dot(q_lat.to(tl.float32), c_kv_t.to(tl.float32), input_precision="ieee")
            s += tl.dot(q_pe.to(tl.float32), k_pe_t.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q_lat, c_kv_t)
            s += tl.dot(q_pe, k_pe_t)
        s = tl.where(n_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, c_kv.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(c_kv.dtype), c_kv)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_r[None, :], out.to(out_ptr.dtype.element_ty),
             mask=h_ok[:, None] & r_ok[None, :])


def _config(rank: int, rope: int, num_heads: int) -> dict:
    """16 heads per program (tl.dot's minimum rows), 32 keys per tile; padded widths."""
    return dict(RANK_PAD=max(16, triton.next_power_of_2(rank)), ROPE_PAD=max(16, triton.next_power_of_2(rope)),
                BLOCK_H=16, TILE_N=32)


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """``q_lat [B, H, rank]``, ``q_pe [B, H, rope]`` (last dims contiguous), ``cache`` one
    layer's latents ``[blocks, block_size, rank + rope]`` (q's dtype or FP8), ``block_tables [B, W]`` int32,
    ``seq_lens [B]`` int32 -> ``o_lat [B, H, rank]`` in q's dtype (softmax in float32)."""
    b, heads, rank = q_lat.shape
    rope = q_pe.shape[-1]
    if cache.shape[-1] != rank + rope or cache.stride(-1) != 1 or q_lat.stride(-1) != 1 or q_pe.stride(-1) != 1:
        raise ValueError("mla_decode needs contiguous last dims and a cache row of rank + rope values")
    out = q_lat.new_empty((b, heads, rank))
    if b == 0:
        return out
    cfg = _config(rank, rope, heads)
    grid = (b, triton.cdiv(heads, cfg["BLOCK_H"]))
    _mla_decode_kernel[grid](
        q_lat, q_pe, cache, block_tables, seq_lens, out,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(0), cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1), heads, scale,
        RANK=rank, ROPE=rope, BLOCK_SIZE=cache.shape[1], IEEE=q_lat.dtype == torch.float32 or _INTERPRETING, **cfg)
    return out


def compile_specs() -> list:
    """DeepSeek-V3's dims (rank 512, rope 64, 128 heads) in bf16 (over a bf16 and an FP8
    cache) and a small fp32 case."""
    specs = []
    for dtype, rank, rope, heads, block_size, kv in (("bf16", 512, 64, 128, 16, "bf16"), ("fp32", 32, 8, 4, 16, "fp32"),
                                                     ("bf16", 512, 64, 128, 16, "fp8e4nv")):
        sig = {"q_lat_ptr": f"*{dtype}", "q_pe_ptr": f"*{dtype}", "cache": f"*{kv}", "block_tables": "*i32",
               "seq_lens": "*i32", "out_ptr": f"*{dtype}"}
        for name in ("stride_qb", "stride_qh", "stride_pb", "stride_ph", "stride_cb", "stride_cs", "stride_tb",
                     "stride_ob", "stride_oh"):
            sig[name] = "i64"
        sig.update(num_heads="i32", scale="fp32")
        const = dict(RANK=rank, ROPE=rope, BLOCK_SIZE=block_size, IEEE=dtype == "fp32", **_config(rank, rope, heads))
        kv_name = "" if kv == dtype else f",kv={kv}"
        specs.append((f"mla_decode[{dtype},rank={rank},rope={rope},H={heads}{kv_name}]", _mla_decode_kernel, sig,
                      const))
    return specs
