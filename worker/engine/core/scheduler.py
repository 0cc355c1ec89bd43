"""Continuous-batching scheduler (vLLM v1 style, priority policy).

Each step hands out a token budget.  Running sequences go first (a decode is 1
token; a partly prefilled prompt gets the next chunk), then waiting sequences
are admitted in (priority, arrival) order, their prompts chunked to what budget
is left.  Prefill and decode tokens mix freely in one step.

When KV blocks run out, the running sequence with the worst (priority, arrival)
is preempted by recompute: its blocks are freed and it goes back to waiting
with its tokens kept, so its output is unchanged.  A waiting sequence of better
priority may likewise preempt a worse running one to get in.
"""
from __future__ import annotations

import heapq
import operator
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

from worker.engine.core.block_manager import BlockManager
from worker.engine.records import SeqStatus, EngineSequence
from worker.engine.step_plan import ScheduledSeq  # noqa: F401 - the scheduler's output record, re-exported


_PRIORITY_KEY = operator.attrgetter("priority_key")


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[EngineSequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class AdmissionLimit(Protocol):
    """A component's limit on which waiting sequences a step admits (LoRA: adapter slots)."""

    def begin(self, running: list[EngineSequence]) -> Any:
        """The step's state, from the running sequences."""

    def admits(self, state: Any, seq: EngineSequence) -> bool:
        """Whether ``seq`` may start this step (False: it keeps its place and waits)."""


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, token_budget: int,
                 max_model_len: int, enable_chunked_prefill: bool = True):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.token_budget = token_budget
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.limits: list[AdmissionLimit] = []  # components' admission limits (LoRA's adapter slots)
        # Drafts a decode may verify this step (speculative decoding's source, through the
        # context), each cut by the draft filters (structured outputs: no draft its grammar
        # rejects); None: no drafts, the decode loop never asks.
        self.draft_source: Optional[Callable[[EngineSequence], Sequence[int]]] = None
        self.draft_filters: list[Callable[[EngineSequence, Sequence[int]], Sequence[int]]] = []
        # Where a prompt chunk may end: ``limit(seq, start, num_new)`` -> the tokens to run
        # (0: none this step); None: anywhere (images of bidirectional-attention models
        # stay whole: multimodal/images.py ``whole_image_chunks``).
        self.chunk_limit: Optional[Callable[[EngineSequence, int, int], int]] = None
        self._waiting: list[tuple[int, int, int, EngineSequence]] = []  # heap of (priority, arrival, seq_id, seq)
        self.running: list[EngineSequence] = []
        self.num_preemptions = 0

    # --- queues ------------------------------------------------------------
    def add(self, seq: EngineSequence) -> None:
        seq.status = SeqStatus.WAITING
        heapq.heappush(self._waiting, (*seq.priority_key, seq.seq_id, seq))

    def add_running(self, seq: EngineSequence) -> None:
        """A forked choice that already holds blocks joins the running set directly."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def waiting(self) -> list[EngineSequence]:
        """The waiting sequences (in no particular order)."""
        return [entry[-1] for entry in self._waiting]

    def head_waiting(self) -> Optional[EngineSequence]:
        """The waiting sequence admitted next (None: none waits)."""
        return self._waiting[0][3] if self._waiting else None

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self.running)

    def remove(self, seq: EngineSequence) -> None:
        """Drop a sequence from whichever queue holds it (finish or abort) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            kept = [item for item in self._waiting if item[3] is not seq]
            if len(kept) != len(self._waiting):
                self._waiting = kept
                heapq.heapify(self._waiting)
        self.bm.free(seq)

    # --- scheduling ----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.token_budget
        self._preempt_for_priority()
        # Running sequences in priority order, so that preemption takes from the tail.
        self.running.sort(key=_PRIORITY_KEY)
        block_size = self.bm.block_size
        max_model_len = self.max_model_len
        scheduled = out.scheduled
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            computed = seq.num_computed_tokens
            num_tokens = len(seq.token_ids) + seq.num_pending
            num_new = min(num_tokens - computed, budget)
            if self.chunk_limit is not None and computed < seq.num_prompt_tokens:  # a prompt chunk
                num_new = self.chunk_limit(seq, computed, num_new)
            # A token in flight that is the choice's last by length (max_tokens or the context):
            # no step after it is planned (vLLM's async scheduler makes the same check).
            if num_new <= 0 or (seq.num_pending and (num_tokens - seq.num_prompt_tokens >= seq.request.max_tokens
                                                     or num_tokens >= max_model_len)):
                i += 1
                continue
            spec = ()
            if num_new == 1 and self.draft_source is not None:  # a decode with drafts: verify them too
                spec = tuple(self._drafts(seq)[:budget - 1])
                num_new += len(spec)
            elif computed + num_new <= len(seq.block_ids) * block_size:
                # Its blocks have room already (a decode inside its last block, most steps):
                # what allocate_slots would decide, without its bookkeeping.
                scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1
                continue
            while not self.bm.allocate_slots(seq, num_new):
                if spec:  # drafts are an option, never a reason to preempt: verify none
                    num_new, spec = num_new - len(spec), ()
                    continue
                victim = self.running[-1]  # worst (priority, arrival)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new, spec))
                budget -= num_new
                i += 1
            # else: seq itself was preempted; running shrank so i is now past the end.

        # Admit waiting sequences, but not in a step that had to preempt (no room).
        limits = [(limit, limit.begin(self.running)) for limit in self.limits]
        skipped = []  # waiting behind a limit (an adapter with no slot to run in) this step
        while self._waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self._waiting[0][3]
            if seq.num_pending or (limits and not all(limit.admits(state, seq) for limit, state in limits)):
                # (a preempted choice whose last token is still in flight joins once it is known)
                skipped.append(heapq.heappop(self._waiting))
                continue
            cached = self.bm.find_cached_prefix(seq)
            num_cached_tokens = len(cached) * self.bm.block_size
            num_new = seq.num_tokens - seq.num_computed_tokens - num_cached_tokens
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if self.chunk_limit is not None:
                num_new = self.chunk_limit(seq, seq.num_computed_tokens + num_cached_tokens, num_new)
                if num_new <= 0:
                    break
            if not self.bm.allocate_slots(seq, num_new, cached):
                break
            heapq.heappop(self._waiting)
            if seq.num_preemptions == 0:
                self.bm.record_lookup(seq.num_tokens, num_cached_tokens)
                seq.num_cached_tokens = num_cached_tokens
                req = seq.request
                if req.first_scheduled_time is None:
                    req.first_scheduled_time = time.time()
                    req.num_cached_tokens = num_cached_tokens
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        for item in skipped:
            heapq.heappush(self._waiting, item)
        return out

    def _drafts(self, seq: EngineSequence) -> Sequence[int]:
        drafts = self.draft_source(seq)
        for keep in self.draft_filters:
            if not drafts:
                break
            drafts = keep(seq, drafts)
        return drafts

    def preempt_all(self) -> None:
        """Every running sequence back to the waiting queue, its blocks freed: it is
        recomputed from its tokens when next scheduled (RL weight changes and sleep: K/V
        computed before must not be used again, or the cache is being released)."""
        for seq in list(self.running):
            self._preempt(seq)

    def _preempt(self, seq: EngineSequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def _preempt_for_priority(self) -> None:
        """Priority policy: while the best waiting sequence outranks the worst running
        one and cannot get in (no seat or no blocks), preempt that running one."""
        while self._waiting and self.running:
            head = self._waiting[0][3]
            victim = max(self.running, key=lambda s: s.priority_key)
            if victim.priority_key <= head.priority_key or self._fits(head):
                return
            self._preempt(victim)

    def _fits(self, seq: EngineSequence) -> bool:
        """Whether ``seq``'s next chunk fits next to the running sequences' next step."""
        if len(self.running) >= self.max_num_seqs:
            return False
        bm = self.bm
        growth = sum(max(bm.blocks_needed(s.num_tokens) - len(s.block_ids), 0) for s in self.running)
        cached = bm.find_cached_prefix(seq)
        num_new = min(seq.num_tokens - seq.num_computed_tokens - len(cached) * bm.block_size,
                      self.token_budget)
        return bm.num_blocks_to_take(seq, num_new, cached) + growth <= bm.num_free_blocks

    def update_after_step(self, scheduled: list[ScheduledSeq]) -> None:
        """Advance computed-token counts and publish newly full blocks to the prefix cache
        (drafts are not counted: ``accept_draft`` adds each accepted one)."""
        bm = self.bm
        if not bm.enable_prefix_caching:
            for s in scheduled:
                s.seq.num_computed_tokens += s.num_new_tokens - len(s.spec)
            return
        bs = bm.block_size
        for s in scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens - len(s.spec)
            # Only a step that completed a block has anything to hash or publish.
            if (seq.num_computed_tokens // bs > seq.num_registered_blocks
                    or len(seq.token_ids) // bs > len(seq.block_hashes)):
                bm.register_computed_blocks(seq)

    def accept_draft(self, seq: EngineSequence) -> None:
        """The next verified draft joined the sequence's tokens: its KV is valid."""
        seq.num_computed_tokens += 1
        self.bm.register_computed_blocks(seq)
