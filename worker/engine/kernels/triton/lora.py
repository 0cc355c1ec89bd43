"""Segmented LoRA matmuls for the CUDA path (punica's SGMV, vLLM's lora_shrink /
lora_expand): a step's tokens are sorted by adapter slot once (LoRABatch), and each
program owns ``BLOCK_M`` tokens of one slot's segment and ``BLOCK_N`` output
columns, gathering its token rows by index and multiplying by that slot's matrix.

    shrink:  s[tok] = x[tok] @ A[slot].T          A [slots, G * R, in]  (fp32 out)
    expand:  y[tok] += s[tok] @ B[slot].T         B [slots, out, R]

Tokens of no adapter are not in any segment and are never touched.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# As in fused_moe.py: the interpreter multiplies bf16 dots wrongly, so it runs them in fp32.
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _sgmv_kernel(x_ptr, w_ptr, out_ptr, sorted_ptr, slot_ptr, start_ptr, len_ptr, N, K,
                 stride_xm, stride_xk, stride_ws, stride_wn, stride_wk, stride_om, stride_on,
                 ADD: tl.constexpr, IEEE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    seg = tl.program_id(2)
    count = tl.load(len_ptr + seg)
    if pid_m * BLOCK_M >= count:  # the grid is sized for the longest segment
        return
    start = tl.load(start_ptr + seg)
    slot = tl.load(slot_ptr + seg).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < count
    rows = tl.load(sorted_ptr + start + offs_m, mask=m_ok, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + slot * stride_ws + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [K, N] tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a.to(b.dtype), b)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    mask = m_ok[:, None] & n_ok[None, :]
    if ADD:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _sgmv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, batch, add: bool) -> torch.Tensor:
    n, k = w.shape[1], w.shape[2]
    block_m = 16  # tl.dot's minimum; decode segments are short
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (triton.cdiv(batch.max_seg_len, block_m), triton.cdiv(n, block_n), batch.slot_ids.numel())
    _sgmv_kernel[grid](x, w, out, batch.sorted_tokens, batch.slot_ids, batch.seg_start, batch.seg_len, n, k,
                       x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
                       ADD=add, IEEE=w.dtype == torch.float32 or _INTERPRETING,
                       BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def lora_shrink(x: torch.Tensor, a: torch.Tensor, batch) -> torch.Tensor:
    """``[T, G * R]`` float32: each adapter row's ``x @ A[slot].T`` (other rows unset)."""
    out = torch.empty((x.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    return _sgmv(x, a, out, batch, add=False)


def lora_expand(shrunk: torch.Tensor, b: torch.Tensor, y: torch.Tensor, batch) -> torch.Tensor:
    """``y[tok] += shrunk[tok] @ B[slot].T`` in place for every adapter row."""
    return _sgmv(shrunk, b, y, batch, add=True)


def compile_specs() -> list:
    specs = []
    for x_dtype, w_dtype, out_dtype, add in (("bf16", "bf16", "fp32", False), ("fp32", "bf16", "bf16", True),
                                             ("fp16", "fp16", "fp32", False), ("fp32", "fp16", "fp16", True),
                                             ("fp32", "fp32", "fp32", True)):
        name = f"lora_sgmv[{w_dtype},{'expand' if add else 'shrink'}]"
        specs.append((name, _sgmv_kernel,
                      {"x_ptr": f"*{x_dtype}", "w_ptr": f"*{w_dtype}", "out_ptr": f"*{out_dtype}",
                       "sorted_ptr": "*i32", "slot_ptr": "*i32", "start_ptr": "*i32", "len_ptr": "*i32",
                       "N": "i32", "K": "i32", "stride_xm": "i64", "stride_xk": "i64", "stride_ws": "i64",
                       "stride_wn": "i64", "stride_wk": "i64", "stride_om": "i64", "stride_on": "i64"},
                      dict(ADD=add, IEEE=w_dtype == "fp32", BLOCK_M=16, BLOCK_N=64, BLOCK_K=16 if add else 64)))
    return specs
