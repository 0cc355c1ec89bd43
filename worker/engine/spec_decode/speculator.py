"""Drafts for the running decodes and the bookkeeping of their verification.

Verification is exact for greedy and sampled rows alike: a drafting choice gets one
logits row per position (after its last token, after each draft), each sampled with
the ordinary sampler from the distribution it would have at that point (penalty and
min_tokens histories include the drafts before it); the tokens up to and including
the first one that differs from its draft are emitted.  With deterministic drafts
(a point mass q) this is rejection sampling's rule: draft d is kept with probability
p(d), and a rejected position's token is drawn from p without d.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from common.protocol import SpecDecodeStats
from worker.engine.records import EngineSequence
from worker.engine.spec_decode.config import SpeculativeConfig
from worker.engine.spec_decode.ngram import propose_ngram


# Backoff: a choice whose recent drafts were mostly rejected stops drafting (verifying
# them costs compute once a batch is not purely bandwidth-bound) and retries later.
_ACCEPTANCE_DECAY = 0.5  # weight of the older history in the running acceptance share
_MIN_ACCEPTANCE = 0.25  # below this share, no drafts...
_RECOVERY = 0.05  # ...and each step without drafts moves the share back up by this much


class SeqDrafting:
    """What a proposer keeps per sequence (owned by the speculator, keyed by seq_id)."""

    __slots__ = ("acceptance", "draft_lag", "draft_synced", "token_buffer", "drafts")

    def __init__(self):
        self.drafts: list[int] = []  # proposed for the next step (the scheduler asks: drafts())
        self.acceptance = 1.0  # recent share of its drafts accepted (drafting backs off when low)
        self.draft_lag = 0  # draft model: trailing computed positions its KV lacks
        self.draft_synced = -1  # draft model: num_preemptions when its KV last covered the context
        self.token_buffer = None  # n-gram drafts: (int64 array, filled) mirror of token_ids


class Speculator:
    """What every proposer shares: which running decodes draft and how many tokens
    (limits, backoff, the step cap), and the per-request counts."""

    def __init__(self, config: SpeculativeConfig, max_step_tokens: Optional[int] = None):
        """``max_step_tokens``: a step's decode rows plus drafts stay within this (None:
        no cap).  Verifying drafts is nearly free while a step is bound by reading the
        weights; where compute binds (a CPU past a few rows) every verified draft costs
        about what a decode row does, so the cap gives the room left to the choices
        whose drafts were accepted most."""
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_step_tokens = max_step_tokens
        self.seqs: dict[int, SeqDrafting] = {}  # seq_id -> its drafting state

    def state(self, seq: EngineSequence) -> SeqDrafting:
        st = self.seqs.get(seq.seq_id)
        if st is None:
            st = self.seqs[seq.seq_id] = SeqDrafting()
        return st

    def forget(self, seq: EngineSequence) -> None:
        """The sequence finished: drop its drafting state."""
        self.seqs.pop(seq.seq_id, None)

    def propose(self, running: Sequence[EngineSequence], max_model_len: int) -> None:
        """Propose the drafts of every running decode (``drafts(seq)``; empty: nothing to verify)."""
        cfg = self.config
        off = cfg.disable_by_batch_size is not None and len(running) >= cfg.disable_by_batch_size
        decodes = []
        for st in self.seqs.values():
            st.drafts = []
        for seq in running:
            if off or seq.num_tokens - seq.num_computed_tokens != 1:
                continue
            st = self.state(seq)
            if st.acceptance < _MIN_ACCEPTANCE:
                st.acceptance += _RECOVERY
                continue
            decodes.append(seq)
        budget = None if self.max_step_tokens is None else max(self.max_step_tokens - len(decodes), 0)
        if budget is not None and len(decodes) * self.k > budget:
            decodes.sort(key=lambda s: -self.seqs[s.seq_id].acceptance)
        for seq in decodes:
            # Never draft past the context or past what the request may still emit
            # (every step emits the accepted drafts plus one token).
            k = min(self.k, max_model_len - seq.num_tokens, seq.request.max_tokens - seq.num_output_tokens - 1)
            if budget is not None:
                k = min(k, budget)
            if k > 0:
                st = self.seqs[seq.seq_id]
                st.drafts = self.draft_tokens(seq, k)
                if budget is not None:
                    budget -= len(st.drafts)

    def drafts(self, seq: EngineSequence) -> list[int]:
        """The drafts proposed for ``seq``'s next step (the scheduler's draft source)."""
        st = self.seqs.get(seq.seq_id)
        return st.drafts if st is not None else []

    def draft_tokens(self, seq: EngineSequence, k: int) -> list[int]:
        """Up to ``k`` drafts for ``seq`` before the step is scheduled."""
        raise NotImplementedError

    def fill(self, scheduled: list) -> None:
        """After scheduling: give the scheduled draft slots their tokens (model proposers)."""

    def allocate(self, num_blocks: int, max_model_len: int) -> None:
        """A KV cache of its own beside the target's (model proposers)."""

    def release_cache(self) -> None:
        """Sleep: give that cache back (``allocate`` restores it)."""

    def new_stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.k, [0] * (self.k + 1))

    def record(self, seq: EngineSequence, num_drafts: int, num_accepted: int) -> None:
        """One verify step of ``seq``: its running acceptance share (drafting backs off
        when low); the request's counts are the component's (component.py)."""
        st = self.state(seq)
        st.acceptance = _ACCEPTANCE_DECAY * st.acceptance + (1 - _ACCEPTANCE_DECAY) * num_accepted / num_drafts


class NgramSpeculator(Speculator):
    def draft_tokens(self, seq: EngineSequence, k: int) -> list[int]:
        cfg = self.config
        return propose_ngram(_token_array(seq, self.state(seq)), k, cfg.prompt_lookup_min, cfg.prompt_lookup_max).tolist()


def _token_array(seq: EngineSequence, st: SeqDrafting) -> np.ndarray:
    """``seq.token_ids`` as a numpy view, kept in a buffer grown by doubling that only
    copies the tokens appended since the last call (a long context is not converted
    again every step).  A cut ``token_ids`` (a stop string: the choice finished) is
    seen by its length."""
    buf, filled = st.token_buffer if st.token_buffer is not None else (None, 0)
    n = seq.num_tokens
    if buf is None or filled > n:
        buf, filled = np.empty(max(2 * n, 64), dtype=np.int64), 0
    if n > len(buf):
        grown = np.empty(2 * n, dtype=np.int64)
        grown[:filled] = buf[:filled]
        buf = grown
    if n > filled:
        buf[filled:n] = seq.token_ids[filled:n]
    st.token_buffer = (buf, n)
    return buf[:n]
