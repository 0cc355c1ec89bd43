"""Quantized GEMMs for the CUDA path (issue 43): what vLLM runs for FP8 and int4
checkpoints, in Triton.

* ``fp8_linear``: W8A8 FP8.  The activations are quantized per token (one scale per row,
  ``quantize_fp8_rows``) or, for weights in blocks, per row and 128-wide group of K
  (DeepSeek-V3's 1 x 128 activation groups beside 128 x 128 weight blocks); the GEMM
  multiplies FP8 x FP8 with fp32 accumulation (Hopper's FP8 tensor cores) and applies
  the scales: per row and per output channel (or per tensor) after the K loop, per
  (row, group) x (column block, group) inside it for blocks.
* ``int4_linear``: W4A16.  Weights as compressed-tensors' ``pack-quantized`` stores them
  (``[N, K / 8]`` int32, element k of a row at bits ``4 * (k % 8)`` of word ``k // 8``,
  unsigned), with group scales and zero points ``[N, K / group]``; each K tile is
  unpacked and dequantized in registers, then multiplied in the activations' dtype.
  AWQ and GPTQ weights are repacked to this layout once at load.

Both run on CPU tensors under ``TRITON_INTERPRET=1`` (tests/support/triton_interpreted_kernels.py
checks them against torch references) and compile for sm_90 (tests/unit/kernels/test_triton_compile.py).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
FP8_MAX = 448.0  # float8_e4m3fn


@triton.jit
def _quant_fp8_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, GROUP: tl.constexpr,
                           NUM_GROUPS: tl.constexpr, FP8MAX: tl.constexpr):
    """One program per (row, group): scale = amax / FP8MAX, q = x / scale (saturated)."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, GROUP)
    ok = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12)
    scale = amax / FP8MAX
    q = tl.clamp(x / scale, -FP8MAX, FP8MAX)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * NUM_GROUPS + g, scale)


