"""What a choice appends from the rows it sampled: its sampling plan gives it one logits
row, plus one per draft it verifies (speculative decoding), each row's distribution the
target's after the drafts before it.  The tokens up to and including the first that
differs from its draft are exactly what decoding one token at a time would have sampled
(and when every draft matches, the row after the last draft adds one more).  The core
appends that list whatever proposed the drafts; a choice without drafts appends its one
sampled token."""
from __future__ import annotations

from typing import Sequence


def accepted_prefix(sampled: Sequence[int], r: int, drafts: Sequence[int]) -> int:
    """How many leading drafts equal the token sampled at their position (rows r..)."""
    n = 0
    while n < len(drafts) and sampled[r + n] == drafts[n]:
        n += 1
    return n


def verified_tokens(sampled: Sequence[int], r: int, drafts: Sequence[int]) -> list[int]:
    """The tokens a choice whose rows start at ``r`` appends: the accepted drafts (as
    sampled) and the token after them."""
    return list(sampled[r:r + accepted_prefix(sampled, r, drafts) + 1])
