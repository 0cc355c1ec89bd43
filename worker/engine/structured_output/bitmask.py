"""The step's grammar bitmask: a reusable host buffer the matchers fill, and the op that
applies it to the logits before the sampler.

Layout (xgrammar's): one int32 row of ``ceil(V / 32)`` words per constrained logits row,
bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed.  On CPU xgrammar's C++
kernel applies it (one pass; the vectorised torch op below, the reference, unpacks 32x
the mask's size and took ~5x longer on 32 rows of a 32k vocabulary); on CUDA the buffer
is pinned, copied without a sync and applied by the Triton kernel
(kernels/triton/bitmask.py).
"""
from __future__ import annotations

from typing import Sequence

import torch

_NEG_INF = float("-inf")
_CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_bitmask_torch_(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor) -> None:
    """Reference and CPU path: ``logits[indices[i]]`` keeps only the tokens allowed by
    ``bitmask[i]``."""
    if indices.numel() == 0:
        return
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].to(torch.bool)
    rows = logits.index_select(0, indices)
    rows.masked_fill_(~allowed, _NEG_INF)
    logits.index_copy_(0, indices, rows)


class BitmaskBuffer:
    """Host rows for the step's masks, grown on demand and reused (pinned on CUDA)."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.device = device
        self._buf = torch.empty(0, self.words, dtype=torch.int32)

    def rows(self, k: int) -> torch.Tensor:
        """A ``[k, words]`` view to fill (contents undefined)."""
        if self._buf.shape[0] < k:
            cap = max(k, 2 * self._buf.shape[0], 8)
            self._buf = torch.empty(cap, self.words, dtype=torch.int32,
                                    pin_memory=self.device.type == "cuda")
        return self._buf[:k]

    def apply_(self, logits: torch.Tensor, k: int, logit_rows: Sequence[int]) -> None:
        """Apply the first ``k`` filled rows to ``logits[logit_rows]`` in place."""
        if k == 0:
            return
        mask = self._buf[:k]
        if logits.device.type == "cuda":
            indices = torch.tensor(logit_rows, dtype=torch.long)
            from worker.engine.kernels.triton import ops

            if not logits.is_contiguous():
                raise ValueError("the grammar bitmask needs contiguous logits")
            ops().apply_bitmask_(logits, mask.to(logits.device, non_blocking=True),
                                 indices.to(logits.device, non_blocking=True))
            # The pinned rows are refilled next step: the copy must have read them by then
            # (the sampler syncs on the sampled ids every step, which orders it).
        elif logits.dtype in _CPU_KERNEL_DTYPES and logits.stride(-1) == 1:
            from xgrammar.kernels.apply_token_bitmask_inplace_cpu import apply_token_bitmask_inplace_cpu

            first = logit_rows[0]
            if list(logit_rows) == list(range(first, first + k)):  # the usual case: one run of rows
                apply_token_bitmask_inplace_cpu(logits[first:first + k], mask, self.vocab_size)
            else:
                for i, row in enumerate(logit_rows):
                    apply_token_bitmask_inplace_cpu(logits[row], mask[i], self.vocab_size)
        else:
            apply_bitmask_torch_(logits, mask, torch.tensor(logit_rows, dtype=torch.long))