def quantize_fp8_rows(x: torch.Tensor, group: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (FP8 ``[M, K]``, fp32 scales ``[M, groups]``): one scale per row, or
    per row and ``group`` columns (dynamic, as vLLM's per-token / per-token-group quant)."""
    m, k = x.shape
    group = group or triton.next_power_of_2(k)
    groups = triton.cdiv(k, group)
    # The interpreter's fp32 -> e4m3 cast is wrong near binade edges (126.8 became 64.0
    # under Triton 3.9's): interpreted, the kernel stores the scaled fp32 values and torch
    # rounds them (round to nearest even, as the GPU's cvt does).
    q = torch.empty((m, k), dtype=torch.float32 if _INTERPRETING else torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        _quant_fp8_rows_kernel[(m, groups)](x, q, s, k, x.stride(0), q.stride(0), GROUP=group, NUM_GROUPS=groups,
                                            FP8MAX=FP8_MAX)
    return (q.to(torch.float8_e4m3fn) if _INTERPRETING else q), s


@triton.jit
def _fp8_gemm_kernel(a_ptr, b_ptr, out_ptr, as_ptr, bs_ptr, bias_ptr, M, N, K,
                     stride_am, stride_bn, stride_om, stride_as, stride_bs,
                     BLOCKWISE: tl.constexpr, GROUP_K: tl.constexpr, GROUP_N: tl.constexpr,
                     PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]  # [K, N] tile of W [N, K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b)
        if BLOCKWISE:  # this K tile lies in one activation group and one weight block column
            g = k0 // GROUP_K
            sa = tl.load(as_ptr + offs_m.to(tl.int64) * stride_as + g, mask=m_ok, other=0.0)
            sb = tl.load(bs_ptr + (offs_n // GROUP_N).to(tl.int64) * stride_bs + g, mask=n_ok, other=0.0)
            acc += part * sa[:, None] * sb[None, :]
        else:
            acc += part
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not BLOCKWISE:
        sa = tl.load(as_ptr + offs_m.to(tl.int64) * stride_as, mask=m_ok, other=0.0)
        if PER_CHANNEL:
            sb = tl.load(bs_ptr + offs_n, mask=n_ok, other=0.0)
            acc = acc * sa[:, None] * sb[None, :]
        else:
            acc = acc * sa[:, None] * tl.load(bs_ptr)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               block: Optional[tuple[int, int]] = None, bias: Optional[torch.Tensor] = None,
               input_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [M, K]`` (bf16/fp16/fp32) times an FP8 weight ``[N, K]`` -> ``[M, N]`` in x's dtype.

    ``weight_scale``: one value (per tensor), ``[N]`` / ``[N, 1]`` (per channel), or
    ``[N / block[0], K / block[1]]`` with ``block`` (weight blocks; activations then get
    one scale per row and ``block[1]`` columns).  Dequantized weight = weight * scale.
    ``input_scale`` (a 0-dim fp32 tensor, not with blocks): the checkpoint's static
    activation scale, x quantized with it (saturated) instead of per row, dynamically."""
    m, k = x.shape
    n = weight.shape[0]
    blockwise = block is not None
    group_k = block[1] if blockwise else 0
    if input_scale is not None and not blockwise:
        # static: one scale for every row (stride 0), as vLLM's static per-tensor input quant
        xq = (x.float() / input_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        xs = input_scale.float().reshape(1, 1).expand(m, 1)
    else:
        xq, xs = quantize_fp8_rows(x, group_k or None)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if not m:
        return out
    ws = weight_scale.float().contiguous()
    per_channel = not blockwise and ws.numel() > 1
    block_k = min(group_k, 128) if blockwise else 64
    if blockwise and group_k % block_k:
        raise ValueError(f"weight blocks of {group_k} columns are not a multiple of the K tile {block_k}")
    block_m, block_n = 16, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    bias_arg = bias if bias is not None else out
    _fp8_gemm_kernel[grid](xq, weight, out, xs, ws, bias_arg, m, n, k, xq.stride(0), weight.stride(0), out.stride(0),
                           xs.stride(0), ws.stride(0) if blockwise else 0,
                           BLOCKWISE=blockwise, GROUP_K=group_k or 1, GROUP_N=block[0] if blockwise else 1,
                           PER_CHANNEL=per_channel, HAS_BIAS=bias is not None, IEEE=_INTERPRETING,
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


@triton.jit
def dequant_int4_tile(words, ks, s_ptrs, z_ptrs, mask, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr):
    """A ``[K, N]`` tile of int4 weights in fp32: nibble ``k % 8`` of each word, minus its
    group's zero point (8 when symmetric), times its group's scale.  ``s_ptrs`` / ``z_ptrs``
    point at each column's first group (``[1, N]``); the group of row k is ``k // GROUP``."""
    q = ((words >> ((ks % 8) * 4)[:, None]) & 0xF).to(tl.float32)
    g = (ks // GROUP)[:, None]
    s = tl.load(s_ptrs + g, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZERO:
        z = tl.load(z_ptrs + g, mask=mask, other=0).to(tl.float32)
    else:
        z = 8.0
    return (q - z) * s


@triton.jit
def _int4_gemm_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, M, N, K,
                      stride_xm, stride_qn, stride_sn, stride_zn, stride_om,
                      GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # [K, N] tile: word k // 8 of row n, nibble k % 8
        words = tl.load(qw_ptr + offs_n[None, :].to(tl.int64) * stride_qn + (ks // 8)[:, None],
                        mask=k_ok[:, None] & n_ok[None, :], other=0)
        w = dequant_int4_tile(words, ks, s_ptr + offs_n[None, :].to(tl.int64) * stride_sn,
                              z_ptr + offs_n[None, :].to(tl.int64) * stride_zn, k_ok[:, None] & n_ok[None, :],
                              GROUP, HAS_ZERO)
        if IEEE:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: Optional[torch.Tensor],
                group: int, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [M, K]`` times an int4 weight (``qweight [N, K/8]`` int32, ``scales [N, K/group]``,
    ``zeros [N, K/group]`` in q units or None for symmetric, i.e. 8) -> ``[M, N]``."""
    m, k = x.shape
    n = qweight.shape[0]
    if k % group or qweight.shape[1] * 8 < k:
        raise ValueError(f"int4 weight [{n}, {qweight.shape[1] * 8}] does not fit x [.., {k}] with group {group}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if not m:
        return out
    block_m, block_n, block_k = 16, 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    zeros_arg = zeros if zeros is not None else scales
    _int4_gemm_kernel[grid](x, qweight, scales, zeros_arg, bias if bias is not None else out, out, m, n, k,
                            x.stride(0), qweight.stride(0), scales.stride(0), zeros_arg.stride(0), out.stride(0),
                            GROUP=group, HAS_ZERO=zeros is not None, HAS_BIAS=bias is not None,
                            IEEE=_INTERPRETING or x.dtype == torch.float32,
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def compile_specs() -> list:
    specs = []
    common = {"M": "i32", "N": "i32", "K": "i32"}
    for out in ("bf16", "fp16"):
        specs.append((f"quant_fp8_rows[{out}]", _quant_fp8_rows_kernel,
                      {"x_ptr": f"*{out}", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "K": "i32", "stride_x": "i64",
                       "stride_q": "i64"}, dict(GROUP=128, NUM_GROUPS=32, FP8MAX=FP8_MAX)))
        for blockwise, per_channel in ((False, True), (False, False), (True, False)):
            kind = "block" if blockwise else ("channel" if per_channel else "tensor")
            specs.append((f"fp8_gemm[{out},{kind}]", _fp8_gemm_kernel,
                          {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "out_ptr": f"*{out}", "as_ptr": "*fp32",
                           "bs_ptr": "*fp32", "bias_ptr": f"*{out}", **common, "stride_am": "i64", "stride_bn": "i64",
                           "stride_om": "i64", "stride_as": "i64", "stride_bs": "i64"},
                          dict(BLOCKWISE=blockwise, GROUP_K=128 if blockwise else 1, GROUP_N=128 if blockwise else 1,
                               PER_CHANNEL=per_channel, HAS_BIAS=False, IEEE=False, BLOCK_M=16, BLOCK_N=64,
                               BLOCK_K=128 if blockwise else 64)))
        # zero points: int32, or uint8 (quantization/kept.py keeps them so); scales in the
        # activations' dtype or fp32 (kept.py's)
        for zero, scale in ((None, out), ("i32", out), ("u8", "fp32"), (None, "fp32")):
            has_zero = zero is not None
            specs.append((f"int4_gemm[{out},{zero or 'sym'},s{scale}]", _int4_gemm_kernel,
                          {"x_ptr": f"*{out}", "qw_ptr": "*i32", "s_ptr": f"*{scale}", "z_ptr": f"*{zero}" if has_zero
                           else f"*{out}", "bias_ptr": f"*{out}", "out_ptr": f"*{out}", **common, "stride_xm": "i64",
                           "stride_qn": "i64", "stride_sn": "i64", "stride_zn": "i64", "stride_om": "i64"},
                          dict(GROUP=128, HAS_ZERO=has_zero, HAS_BIAS=True, IEEE=False, BLOCK_M=16, BLOCK_N=64,
                               BLOCK_K=64)))
    return specs
