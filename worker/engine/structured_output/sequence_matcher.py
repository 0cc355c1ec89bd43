"""One sequence's grammar state: an xgrammar matcher that follows the sequence's output.

The matcher is driven from the sequence's own tokens (``catch_up``), not from the step's
outputs, so it always matches what the sequence holds: after recompute preemption the
output tokens stay (only their KV is recomputed) and the matcher, which has accepted
exactly them, stays valid; drafts never reach it except inside ``fill_rows``, which
advances through them to mask each verify row and rolls back before returning (vLLM's
``grammar_bitmask``).

A state whose mask allows no token, not even a stop (a rule that can never complete, e.g.
``root ::= "a" x`` with ``x ::= x``), is never sampled from: after a draft, that draft is
forbidden at its own row; at the next token, ``fill_rows`` raises ``DeadEnd`` and the
request ends with an error (components/structured_output.py).
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch

from worker.engine.structured_output.reasoning import ends_with

log = logging.getLogger(__name__)


class DeadEnd(Exception):
    """The grammar allows no next token, not even a stop: nothing may be sampled."""


class SequenceMatcher:
    def __init__(self, matcher: Any, reasoning_end: Optional[Sequence[int]], reasoning_ended: bool):
        self.matcher = matcher
        self.reasoning_end = list(reasoning_end) if reasoning_end else None
        self.reasoning_ended = reasoning_ended
        self.consumed = 0  # output tokens seen (fed to the grammar, or reasoning before it)
        self.failed = False  # the grammar rejected an accepted token (a bug): stop constraining

    def catch_up(self, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Feed the output tokens appended since the last call."""
        end = len(token_ids)
        pos = num_prompt_tokens + self.consumed
        matcher = self.matcher
        while pos < end:
            token = token_ids[pos]
            pos += 1
            if self.failed:
                continue
            if not self.reasoning_ended:
                marker = self.reasoning_end
                if marker is not None and pos >= len(marker) and list(token_ids[pos - len(marker):pos]) == marker:
                    self.reasoning_ended = True  # the marker is reasoning; the grammar starts after it
                continue
            if matcher.is_terminated():
                continue  # past the grammar's end (ignore_eos): unconstrained, as vLLM
            if not matcher.accept_token(token):
                log.error("the grammar rejected token %d it had allowed; the sequence is no longer constrained", token)
                self.failed = True
        self.consumed = max(self.consumed, end - num_prompt_tokens)

    @property
    def constrains(self) -> bool:
        return self.reasoning_ended and not self.failed and not self.matcher.is_terminated()

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many leading ``drafts`` the grammar accepts (vLLM's validate_tokens: up to
        the first it rejects, or up to the one that ends it); the state is unchanged."""
        matcher = self.matcher
        if matcher.is_terminated():
            return 0
        n = 0
        for token in drafts:
            if not matcher.accept_token(token):
                break
            n += 1
            if matcher.is_terminated():
                break
        if n:
            matcher.rollback(n)
        return n

    def fill_rows(self, bitmask: torch.Tensor, index: int, drafts: Sequence[int],
                  context: Sequence[int]) -> list[tuple[int, int]]:
        """Fill one mask row per constrained position ``j`` (0: the next token; j: after
        ``drafts[:j]``) starting at ``bitmask[index]``; [(j, bitmask row)].  ``context``:
        the sequence's last tokens (a reasoning end marker may close across them)."""
        if self.failed:
            return []
        matcher = self.matcher
        filled: list[tuple[int, int]] = []
        ended = self.reasoning_ended
        tail = list(context)
        advanced = 0
        rejected_row: Optional[int] = None
        prev_row: Optional[int] = None  # the row of position j-1 (None: not constrained)
        for j in range(len(drafts) + 1):
            if rejected_row is not None:
                # A draft the grammar rejects is never accepted (its row forbids it), so the
                # rows after it are never used; they keep the rejecting row's mask.
                bitmask[index].copy_(bitmask[rejected_row])
                filled.append((j, index))
                index += 1
                continue
            row = None
            if ended and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, index)
                if not bool(bitmask[index].any()):
                    # A dead end (a rule that can never complete): nothing may be sampled here.
                    if prev_row is None or not _forbid(bitmask[prev_row], drafts[j - 1]):
                        raise DeadEnd("the grammar allows no token after the output so far")
                    # drafts[j-1] led here: forbidden at its own row, verification rejects it
                    # and samples that position from what the grammar still allows.
                    rejected_row = prev_row
                    bitmask[index].copy_(bitmask[rejected_row])
                    filled.append((j, index))
                    index += 1
                    continue
                filled.append((j, index))
                row = index
                index += 1
            if j == len(drafts):
                break
            token = drafts[j]
            if not ended:
                tail.append(token)
                ended = self.reasoning_end is not None and ends_with(tail, self.reasoning_end)
            elif row is not None:
                if matcher.accept_token(token):
                    advanced += 1
                else:
                    rejected_row = row
            prev_row = row
        if advanced:
            matcher.rollback(advanced)
        return filled


def _forbid(row: "torch.Tensor", token: int) -> bool:
    """Clear ``token``'s bit in a bitmask row; True while the row still allows a token."""
    word, bit = divmod(token, 32)
    value = int(row[word]) & ~(1 << bit) & 0xFFFFFFFF
    row[word] = value - (1 << 32) if value >= 1 << 31 else value  # int32: the sign bit is token 31
    return bool(row.any())
