"""Speculative decoding as an engine component.

The proposer (n-gram or draft model: speculator.py, draft_model.py) keeps its
interface; this component calls it at the step's hook points -- drafts proposed before
scheduling, draft slots filled once the batch is known -- and owns each request's
acceptance counts, which the request's final delta reports (``spec_decode``).
The core appends what each choice's rows verified (sample/verify.py); this component
counts, from the same rows, how many of the drafts it proposed were accepted."""
from __future__ import annotations

from typing import Any

from worker.engine.component import EngineComponent
from worker.engine.sample import verify


class SpecDecodeComponent(EngineComponent):
    name = "spec_decode"

    def __init__(self, speculator, ctx):
        self.speculator = speculator
        self.ctx = ctx  # EngineContext: running sequences, max_model_len, block_manager
        ctx.set_draft_source(speculator.drafts)  # the proposer is the scheduler's DraftSource
        self.stats: dict[str, Any] = {}  # request id -> SpecDecodeStats
        self._closing: dict[str, Any] = {}  # forgotten since the last step: reported by its last delta
        self._verifying: dict[int, tuple] = {}  # seq id -> the drafts it verifies in this step

    def on_kv_cache_released(self) -> None:
        self.speculator.release_cache()

    def on_kv_cache_allocated(self) -> None:
        self.speculator.allocate(self.ctx.block_manager.num_blocks, self.ctx.max_model_len)

    def admit(self, request, seq) -> None:
        self.stats[request.request_id] = self.speculator.new_stats()

    def tick(self) -> None:
        self._closing.clear()  # the last step's deltas are packed

    def before_schedule(self) -> None:
        self.speculator.propose(self.ctx.running(), self.ctx.max_model_len)

    def on_scheduled(self, scheduled) -> None:
        self.speculator.fill(scheduled)
        # the drafts each choice verifies this step (the scheduler may have cut them)
        self._verifying = {s.seq.seq_id: s.spec for s in scheduled if s.spec}

    def on_sampled(self, outs, first_rows, result) -> None:
        if not self._verifying:
            return
        for out, r in zip(outs, first_rows):
            drafts = self._verifying.get(out.seq.seq_id)
            if drafts:
                self.record(out.seq, len(drafts), verify.accepted_prefix(result.sampled, r, drafts))
        self._verifying = {}

    def on_finished(self, seq) -> None:
        self.speculator.forget(seq)

    def record(self, seq, num_drafts: int, num_accepted: int) -> None:
        """One verify step of ``seq`` (vLLM's RequestSpecDecodeMetrics.observe)."""
        self.speculator.record(seq, num_drafts, num_accepted)
        stats = self.stats.get(seq.request.request_id)
        if stats is not None:
            stats.histogram[num_accepted] += 1
            stats.num_draft_tokens += num_drafts
            stats.per_step_accepted.append(num_accepted)
            stats.per_step_drafted.append(num_drafts)

    def forget(self, request) -> None:
        stats = self.stats.pop(request.request_id, None)
        if stats is not None:
            self._closing[request.request_id] = stats

    def fill_deltas(self, outs, deltas) -> None:
        if self._closing:  # reported once, by a finished request
            for out, delta in zip(outs, deltas):
                self._fill_delta(out, delta)

    def _fill_delta(self, out, delta) -> None:
        request = out.request
        if request.is_finished():  # once per request, whichever choice finishes it
            stats = self._closing.pop(request.request_id, None)
            if stats is not None:
                delta.spec_decode = stats


def install(config, ctx, runner):
    """The proposer (--speculative-config): n-gram, or a draft model whose KV cache is
    sized with the target's (its share per block is the runner's extra bytes); None
    when speculative decoding is off."""
    from worker.engine.spec_decode.config import SpeculativeConfig

    spec = SpeculativeConfig.parse(config.speculative_config)
    if spec is None:
        return None
    cap = config.spec_step_token_cap(ctx.device)
    if spec.method == "ngram":
        from worker.engine.spec_decode.speculator import NgramSpeculator

        return NgramSpeculator(spec, cap)
    from worker.engine.spec_decode.draft_model import DraftModelSpeculator

    draft = DraftModelSpeculator(spec, config, ctx.model_config, ctx.device, runner.max_model_len, cap)
    runner.extra_bytes_per_block = draft.bytes_per_block  # the KV cache is sized for both
    return draft


def maybe_create(config, ctx, speculator) -> "SpecDecodeComponent | None":
    return SpecDecodeComponent(speculator, ctx) if speculator is not None else None
