"""Grammar bitmask applied to logits in place (structured outputs): bit ``t % 32`` of
word ``t // 32`` of a row's int32 bitmask set = token ``t`` allowed; every other logit of
that row becomes -inf.  ``indices[i]`` is the logits row that bitmask row ``i`` masks
(only the constrained rows of the step have one).  xgrammar's layout and semantics
(``xgr.apply_token_bitmask_inplace``); one program per (row, block of the vocabulary)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _apply_bitmask_kernel(logits_ptr, bitmask_ptr, indices_ptr, vocab_size, stride_l, stride_b,
                          BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(indices_ptr + i).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < vocab_size
    words = tl.load(bitmask_ptr + i.to(tl.int64) * stride_b + offs // 32, mask=in_vocab, other=-1)
    blocked = ((words >> (offs % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride_l + offs, float("-inf"), mask=in_vocab & blocked)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor) -> None:
    """``logits [R, V]`` (rows contiguous), ``bitmask [K, ceil(V / 32)]`` int32 on the
    same device, ``indices [K]`` the logits row of each bitmask row."""
    k = indices.shape[0]
    vocab = logits.shape[1]
    if k == 0:
        return
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("apply_bitmask_ needs contiguous rows")
    block = 4096
    _apply_bitmask_kernel[(k, triton.cdiv(vocab, block))](logits, bitmask, indices, vocab, logits.stride(0),
                                                          bitmask.stride(0), BLOCK=block)


def compile_specs() -> list:
    return [(f"apply_bitmask[{dtype}]", _apply_bitmask_kernel,
             {"logits_ptr": f"*{dtype}", "bitmask_ptr": "*i32", "indices_ptr": "*i64", "vocab_size": "i32",
              "stride_l": "i64", "stride_b": "i64"}, dict(BLOCK=4096))
            for dtype in ("fp32", "bf16")]
