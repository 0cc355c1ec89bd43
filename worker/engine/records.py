"""The engine's shared records: a request, its choices (sequences), and what one step
produced for one choice.

A leaf (it imports nothing of the engine): the core, the components, speculative
decoding and the disaggregation legs all read these records, and none of them need
import the core for it (tests/unit/common/test_import_layers.py).

A ``Request`` is what the client sent (one prompt, n choices).  Each choice is a
``EngineSequence``: the unit the scheduler and block manager work on.  Choice 0 exists
from the start; choices 1..n-1 are forked from it once the prompt is prefilled,
sharing its full prompt blocks, so the prompt is computed once.

A sequence's progress is two numbers, vLLM v1 style: ``num_tokens`` (prompt +
output so far) and ``num_computed_tokens`` (how many of them have K/V in the
cache).  A prefill chunk, a decode step and a recompute after preemption are all
"compute the tokens in between".
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from common.protocol import GenerateRequest, SamplingParams, TokenLogprobs

_seq_counter = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class FinishReason:
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class Request:
    """One client request: prompt, parameters, and its n choices."""

    def __init__(self, req: GenerateRequest, *, arrival_seq: int, max_tokens: int, eos_token_ids: list[int],
                 now: float):
        self.request_id = req.request_id
        self.req = req
        self.params: SamplingParams = req.params
        self.priority = req.priority
        self.arrival_seq = arrival_seq  # tie-breaker inside a priority level (FCFS)
        self.arrival_time = req.arrival_time or now
        self.cache_salt = req.cache_salt
        self.lora_key: Optional[str] = None  # the adapter registration it runs with (lora/manager.py)
        self.prompt_token_ids = req.prompt_token_ids
        self.mm: Any = None  # MultiModalState (multimodal/images.py) of a request with images
        self.num_prompt_tokens = len(req.prompt_token_ids)
        self.n = req.params.n
        self.max_tokens = max_tokens
        self.min_tokens = req.params.min_tokens  # (read by every stop check)
        self.primary_eos = eos_token_ids[0] if eos_token_ids and not req.params.ignore_eos else None
        # vLLM: extra generation_config eos ids behave like stop_token_ids (stop_reason = id).
        stop_ids = set(req.params.stop_token_ids or ())
        if not req.params.ignore_eos:
            stop_ids.update(eos_token_ids[1:])
        stop_ids.discard(self.primary_eos)  # type: ignore[arg-type]
        self.stop_token_ids = frozenset(stop_ids)
        # Prompt logprobs need logits of every prompt position, so cached prefixes can't be used.
        self.wants_prompt_scores = (req.params.prompt_logprobs is not None
                                    or bool(req.params.prompt_logprob_token_ids))
        # Accumulated over prefill chunks.  Asked for, it starts empty, as vLLM's starts at
        # [None]: a one-token prompt (no position to score) still answers [null].
        self.prompt_logprobs: Optional[TokenLogprobs] = (
            TokenLogprobs(token_ids=[], logprobs=[], ranks=[], top_ids=[], top_logprobs=[])
            if req.params.prompt_logprobs is not None else None)
        self.prompt_token_id_rows: list[Any] = []  # float32 numpy row blocks, in prompt order
        self.num_prompt_scored = 0  # prompt positions whose logits were scored already
        self.bad_words_ids: Optional[list[list[int]]] = None
        self.sequences: list[EngineSequence] = []
        self.forked = self.n == 1
        self.first_delta_sent = False
        self.first_scheduled_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        self.num_cached_tokens = 0

    def is_finished(self) -> bool:
        return self.forked and all(s.status is SeqStatus.FINISHED for s in self.sequences)


class EngineSequence:
    """One choice of a request: its tokens, KV blocks and streaming state."""

    def __init__(self, request: Request, index: int, token_ids: list[int]):
        self.seq_id = next(_seq_counter)
        self.request = request
        self.index = index
        self.token_ids = token_ids  # prompt + output
        self.output_ids: list[int] = []  # output only (live list read by the sampler)
        self.num_cached_tokens = 0
        self.sampling_row: Any = None  # SamplingRow, built by the engine
        self.num_prompt_tokens = request.num_prompt_tokens
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained sha256 hashes of the full blocks of token_ids
        self.num_registered_blocks = 0  # leading full blocks published in the prefix cache
        self.status = SeqStatus.WAITING
        self.finish_reason: Optional[str] = None
        self.stop_reason: Union[int, str, None] = None
        self.num_preemptions = 0
        self.generator: Optional[torch.Generator] = None
        self.detokenizer: Any = None
        self.pending_logprobs: Optional[TokenLogprobs] = None  # logprobs the next delta carries
        # Async scheduling: tokens sampled by steps still in flight, not appended yet.  The
        # scheduler counts them (the next step computes their K/V, its input id filled on
        # the device from the step that samples it); stop checks see only known tokens.
        self.num_pending = 0
        # (priority, arrival): the scheduler's order, sorted by every step (a request's
        # priority and arrival never change, so it is kept, not recomputed).
        self.priority_key: tuple[int, int] = (request.priority, request.arrival_seq)

    # --- sizes -----------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Prompt + output, counting the tokens still in flight (what the scheduler plans with)."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_ids.append(token_id)

    # --- stopping --------------------------------------------------------
    def check_token_stop(self, max_model_len: int) -> bool:
        """Apply the token-level stop rules (vLLM v1 check_stop) after a token was appended."""
        req = self.request
        tokens = self.token_ids
        n_out = len(tokens) - self.num_prompt_tokens
        if n_out >= req.min_tokens:
            last = tokens[-1]
            if last == req.primary_eos:
                return self.finish(FinishReason.STOP)
            if req.stop_token_ids and last in req.stop_token_ids:
                return self.finish(FinishReason.STOP, last)
        if n_out >= req.max_tokens or len(tokens) >= max_model_len:
            return self.finish(FinishReason.LENGTH)
        return False

    def finish(self, reason: str, stop_reason: Union[int, str, None] = None) -> bool:
        self.status = SeqStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        return True

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (f"EngineSequence({self.request.request_id}#{self.index}, tokens={len(self.token_ids)}+{self.num_pending}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)}, {self.status.name})")


@dataclass
class SequenceOutput:
    """What one engine-core step produced for one choice, before any wire format: the
    core hands these out, ``Engine`` (engine.py) packs them into the wire's
    CompletionDelta (wire_output.py).  The sequence carries the rest an output reports:
    finish/stop reason and the logprobs gathered since the last output
    (``pending_logprobs``)."""

    request: Request
    index: int  # choice index
    seq: Optional[EngineSequence]  # None: a choice of an aborted request that was never forked
    new_token_ids: list[int] = field(default_factory=list)
    text: Optional[str] = None  # newly released text (text mode / stop strings)
