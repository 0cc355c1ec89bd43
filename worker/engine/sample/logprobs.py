"""Logprob tensors (sampled and prompt tokens) and their conversion to the wire
``TokenLogprobs``.

Logprobs are vLLM's default "raw_logprobs": log_softmax of the model's logits
before any penalty, bias or temperature.  Ranks are 1-based: the number of vocab
entries with a strictly greater logprob, plus one.

Clamping: ``to_token_logprobs`` maps NaN and anything below -9999 (including
-inf) to -9999.0, so the worker already emits what the HTTP layer prints; the
gateway may clamp again harmlessly.  ``score_token_ids`` keeps -inf padding
(the .npy payload of prompt_token_id_logprobs is specified with -inf padding).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from common.protocol import TokenLogprobs

LOGPROB_FLOOR = -9999.0
PROMPT_ROWS_PER_BLOCK = 256  # prompt positions per log_softmax (bounds [rows, vocab] temporaries)


@dataclass
class LogprobsTensors:
    """Per position: the chosen token's logprob and rank plus the top-k alternatives."""

    token_ids: torch.Tensor  # [N] long: sampled (or prompt target) token
    token_logprobs: torch.Tensor  # [N] float32
    ranks: torch.Tensor  # [N] int32, 1-based
    top_ids: torch.Tensor  # [N, k] long, descending logprob
    top_logprobs: torch.Tensor  # [N, k] float32

    def tolists(self) -> "LogprobsLists":
        """One device->host copy per tensor for the whole batch."""
        return LogprobsLists(
            token_ids=self.token_ids.tolist(),
            token_logprobs=self.token_logprobs.tolist(),
            ranks=self.ranks.tolist(),
            top_ids=self.top_ids.tolist(),
            top_logprobs=self.top_logprobs.tolist(),
        )


@dataclass
class LogprobsLists:
    token_ids: list[int]
    token_logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(dim=-1, dtype=torch.float32)


def token_ranks(logprobs: torch.Tensor, token_logprobs: torch.Tensor) -> torch.Tensor:
    """1-based rank of each row's token: count of strictly greater logprobs + 1."""
    # int32 accumulation: about twice as fast as the default int64 sum of a bool mask
    return (logprobs > token_logprobs.unsqueeze(-1)).sum(-1, dtype=torch.int32) + 1


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int,
                    token_ids: torch.Tensor) -> LogprobsTensors:
    """Top ``num_logprobs`` (-1 = whole vocab) of each row plus ``token_ids``' logprob/rank."""
    k = logprobs.shape[-1] if num_logprobs == -1 else min(num_logprobs, logprobs.shape[-1])
    token_ids = token_ids.long()
    token_lp = logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    ranks = token_ranks(logprobs, token_lp)
    if k > 0:
        top_lp, top_ids = torch.topk(logprobs, k, dim=-1)
    else:
        top_lp = logprobs.new_empty((logprobs.shape[0], 0))
        top_ids = torch.empty((logprobs.shape[0], 0), dtype=torch.long, device=logprobs.device)
    return LogprobsTensors(token_ids, token_lp, ranks, top_ids, top_lp)


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor,
                            k: int) -> LogprobsTensors:
    """Logprobs of prompt tokens: row i of ``logits`` predicts ``target_ids[i]``
    (the prompt token at position i + 1), with its top ``k`` (-1 = whole vocab).
    Rows are processed in blocks so a long prefill chunk never materialises a
    float32 [chunk, vocab] log_softmax at once."""
    parts = [gather_logprobs(compute_logprobs(logits[i:i + PROMPT_ROWS_PER_BLOCK]), k,
                             target_ids[i:i + PROMPT_ROWS_PER_BLOCK])
             for i in range(0, logits.shape[0], PROMPT_ROWS_PER_BLOCK)]
    if len(parts) == 1:
        return parts[0]
    return LogprobsTensors(*(torch.cat([getattr(p, f) for p in parts])
                             for f in ("token_ids", "token_logprobs", "ranks", "top_ids",
                                       "top_logprobs")))


def score_token_ids(logits: torch.Tensor, rows: Sequence[Sequence[int]]) -> np.ndarray:
    """``prompt_logprob_token_ids`` scores: row i's logprob (raw log_softmax of
    ``logits[i]``) of each id in ``rows[i]``.  Float32 [len(rows), max ids];
    ragged rows are padded with -inf and id -1 (vLLM's padding value) scores -inf."""
    n = len(rows)
    width = max((len(r) for r in rows), default=0)
    if n == 0 or width == 0:
        return np.full((n, width), -np.inf, dtype=np.float32)
    if logits.shape[0] != n:
        raise ValueError(f"score_token_ids: {logits.shape[0]} logit rows for {n} id rows")
    ids = np.full((n, width), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
    ids_t = torch.from_numpy(ids).to(logits.device)
    out = np.empty((n, width), dtype=np.float32)
    for i in range(0, n, PROMPT_ROWS_PER_BLOCK):
        block = ids_t[i:i + PROMPT_ROWS_PER_BLOCK]
        scores = compute_logprobs(logits[i:i + PROMPT_ROWS_PER_BLOCK]).gather(-1, block.clamp(min=0))
        out[i:i + PROMPT_ROWS_PER_BLOCK] = scores.masked_fill(block < 0, float("-inf")).cpu().numpy()
    return out


def clamp_logprob(x: float) -> float:
    """NaN and < -9999 (incl. -inf) -> -9999.0, as vLLM's OpenAI shapes print them."""
    if math.isnan(x) or x < LOGPROB_FLOOR:
        return LOGPROB_FLOOR
    return x


def to_token_logprobs(lists: LogprobsLists, row: int, k: Optional[int]) -> TokenLogprobs:
    """One position's logprobs for a row that asked for ``k`` alternatives
    (-1 = whole vocab, needs the batch to have gathered the whole vocab).
    The batch gathered ``max k`` columns; this keeps the row's own first k."""
    top_ids = lists.top_ids[row]
    top_lps = lists.top_logprobs[row]
    if k is not None and k != -1:
        top_ids = top_ids[:k]
        top_lps = top_lps[:k]
    return TokenLogprobs(
        token_ids=[lists.token_ids[row]],
        logprobs=[clamp_logprob(lists.token_logprobs[row])],
        ranks=[lists.ranks[row]],
        top_ids=[list(top_ids)],
        top_logprobs=[[clamp_logprob(x) for x in top_lps]],
    )


def prompt_token_logprobs(lists: LogprobsLists) -> TokenLogprobs:
    """All positions of a prompt-logprobs computation as one column-wise run."""
    return TokenLogprobs(
        token_ids=list(lists.token_ids),
        logprobs=[clamp_logprob(x) for x in lists.token_logprobs],
        ranks=list(lists.ranks),
        top_ids=[list(r) for r in lists.top_ids],
        top_logprobs=[[clamp_logprob(x) for x in r] for r in lists.top_logprobs],
    )


def extend_token_logprobs(dst: Optional[TokenLogprobs], src: TokenLogprobs) -> TokenLogprobs:
    """Append ``src``'s positions to ``dst`` (a delta accumulating several tokens)."""
    if dst is None:
        return src
    dst.token_ids.extend(src.token_ids)
    dst.logprobs.extend(src.logprobs)
    dst.ranks.extend(src.ranks)
    dst.top_ids.extend(src.top_ids)
    dst.top_logprobs.extend(src.top_logprobs)
    if src.token_texts is not None:
        dst.token_texts = (dst.token_texts or []) + src.token_texts
    if src.top_texts is not None:
        dst.top_texts = (dst.top_texts or []) + src.top_texts
    return dst
