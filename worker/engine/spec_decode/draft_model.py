"""Draft-model proposer: a smaller model of the same vocabulary, in the same worker,
drafts k tokens greedily for each running decode.

Its KV cache is its own tensor indexed by the target's block ids, so blocks are
allocated, preempted and freed with the target's.  The draft runs only for choices
that draft this step: it first catches up on the positions the target computed
since it last ran for that choice (the whole context the first time, and after a
preemption, since cached blocks may hold target KV it never computed), whose last
row gives the first draft; k - 1 one-token steps give the rest, written into the
slots the scheduler reserved for the drafts.  Choices that do not draft (prefills,
backed-off ones) cost the draft nothing.  Greedy drafts are point masses, so the
shared verification (speculator.py) keeps outputs exact whatever the draft says.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from worker.engine.models.config import ModelConfig
from worker.engine.models.kv_layout import kv_cache_layout
from worker.engine.records import EngineSequence
from worker.engine.step_plan import ScheduledSeq
from worker.engine.spec_decode.config import SpeculativeConfig
from worker.engine.spec_decode.speculator import Speculator

log = logging.getLogger("tokserve.engine")


class _DraftView:
    """A sequence as one draft forward sees it (the runner reads only these)."""

    __slots__ = ("token_ids", "num_computed_tokens", "block_ids", "request")

    def __init__(self, seq: EngineSequence, token_ids, num_computed_tokens: int):
        self.token_ids = token_ids
        self.num_computed_tokens = num_computed_tokens
        self.block_ids = seq.block_ids
        self.request = seq.request


class _WithDrafts:
    """A sequence's tokens followed by its drafts so far, without copying the context:
    a one-token draft step reads only the position it computes."""

    __slots__ = ("base", "drafts")

    def __init__(self, base: list[int], drafts: list[int]):
        self.base, self.drafts = base, drafts

    def __getitem__(self, i: int) -> int:
        n = len(self.base)
        return self.base[i] if i < n else self.drafts[i - n]

    def __len__(self) -> int:
        return len(self.base) + len(self.drafts)


class DraftModelSpeculator(Speculator):
    def __init__(self, config: SpeculativeConfig, engine_config, target_mc: ModelConfig, device: torch.device,
                 max_model_len: int, max_step_tokens=None):
        from worker.engine.runner.model_runner import ModelRunner
        from worker.engine.loading.model_setup import build_model

        super().__init__(config, max_step_tokens)
        path = Path(config.model)
        if not (path / "config.json").is_file():
            raise ValueError(f"--speculative-config: draft model {config.model!r} is not a model folder "
                             f"(no config.json)")
        mc = ModelConfig.from_dir(path)
        if mc.vocab_size != target_mc.vocab_size:
            raise ValueError("Target and draft model should have the same vocabulary size. Target model vocab_size="
                             f"{target_mc.vocab_size}. Draft model vocab_size={mc.vocab_size}. Using models with "
                             "different tokenizers can cause out-of-bounds errors during speculative decoding.")
        draft_config = dataclasses.replace(engine_config, model=str(path), speculative_config=None,
                                           enable_lora=False, lora_modules=None, enable_return_routed_experts=False,
                                           enforce_eager=True)
        model, backend, _ = build_model(draft_config, mc, device)
        self.model_config = mc
        self.max_positions = mc.max_position_embeddings  # it drafts only within its own context
        self.runner = ModelRunner(draft_config, mc, model, max_model_len, backend)
        self.token_budget = engine_config.step_token_budget(max_model_len)
        self.bytes_per_block = kv_cache_layout(mc).bytes_per_block(engine_config.block_size, engine_config.torch_dtype)
        log.info("draft model %s (%s) proposes %d tokens per step", path, mc.architecture, self.k)

    def allocate(self, num_blocks: int, max_model_len: int) -> None:
        """Its KV cache, as many blocks as the target's."""
        self.runner.set_max_model_len(max_model_len)
        self.runner.allocate_kv_cache(num_blocks)

    def release_cache(self) -> None:
        self.runner.release_kv_cache()

    def propose(self, running, max_model_len: int) -> None:
        super().propose(running, min(max_model_len, self.max_positions))

    def draft_tokens(self, seq: EngineSequence, k: int) -> list[int]:
        return [0] * k  # slots to schedule; fill() writes the tokens

    @torch.inference_mode()
    def fill(self, scheduled: list[ScheduledSeq]) -> None:
        views, decodes, row, last_rows = [], [], 0, []
        budget = self.token_budget  # the catch-up forward is chunked like a prefill
        for s in scheduled:
            seq = s.seq
            st = self.state(seq)
            if not s.spec:  # the target moves on without the draft
                st.draft_lag += s.num_new_tokens
                continue
            if st.draft_synced != seq.num_preemptions:  # first draft, or recomputed since
                st.draft_lag, st.draft_synced = seq.num_computed_tokens, seq.num_preemptions
            lag = min(st.draft_lag, seq.num_computed_tokens)
            n = 1 + lag  # the positions it lacks, then the choice's last token
            start = seq.num_computed_tokens - lag
            if n > budget:  # catch up part of the way; this step verifies no drafts for it
                if budget > 0:
                    views.append(ScheduledSeq(_DraftView(seq, seq.token_ids, start), budget))
                    st.draft_lag = lag - budget
                    row += budget
                    budget = 0
                else:
                    st.draft_lag = lag
                st.draft_lag += 1  # the target computes its last token without the draft
                s.num_new_tokens -= len(s.spec)
                s.spec = ()
                continue
            views.append(ScheduledSeq(_DraftView(seq, seq.token_ids, start), n))
            st.draft_lag = 0
            budget -= n
            row += n
            decodes.append(s)
            last_rows.append(row - 1)
        if not views:
            return
        hidden = self.runner.forward(views)
        if not decodes:
            return
        drafts = [[t] for t in self._greedy(hidden, last_rows)]
        for j in range(1, max(len(s.spec) for s in decodes)):
            active = [i for i, s in enumerate(decodes) if len(s.spec) > j]
            views = [ScheduledSeq(_DraftView(decodes[i].seq, _WithDrafts(decodes[i].seq.token_ids, drafts[i]),
                                             decodes[i].seq.num_computed_tokens + j), 1) for i in active]
            hidden = self.runner.forward(views)
            for i, t in zip(active, self._greedy(hidden, list(range(len(active))))):
                drafts[i].append(t)
        for s, d in zip(decodes, drafts):
            s.spec = tuple(d[:len(s.spec)])

    def _greedy(self, hidden: torch.Tensor, rows: list[int]) -> list[int]:
        return self.runner.compute_logits(hidden, rows).argmax(dim=-1).tolist()

    def record(self, seq: EngineSequence, num_drafts: int, num_accepted: int) -> None:
        super().record(seq, num_drafts, num_accepted)
        st = self.state(seq)
        if num_accepted == num_drafts:  # its last draft is in the output but not in the draft's KV
            st.draft_lag += 1
