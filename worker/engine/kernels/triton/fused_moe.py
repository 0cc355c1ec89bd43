"""Fused mixture-of-experts for the CUDA path: one grouped GEMM launch per projection.

The (token, k) pairs of a step are sorted by expert and each expert's run is padded
to a multiple of ``BLOCK_M`` (``align_by_expert``, torch ops with no host sync, so
decode steps stay CUDA-graph capturable).  Every program of ``_grouped_gemm_kernel``
then owns one ``BLOCK_M`` slice of one expert's rows and one ``BLOCK_N`` slice of
the output, gathers its input rows by index and multiplies by that expert's weight
(vLLM's fused_moe_kernel, without quantization).  The MLP is

    gate_up = grouped(x[pair // top_k], w13[e])       [pairs, 2I]
    act     = silu(gate) * up                         [pairs, I]
    down    = grouped(act[pair], w2[e]) * weight[pair] [pairs, H]
    out     = down.view(T, top_k, H).sum(1)

FP8 experts (online ``--quantization fp8``, FP8 checkpoints' experts kept FP8;
``fused_experts_fp8``): W8A8 as vLLM's fused_moe with ``use_fp8_w8a8`` -- each GEMM's input
rows quantized dynamically (the tokens for the first, the pairs for the second), FP8 x FP8
dots with fp32 accumulation.  Per-channel weight scales (``[E, N]``, one per expert and
output row): the input gets one scale per row, both applied after the K loop.  Block
scales (``block=(r, c)``, ``[E, N / r, K / c]``, DeepSeek-V3's and Qwen3-FP8's 128 x 128):
the input gets one scale per row and ``c`` columns, and each K tile (inside one column
group) is scaled as it is accumulated, as vLLM's ``block_shape`` path.

int4 experts (AWQ / GPTQ / compressed-tensors checkpoints, ``Int4Stack``): W4A16 as vLLM's
``use_int4_w4a16`` -- each expert's weight nibbles ``[E, N, K / 8]`` (int32 words, nibble
``k % 8`` of word ``k // 8``) unpacked per K tile with its group scales and zero points,
the activations unquantized; act-order experts read their input columns through the
expert's permutation (each expert its own, as GPTQ quantizes each from its own tokens).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from worker.engine.kernels.triton.quant_gemm import dequant_int4_tile


# Triton's interpreter multiplies bf16 dot operands wrongly (numpy has no bf16): under
# it the dots run on fp32 copies, as in attention.py; compiled kernels keep bf16 dots.
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _pair_rows(sorted_ids_ptr, block_expert_ptr, pid_m, num_pairs, A_ROW_DIV: tl.constexpr, BLOCK_M: tl.constexpr):
    """A program's ``BLOCK_M`` slice of one expert's (token, k) pairs: the pairs (padding
    slots hold ``num_pairs``), which are real, the expert, and each pair's input row (the
    first GEMM reads the token's row, the second the pair's)."""
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    return pair, row_ok, expert, (pair // A_ROW_DIV).to(tl.int64)


@triton.jit
def _store_pairs(c_ptr, acc, pair, row_ok, offs_n, n_ok, weights_ptr, stride_cm, stride_cn,
                 MUL_WEIGHT: tl.constexpr):
    """The pairs' output rows, times their routing weights for the second GEMM."""
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
                         N, K, num_pairs, stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                         a_scale_ptr, b_scale_ptr, stride_bse, stride_asm, stride_bsn,
                         A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         FP8: tl.constexpr, BLOCKWISE: tl.constexpr, GROUP_K: tl.constexpr,
                         GROUP_N: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):  # grid is sized for the worst case
        return
    pair, row_ok, expert, a_row = _pair_rows(sorted_ids_ptr, block_expert_ptr, pid_m, num_pairs, A_ROW_DIV, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk  # [K, N] tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b)
        if BLOCKWISE:  # this K tile lies in one input column group and one weight block column
            g = k0 // GROUP_K
            sa = tl.load(a_scale_ptr + a_row * stride_asm + g, mask=row_ok, other=0.0)
            sb = tl.load(b_scale_ptr + expert * stride_bse + (offs_n // GROUP_N).to(tl.int64) * stride_bsn + g,
                         mask=n_ok, other=0.0)
            acc += part * sa[:, None] * sb[None, :]
        else:
            acc += part
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if FP8 and not BLOCKWISE:  # a row's scale (per token or pair) times the expert's output-row scale
        sa = tl.load(a_scale_ptr + a_row, mask=row_ok, other=0.0)
        sb = tl.load(b_scale_ptr + expert * stride_bse + offs_n, mask=n_ok, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    _store_pairs(c_ptr, acc, pair, row_ok, offs_n, n_ok, weights_ptr, stride_cm, stride_cn, MUL_WEIGHT)


@triton.jit
def _grouped_int4_kernel(a_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, c_ptr, weights_ptr, sorted_ids_ptr,
                         block_expert_ptr, num_padded_ptr, N, K, num_pairs, stride_am, stride_qe, stride_qn,
                         stride_se, stride_sn, stride_ze, stride_zn, stride_pe, stride_cm,
                         GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_PERM: tl.constexpr,
                         A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``_grouped_gemm_kernel``'s routing over int4 expert weights (W4A16)."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair, row_ok, expert, a_row = _pair_rows(sorted_ids_ptr, block_expert_ptr, pid_m, num_pairs, A_ROW_DIV, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_ok = ks < K
        if HAS_PERM:  # act-order: the expert's weight columns are in group order; read x likewise
            cols = tl.load(perm_ptr + expert * stride_pe + ks, mask=k_ok, other=0).to(tl.int64)
        else:
            cols = ks.to(tl.int64)
        a = tl.load(a_ptr + a_row[:, None] * stride_am + cols[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        # [K, N] tile: word k // 8 of the expert's row n, nibble k % 8
        words = tl.load(qw_ptr + expert * stride_qe + offs_n[None, :].to(tl.int64) * stride_qn + (ks // 8)[:, None],
                        mask=k_ok[:, None] & n_ok[None, :], other=0)
        w = dequant_int4_tile(words, ks, s_ptr + expert * stride_se + offs_n[None, :].to(tl.int64) * stride_sn,
                              z_ptr + expert * stride_ze + offs_n[None, :].to(tl.int64) * stride_zn,
                              k_ok[:, None] & n_ok[None, :], GROUP, HAS_ZERO)
        if IEEE:
            acc += tl.dot(a.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(a, w.to(a.dtype))
    _store_pairs(c_ptr, acc, pair, row_ok, offs_n, n_ok, weights_ptr, stride_cm, 1, MUL_WEIGHT)


@dataclass
class Fp8Stack:
    """FP8 experts ``q [E, N, K]`` with ``scale [E, N]`` (per channel) or, with ``block``,
    ``[E, N / block[0], K / block[1]]``."""

    q: torch.Tensor
    scale: torch.Tensor
    block: Optional[tuple[int, int]] = None

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


@dataclass
class Int4Stack:
    """int4 experts: ``qweight [E, N, K / 8]`` int32, ``scale [E, N, K / group]`` fp32,
    ``zero`` the same shape uint8 (None: 8, symmetric), ``perm [E, K]`` int32 (act-order:
    the columns each expert's weight holds, in order; None: in place)."""

    qweight: torch.Tensor
    scale: torch.Tensor
    zero: Optional[torch.Tensor]
    group: int
    perm: Optional[torch.Tensor] = None

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, words = self.qweight.shape
        return e, n, words * 8


ExpertWeights = Union[torch.Tensor, Fp8Stack, Int4Stack]


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """(sorted pair ids padded per expert to ``block_m``, expert of each block, number
    of padded slots in use), the grid sized for the worst case ``pairs + E * (block_m - 1)``.

    Pairs are flat indexes ``token * top_k + k``; padding slots hold ``pairs``
    (out of range, so masked).  Unused trailing blocks get expert 0 and are skipped
    by the kernel's ``num_padded`` check."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts
    order = flat.argsort(stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(pairs, device=dev) - start[sorted_experts]
    capacity = pairs + num_experts * (block_m - 1)
    capacity = -(-capacity // block_m) * block_m
    sorted_ids = torch.full((capacity,), pairs, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, padded_start[sorted_experts] + rank, order.to(torch.int32))
    block_start = torch.arange(0, capacity, block_m, device=dev)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_expert.to(torch.int32), padded_end[-1:].to(torch.int32)


def _tiles(n: int, k: int) -> tuple[int, int, int]:
    # 16 rows: tl.dot's minimum, and decode steps route few rows to each expert.
    return 16, min(64, max(16, triton.next_power_of_2(n))), min(64, max(16, triton.next_power_of_2(k)))


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
                 block_expert: torch.Tensor, num_padded: torch.Tensor, num_pairs: int, a_row_div: int,
                 weights: torch.Tensor | None = None, a_scale: torch.Tensor | None = None,
                 w_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """``out[pair] = a[pair // a_row_div] @ w[expert(pair)].T`` (times ``weights[pair]``);
    FP8 ``a`` / ``w`` with ``a_scale [rows]`` and ``w_scale [E, N]`` (fp32), or with
    ``block=(r, c)``: ``a_scale [rows, K / c]`` and ``w_scale [E, N / r, K / c]``."""
    _, n, k = w.shape
    block_m, block_n, block_k = _tiles(n, k)
    if block is not None:
        block_k = min(block_k, block[1])
        if block[1] % block_k:
            raise ValueError(f"expert weight blocks of {block[1]} columns are not a multiple of the K tile {block_k}")
    grid = (sorted_ids.numel() // block_m * triton.cdiv(n, block_n),)
    fp8 = a_scale is not None
    _grouped_gemm_kernel[grid](
        a, w, out, weights if weights is not None else out, sorted_ids, block_expert, num_padded, n, k, num_pairs,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        a_scale if fp8 else out, w_scale if fp8 else out, w_scale.stride(0) if fp8 else 0,
        a_scale.stride(0) if block is not None else 0, w_scale.stride(1) if block is not None else 0,
        A_ROW_DIV=a_row_div, MUL_WEIGHT=weights is not None,
        IEEE=a.dtype == torch.float32 or _INTERPRETING,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, FP8=fp8, BLOCKWISE=block is not None,
        GROUP_K=block[1] if block is not None else 1, GROUP_N=block[0] if block is not None else 1)
    return out


def grouped_gemm_int4(a: torch.Tensor, w: Int4Stack, out: torch.Tensor, sorted_ids: torch.Tensor,
                      block_expert: torch.Tensor, num_padded: torch.Tensor, num_pairs: int, a_row_div: int,
                      weights: torch.Tensor | None = None) -> torch.Tensor:
    """``grouped_gemm`` over int4 experts (W4A16: ``a`` in the model dtype)."""
    _, n, k = w.shape
    if k % w.group or a.shape[1] != k:
        raise ValueError(f"int4 experts [.., {n}, {k}] with group {w.group} do not fit inputs [.., {a.shape[1]}]")
    block_m, block_n, block_k = _tiles(n, k)
    grid = (sorted_ids.numel() // block_m * triton.cdiv(n, block_n),)
    zero = w.zero if w.zero is not None else w.scale
    perm = w.perm if w.perm is not None else sorted_ids
    _grouped_int4_kernel[grid](
        a, w.qweight, w.scale, zero, perm, out, weights if weights is not None else out, sorted_ids, block_expert,
        num_padded, n, k, num_pairs, a.stride(0), w.qweight.stride(0), w.qweight.stride(1), w.scale.stride(0),
        w.scale.stride(1), zero.stride(0), zero.stride(1), perm.stride(0) if w.perm is not None else 0, out.stride(0),
        GROUP=w.group, HAS_ZERO=w.zero is not None, HAS_PERM=w.perm is not None, A_ROW_DIV=a_row_div,
        MUL_WEIGHT=weights is not None, IEEE=a.dtype == torch.float32 or _INTERPRETING,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def fused_experts(x: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, silu_and_mul) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` for ``x [T, H]``; ``w13 [E, 2I, H]`` is
    gate | up stacked, ``w2 [E, H, I]``; ``silu_and_mul`` the backend's SwiGLU.  Each stack
    dense (a tensor in the model dtype), FP8 (``Fp8Stack``: that GEMM's input quantized per
    row, and block column group, first) or int4 (``Int4Stack``), each on its own."""
    t, top_k = topk_ids.shape
    num_pairs = t * top_k
    out = x.new_empty((t, x.shape[1]))
    if t == 0:
        return out
    sorted_ids, block_expert, num_padded = align_by_expert(topk_ids, w13.shape[0], _tiles(1, 1)[0])

    def gemm(a, w, pairs_per_row, **kw):
        dst = x.new_empty((num_pairs, w.shape[1]))
        if isinstance(w, Int4Stack):
            return grouped_gemm_int4(a.contiguous(), w, dst, sorted_ids, block_expert, num_padded, num_pairs,
                                     pairs_per_row, **kw)
        if isinstance(w, Fp8Stack):
            from worker.engine.kernels.triton.quant_gemm import quantize_fp8_rows

            a, a_scale = quantize_fp8_rows(a.contiguous(), w.block[1] if w.block is not None else None)
            kw.update(a_scale=a_scale if w.block is not None else a_scale.reshape(-1), w_scale=w.scale,
                      block=w.block)
            w = w.q
        grouped_gemm(a, w, dst, sorted_ids, block_expert, num_padded, num_pairs, pairs_per_row, **kw)
        return dst

    gate_up = gemm(x, w13, top_k)
    down = gemm(silu_and_mul(gate_up), w2, 1, weights=topk_weights.reshape(-1).to(torch.float32).contiguous())
    return torch.sum(down.view(t, top_k, -1), dim=1, out=out)


def fused_experts_fp8(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                      w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      silu_and_mul, block: tuple[int, int] | None = None) -> torch.Tensor:
    """``fused_experts`` over FP8 experts (``w13 [E, 2I, H]``, ``w2 [E, H, I]`` in
    float8_e4m3fn), W8A8 with dynamic input scales: scales ``[E, 2I]`` / ``[E, H]`` (per
    channel), or with ``block=(r, c)`` ``[E, 2I / r, H / c]`` / ``[E, H / r, I / c]``."""
    return fused_experts(x, Fp8Stack(w13, w13_scale, block), Fp8Stack(w2, w2_scale, block), topk_weights, topk_ids,
                         silu_and_mul)


def compile_specs() -> list:
    specs = []
    for dtype, ieee, mul in (("bf16", False, False), ("bf16", False, True), ("fp16", False, True),
                             ("fp32", True, True)):
        specs.append((f"fused_moe_gemm[{dtype}{',weighted' if mul else ''}]", _grouped_gemm_kernel,
                      {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "c_ptr": f"*{dtype}", "weights_ptr": "*fp32",
                       "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32",
                       "N": "i32", "K": "i32", "num_pairs": "i32", "stride_am": "i64", "stride_ak": "i64",
                       "stride_be": "i64", "stride_bn": "i64", "stride_bk": "i64", "stride_cm": "i64",
                       "stride_cn": "i64", "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32", "stride_bse": "i64",
                       "stride_asm": "i64", "stride_bsn": "i64"},
                      dict(A_ROW_DIV=1 if mul else 2, MUL_WEIGHT=mul, IEEE=ieee, BLOCK_M=16, BLOCK_N=64,
                           BLOCK_K=64, FP8=False, BLOCKWISE=False, GROUP_K=1, GROUP_N=1)))
    for dtype, mul, blockwise in (("bf16", False, False), ("bf16", True, False), ("fp16", True, False),
                                  ("bf16", False, True), ("bf16", True, True)):
        specs.append((f"fused_moe_gemm[fp8->{dtype}{',weighted' if mul else ''}{',128x128 blocks' if blockwise else ''}]",
                      _grouped_gemm_kernel,
                      {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": f"*{dtype}", "weights_ptr": "*fp32",
                       "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32",
                       "N": "i32", "K": "i32", "num_pairs": "i32", "stride_am": "i64", "stride_ak": "i64",
                       "stride_be": "i64", "stride_bn": "i64", "stride_bk": "i64", "stride_cm": "i64",
                       "stride_cn": "i64", "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32", "stride_bse": "i64",
                       "stride_asm": "i64", "stride_bsn": "i64"},
                      dict(A_ROW_DIV=1 if mul else 2, MUL_WEIGHT=mul, IEEE=False, BLOCK_M=16, BLOCK_N=64,
                           BLOCK_K=64, FP8=True, BLOCKWISE=blockwise, GROUP_K=128 if blockwise else 1,
                           GROUP_N=128 if blockwise else 1)))
    for dtype, mul, zero, perm in (("bf16", False, "u8", False), ("bf16", True, "u8", False),
                                   ("bf16", False, None, True), ("fp16", True, "u8", True)):
        specs.append((f"fused_moe_int4[{dtype}{',weighted' if mul else ''},{zero or 'sym'}{',act-order' if perm else ''}]",
                      _grouped_int4_kernel,
                      {"a_ptr": f"*{dtype}", "qw_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": f"*{zero}" if zero else "*fp32",
                       "perm_ptr": "*i32", "c_ptr": f"*{dtype}", "weights_ptr": "*fp32", "sorted_ids_ptr": "*i32",
                       "block_expert_ptr": "*i32", "num_padded_ptr": "*i32", "N": "i32", "K": "i32",
                       "num_pairs": "i32", "stride_am": "i64", "stride_qe": "i64", "stride_qn": "i64",
                       "stride_se": "i64", "stride_sn": "i64", "stride_ze": "i64", "stride_zn": "i64",
                       "stride_pe": "i64", "stride_cm": "i64"},
                      dict(GROUP=128, HAS_ZERO=zero is not None, HAS_PERM=perm, A_ROW_DIV=1 if mul else 2,
                           MUL_WEIGHT=mul, IEEE=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)))
    return specs
