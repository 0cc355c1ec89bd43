"""Non-causal attention over packed variable-length sequences in one launch: the
vision towers' attention (every image, or every Qwen2.5-VL window, attends within
itself; ``cu_seqlens`` marks where each one starts).

Without it the tower calls SDPA once per image and layer (per window on Qwen2.5-VL:
thousands of launches for one large image).  Program (q-block b, head h) takes
BLOCK_M query rows of one sequence; q-blocks are numbered per sequence with one
spare each (``start // BLOCK_M + seq``), so the grid, ``S // BLOCK_M + num_seqs``
programs, needs no host-side table and a program finds its sequence by binary
search over ``cu_seqlens`` (unified attention's scheme).  Keys of the sequence are
walked in tiles of TILE_N with an online softmax in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Unified attention's q-block -> sequence search (one spare block per sequence), and its
# switch to fp32 dots under the interpreter (whose bf16 dots are wrong).
from worker.engine.kernels.triton.attention import _INTERPRETING, _find_seq


@triton.jit
def _varlen_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_seqlens, scale, num_seqs,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 dots without TF32 rounding
):
    q_block = tl.program_id(0)
    head = tl.program_id(1)
    seq = _find_seq(cu_seqlens, q_block, num_seqs, BLOCK_M)
    start = tl.load(cu_seqlens + seq)
    seq_len = tl.load(cu_seqlens + seq + 1) - start
    local = q_block - (start // BLOCK_M + seq)
    if local * BLOCK_M >= seq_len:
        return

    offs_m = local * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_n = tl.arange(0, TILE_N)
    row_ok = offs_m < seq_len
    d_ok = offs_d < HEAD_DIM
    rows = (start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for n0 in range(0, seq_len, TILE_N):
        k_idx = n0 + offs_n
        k_ok = k_idx < seq_len
        keys = (start + k_idx).to(tl.int64)
        k = tl.load(k_ptr + keys[None, :] * stride_kt + head * stride_kh + offs_d[:, None],
                    mask=k_ok[None, :] & d_ok[:, None], other=0.0)  # [D, N]
        v = tl.load(v_ptr + keys[:, None] * stride_vt + head * stride_vh + offs_d[None, :],
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)  # [N, D]
        if IEEE:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = tl.where(k_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    acc = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def launch_config(head_dim: int) -> dict:
    """64 query rows per program and key tiles of 64 (32 with wide heads, for registers)."""
    head_pad = max(triton.next_power_of_2(head_dim), 16)
    return dict(HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_M=64, TILE_N=64 if head_pad <= 64 else 32)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` within each sequence ``[cu_seqlens[i], cu_seqlens[i+1])``.

    q, k, v ``[S, H, D]`` (head dimension contiguous; strided views of a fused QKV
    projection are fine), cu_seqlens ``[B+1]`` int32 on q's device starting at 0 and
    ending at S (empty sequences allowed).  Returns out ``[S, H, D]``.
    """
    s, h, d = q.shape
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must have one shape, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("varlen_attention needs the head dimension contiguous")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    num_seqs = cu_seqlens.shape[0] - 1
    if s == 0 or num_seqs <= 0:
        return out
    cfg = launch_config(d)
    ieee = q.dtype == torch.float32 or _INTERPRETING
    grid = (s // cfg["BLOCK_M"] + num_seqs, h)
    _varlen_attention_kernel[grid](
        q, k, v, out, cu_seqlens, float(scale), num_seqs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        IEEE=ieee, **cfg)
    return out


def compile_specs() -> list:
    specs = []
    for dtype, head_dim in (("bf16", 80), ("fp16", 64), ("fp32", 128), ("bf16", 72)):
        sig = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
               "cu_seqlens": "*i32", "scale": "fp32", "num_seqs": "i32"}
        for name in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ot",
                     "stride_oh"):
            sig[name] = "i64"
        specs.append((f"varlen_attention[{dtype},D={head_dim}]", _varlen_attention_kernel, sig,
                      dict(launch_config(head_dim), IEEE=dtype == "fp32")))
    return specs
