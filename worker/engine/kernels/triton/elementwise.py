"""Row-wise kernels beside attention: RMSNorm (optionally after the residual add),
rotary embedding in place on the fused q/k view, and SwiGLU.  Same call semantics
as the compiled CPU module (worker/engine/kernels/cpu_kernels.cpp) and the same
rounding points as transformers (norm in fp32, cast to the model dtype, then the
weight), so bf16 outputs track HF's."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # Rounded to the model dtype like HF's add (fp32 arithmetic: exact for bf16/fp16 inputs
        # before the one rounding, and the interpreter has no native bf16 add).
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + offs, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``norm(x) * weight``; with ``residual``: ``residual += x`` in place first and the
    norm is of that sum.  x ``[T, H]``, rows contiguous."""
    t, hidden = x.shape
    out = torch.empty_like(x)
    if t == 0:
        return out
    res = residual if residual is not None else x
    _rms_norm_kernel[(t,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), hidden, float(eps),
                           HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden))
    return out


@triton.jit
def _rotary_kernel(x_ptr, table_ptr, pos_ptr, stride_xt, stride_xh, stride_tab, num_heads,
                   HALF: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < num_heads) & (d < HALF)
    row = table_ptr + pos * stride_tab  # cos | cos | -sin | sin
    cos = tl.load(row + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + 3 * HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    base = x_ptr + t * stride_xt + h * stride_xh
    x1 = tl.load(base + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(base + d, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF + d, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


def rotary_(qk: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> None:
    """Rotate ``qk [T, heads, D]`` in place (neox halves) by the rows ``positions`` of a
    ``rotation_table`` ``[N, 2 * D]``."""
    t, heads, d = qk.shape
    if qk.stride(2) != 1 or table.stride(1) != 1:
        raise ValueError("rotary_ needs the head dimension contiguous")
    if t == 0:
        return
    half = d // 2
    _rotary_kernel[(t,)](qk, table, positions, qk.stride(0), qk.stride(1), table.stride(0), heads,
                         HALF=half, HEADS_PAD=triton.next_power_of_2(heads), HALF_PAD=triton.next_power_of_2(half))


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < inter
    gate = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + col, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)  # silu, rounded as torch's F.silu
    tl.store(out_ptr + row * stride_o + col, (act.to(tl.float32) * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused ``[T, 2I]`` projection -> ``[T, I]``."""
    if gate_up.stride(1) != 1:  # the kernel walks columns with unit stride
        gate_up = gate_up.contiguous()
    t, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    if t == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(t, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0), inter,
                                                          BLOCK=block)
    return out


def compile_specs() -> list:
    specs = []
    for dtype in ("bf16", "fp32"):
        specs.append((f"rms_norm[{dtype},residual]", _rms_norm_kernel,
                      {"x_ptr": f"*{dtype}", "res_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
                       "stride_x": "i64", "stride_r": "i64", "stride_o": "i64", "hidden": "i32", "eps": "fp32"},
                      dict(HAS_RESIDUAL=True, BLOCK=4096)))
        specs.append((f"rotary[{dtype}]", _rotary_kernel,
                      {"x_ptr": f"*{dtype}", "table_ptr": f"*{dtype}", "pos_ptr": "*i64", "stride_xt": "i64",
                       "stride_xh": "i64", "stride_tab": "i64", "num_heads": "i32"},
                      dict(HALF=64, HEADS_PAD=64, HALF_PAD=64)))
        specs.append((f"silu_and_mul[{dtype}]", _silu_and_mul_kernel,
                      {"x_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "stride_x": "i64", "stride_o": "i64",
                       "inter": "i32"},
                      dict(BLOCK=1024)))
    return specs
