"""Structured outputs (JSON schema, regex, choice, EBNF grammar, JSON object, structural
tag) with xgrammar, as an engine component -- vLLM's StructuredOutputManager.

- ``check``: the spec is re-validated (direct ZeroMQ clients skip the gateway): exactly
  one constraint, bounded sizes (structured_output/spec.py).
- ``admit``: a cached grammar -> the request runs at once; else the spec goes to the
  compile pool (structured_output/grammar_cache.py) and the request's ``grammar`` gate
  closes -- other requests keep decoding -- until ``tick`` sees it compiled and opens
  the gate, or fails the request with a 400 carrying the compiler's reason (or its
  timeout).  A request that also pulls KV blocks or encodings starts when the last of
  its gates opens, so no token is ever sampled before its grammar is ready.
- ``process_logits``: right before the sampler, each constrained sequence's matcher
  (one per choice, created on its first sampling row) catches up with its output,
  fills a bitmask row per sampling row -- for a sequence verifying drafts one row per
  draft position, advancing through the drafts and rolling back -- and the mask turns
  the disallowed logits to -inf.  Drafts the grammar rejects are cut as the scheduler takes them
  (``keep_drafts``, a draft filter registered through the context).  The sampler's logprobs are computed from these
  logits, as vLLM's (its raw logprobs come after the grammar bitmask too), and the
  sampling mask (--return-sampling-mask) includes the grammar.
- A grammar that reaches its end allows only the stop tokens, so the choice ends with
  finish_reason "stop" on the ordinary stop check.  One that admits nothing at all
  (``root ::= root``) is refused when it compiles (backend_xgrammar.py); one that reaches a
  state allowing no token fails the request with a 400 at the end of that step, nothing
  sampled from that state sent (``fill_deltas``).
- ``on_finished`` / ``forget``: the matcher and the request's grammar are dropped
  (finish, abort, failure).  Preemption keeps the matcher: recompute keeps the
  tokens the matcher accepted.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from common.errors import BadRequest
from worker.engine.component import EngineComponent
from common.structured_outputs_config import StructuredOutputsConfig
from worker.engine.config import structured_outputs_config
from worker.engine.structured_output.bitmask import BitmaskBuffer
from worker.engine.structured_output.reasoning import prompt_ended_reasoning
from worker.engine.structured_output.sequence_matcher import DeadEnd, SequenceMatcher
from worker.engine.structured_output.spec import PARAM, GrammarKey, grammar_key

log = logging.getLogger(__name__)

GATE = "grammar"  # a request's readiness gate: its grammar compiled
DEFAULT_COMPILE_TIMEOUT_S = 60.0  # past it the request fails (400); the compile thread finishes on its own


@dataclass
class _RequestGrammar:
    request: Any  # Request
    key: GrammarKey
    stop_token_ids: Optional[list[int]]
    compiled: Any = None  # xgr.CompiledGrammar once ready
    future: Optional[concurrent.futures.Future] = None
    deadline: float = 0.0
    error: Optional[str] = None  # a failure seen inside a step: the next tick fails the request
    status: int = 400
    sequences: set = field(default_factory=set)  # seq ids with a matcher


class StructuredOutputComponent(EngineComponent):
    name = "structured_output"

    def __init__(self, ctx, config: StructuredOutputsConfig, compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 compile_workers: int = 2):
        self.ctx = ctx  # EngineContext: running sequences, gates, tokenizer, failures
        ctx.add_draft_filter(self.keep_drafts)  # speculative decoding's drafts, cut by the grammar
        self.config = config
        self.vocab_size = ctx.model_config.vocab_size  # the model's logits width (padded vocabulary)
        self.compile_timeout_s = compile_timeout_s
        # Two: one slow (or pathological) spec does not stall every other request's compile.
        self.compile_workers = compile_workers
        self.backend = None  # XgrammarBackend, with the cache
        self._cache = None  # GrammarCache, built with the backend on the first structured request
        self.grammars: dict[str, _RequestGrammar] = {}  # request id -> its grammar
        self.pending: dict[str, _RequestGrammar] = {}  # request id -> compiling
        self.matchers: dict[int, SequenceMatcher] = {}  # seq id -> matcher
        self._failed: list[_RequestGrammar] = []  # failures seen inside a step: failed by the next tick
        self._dead: dict[str, tuple] = {}  # request id -> (request, message): no token allowed this step
        self._buffer = BitmaskBuffer(self.vocab_size, ctx.device)

    # --- the compile side ---------------------------------------------------------------
    @property
    def cache(self):
        if self._cache is None:
            from worker.engine.structured_output.backend_xgrammar import XgrammarBackend
            from worker.engine.structured_output.grammar_cache import GrammarCache

            mc = self.ctx.model_config
            backend = XgrammarBackend(self.ctx.tokenizer, self.vocab_size, list(mc.eos_token_ids))
            self._cache = GrammarCache(backend.compile, workers=self.compile_workers)
            self.backend = backend
        return self._cache

    def _key(self, req) -> GrammarKey:
        return grammar_key(req.params.structured_outputs, self.vocab_size,
                           disable_any_whitespace=self.config.disable_any_whitespace)

    def check(self, req, mm) -> None:
        if req.params.structured_outputs is None:
            return
        if self.ctx.tokenizer is None:
            raise BadRequest(f"{PARAM} needs the model's tokenizer; this worker serves tokens only", PARAM)
        self._key(req)

    def admit(self, request, seq) -> None:
        so = request.params.structured_outputs
        if so is None:
            return
        stop_ids = set(request.stop_token_ids)
        if request.primary_eos is not None:
            stop_ids.add(request.primary_eos)
        entry = _RequestGrammar(request, self._key(request.req), sorted(stop_ids) or None)
        compiled = self.cache.get(entry.key)
        self.grammars[request.request_id] = entry
        if compiled is not None:
            entry.compiled = compiled
            return
        entry.future = self.cache.submit(entry.key)  # Overloaded when too many compile: the admission is undone
        entry.deadline = time.monotonic() + self.compile_timeout_s
        self.pending[request.request_id] = entry
        self.ctx.close_gate(request, GATE)  # its first step waits for the grammar (opened by tick)

    def tick(self) -> None:
        if self.pending:
            now = time.monotonic()
            for rid, entry in list(self.pending.items()):
                if entry.future.done():
                    del self.pending[rid]
                    self._compiled(entry)
                elif now > entry.deadline:
                    del self.pending[rid]
                    self._fail(entry, f"{PARAM}: compiling the grammar took longer than "
                                      f"{self.compile_timeout_s:g} s")
        while self._failed:
            entry = self._failed.pop()
            if self.grammars.get(entry.request.request_id) is entry:  # not aborted meanwhile
                self._fail(entry, entry.error, entry.status)

    def _compiled(self, entry: _RequestGrammar) -> None:
        future = entry.future
        exc = future.exception() if not future.cancelled() else RuntimeError("cancelled")
        if exc is not None:
            self._fail(entry, f"{PARAM}: the {entry.key.kind} constraint does not compile: {exc}")
            return
        entry.compiled = future.result()
        self.ctx.open_gate(entry.request, GATE)

    def _fail(self, entry: _RequestGrammar, message: str, status: int = 400) -> None:
        """The grammar never compiles (or failed inside a step): the request fails, its
        choices aborted whether it ran already or still waits at its gates."""
        log.info("request %s: %s", entry.request.request_id, message)
        self.ctx.fail_request(entry.request, status, message, PARAM)

    def wait_idle(self) -> bool:
        """Only compiles in flight: wait for one a little instead of spinning."""
        if not self.pending:
            return False
        concurrent.futures.wait([e.future for e in self.pending.values()], timeout=0.02,
                                return_when=concurrent.futures.FIRST_COMPLETED)
        return True

    # --- the step -------------------------------------------------------------------------
    def keep_drafts(self, seq, drafts):
        """The scheduler's draft filter: a constrained choice's drafts cut at the first one
        its grammar rejects, as vLLM's scheduler does, so no verify row is spent on a
        draft that cannot be kept."""
        m = self.matchers.get(seq.seq_id)
        if m is not None and m.reasoning_ended and not m.failed:
            m.catch_up(seq.token_ids, seq.num_prompt_tokens)
            keep = m.valid_prefix(drafts)
            if keep < len(drafts):
                return drafts[:keep]
        return drafts

    def _matcher(self, seq) -> Optional[SequenceMatcher]:
        m = self.matchers.get(seq.seq_id)
        if m is not None:
            return m
        entry = self.grammars.get(seq.request.request_id)
        if entry is None or entry.error is not None:
            return None
        # (compiled: the grammar gate kept the request from running before)
        so = seq.request.params.structured_outputs
        ended = (self.config.enable_in_reasoning
                 or prompt_ended_reasoning(seq.request.prompt_token_ids, so.reasoning_start, so.reasoning_end))
        from worker.engine.structured_output.backend_xgrammar import XgrammarBackend

        m = SequenceMatcher(XgrammarBackend.matcher(entry.compiled, entry.stop_token_ids),
                            None if self.config.enable_in_reasoning else so.reasoning_end, ended)
        self.matchers[seq.seq_id] = m
        entry.sequences.add(seq.seq_id)
        return m

    def needs_outputs_first(self, seqs) -> bool:
        # A step is planned before the token in flight is known; its bitmask needs the
        # matcher advanced by that token, so the grammar masks wait for the previous
        # step's outputs (accepted in on_sampled) while the forward runs -- as vLLM
        # computes the bitmask while the step runs.
        grammars = self.grammars
        return bool(grammars) and any(seq.request.request_id in grammars for seq in seqs)

    def process_logits(self, seqs, specs, logits: torch.Tensor) -> None:
        if not self.grammars:
            return
        bitmask = None
        logit_rows: list[int] = []
        index = row = 0
        for seq, drafts in zip(seqs, specs):
            m = self._matcher(seq) if seq.request.request_id in self.grammars else None
            if m is not None:
                if bitmask is None:  # room for every row of the step: filled ones are a prefix
                    bitmask = self._buffer.rows(len(seqs) + sum(len(d) for d in specs))
                try:
                    m.catch_up(seq.token_ids, seq.num_prompt_tokens)
                    context: Any = ()
                    if drafts and not m.reasoning_ended and len(m.reasoning_end) > 1:
                        context = seq.token_ids[-(len(m.reasoning_end) - 1):]  # a marker may close across drafts
                    filled = m.fill_rows(bitmask, index, drafts, context) if m.constrains or drafts else []
                except DeadEnd as exc:
                    # Its row stays unmasked (finite, so the batch samples sanely) and what it
                    # samples is dropped with the request at the end of the step (fill_deltas).
                    m.failed = True
                    self._dead[seq.request.request_id] = (seq.request, f"{PARAM}: {exc}")
                    filled = []
                except Exception:  # noqa: BLE001 - one request's grammar must not fail the whole step
                    log.exception("structured outputs: request %s failed in the grammar", seq.request.request_id)
                    m.failed = True
                    entry = self.grammars[seq.request.request_id]
                    entry.error, entry.status = "structured outputs failed on this worker", 500
                    self._failed.append(entry)
                    filled = []
                logit_rows += [row + j for j, _ in filled]
                index += len(filled)
            row += 1 + len(drafts)
        if index:
            self._buffer.apply_(logits, index, logit_rows)

    # --- the end of a choice / request ----------------------------------------------------
    def on_finished(self, seq) -> None:
        self.matchers.pop(seq.seq_id, None)

    def forget(self, request) -> None:
        entry = self.grammars.pop(request.request_id, None)
        self.pending.pop(request.request_id, None)
        if entry is not None:
            for seq_id in entry.sequences:  # a choice never finished (a failed request)
                self.matchers.pop(seq_id, None)

    def fill_deltas(self, outs, deltas) -> None:
        """A request whose grammar reached a dead end this step: the token sampled from that
        row is no output (its delta is emptied, a finish included) and the request fails
        with a 400 -- vLLM ends it with finish_reason "error" (a 500) once its grammar
        rejects that token."""
        if not self._dead:
            return
        dead, self._dead = self._dead, {}
        for delta in deltas:
            if delta.request_id in dead:
                delta.token_ids, delta.text, delta.logprobs, delta.sampling_mask = [], None, None, None
                delta.finish_reason = delta.stop_reason = None
        for request, message in dead.values():
            self.ctx.fail_request(request, 400, message, PARAM)

    def fill_load(self, load) -> None:
        load.grammar_matchers = len(self.matchers)
        load.grammars_compiling = len(self.pending)

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()

    @property
    def num_matchers(self) -> int:
        return len(self.matchers)


def maybe_create(config, ctx) -> StructuredOutputComponent:
    """Always on (as vLLM): its hooks return at once while no request has a grammar."""
    return StructuredOutputComponent(ctx, structured_outputs_config(config.structured_outputs_config))
