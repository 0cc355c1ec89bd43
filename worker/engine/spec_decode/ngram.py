"""N-gram (prompt lookup) drafts, as vLLM's ngram proposer: the tokens that followed
the earliest occurrence of the sequence's longest suffix (at most ``max_n`` tokens)
that occurred before; none when that suffix is shorter than ``min_n``.  The draft
is what followed, up to ``k`` tokens.  Candidates are found with whole-array
comparisons (one pass per suffix length over the positions still matching), never a
per-token Python loop.
"""
from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to ``k`` draft tokens continuing ``tokens`` (int array); empty when no
    suffix of length >= ``min_n`` occurred before."""
    size = len(tokens)
    if k <= 0 or size < min_n + 1:
        return tokens[:0]
    # ends[j]: exclusive end of a candidate earlier occurrence (it must end before the
    # suffix itself does); matched while tokens[end - n:end] == tokens[size - n:].
    ends = np.flatnonzero(tokens[:size - 1] == tokens[size - 1]) + 1
    best = None
    for n in range(1, min(max_n, size - 1) + 1):
        if n > 1:
            starts = ends - n
            ok = starts >= 0
            ends = ends[ok]
            ends = ends[tokens[starts[ok]] == tokens[size - n]]
        if not len(ends):
            break
        if n >= min_n:
            best = ends
    if best is None:
        return tokens[:0]
    end = int(best[0])  # the earliest occurrence (vLLM's choice)
    return tokens[end:end + k]
