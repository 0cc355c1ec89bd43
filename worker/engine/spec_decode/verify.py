"""Verifying drafts in the engine's step: a choice that verified drafts owns one sampler
row per draft after its own; each row's token was sampled from the target distribution
after the drafts before it, so the tokens up to the first that differs from its draft
are exactly what decoding one by one would produce."""
from __future__ import annotations

from typing import Any

from worker.engine.records import SequenceOutput
from worker.engine.spec_decode.speculator import accepted_prefix


def append_verified(core, seq, spec: tuple, sampled: list[int], lp_lists: Any, r: int, now: float) -> SequenceOutput:
    """Append the accepted drafts of ``seq`` (rows ``r..``) and the token after them."""
    accepted = accepted_prefix(sampled, r, spec)
    core.spec_decode.record(seq, len(spec), accepted)
    tokens, texts = [], []
    for j in range(accepted + 1):
        if j:  # the token before this one was the draft computed at its position
            core.scheduler.accept_draft(seq)
        out = core.append_token(seq, sampled[r + j], lp_lists, r + j, now)
        tokens += out.new_token_ids
        if out.text:
            texts.append(out.text)
        if seq.is_finished():
            break
    return SequenceOutput(seq.request, seq.index, seq, tokens, "".join(texts) if texts else None)
