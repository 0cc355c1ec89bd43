"""CompletionDelta stream -> vLLM's generate response (non-stream) or SSE chunks (stream).

Mirrors ``ServingTokens.serve_tokens_full_generator`` / ``serve_tokens_stream_generator``
of vLLM 0.32: the same fields in the same order, the same rules for which chunk is sent,
where ``prompt_token_ids`` and ``usage`` appear, and how logprobs are shaped.
"""
from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Optional, Protocol

import msgspec

from common.protocol import CompletionDelta, SpecDecodeStats
from gateway.generate_api import logprobs_format
from gateway.generate_api.protocol import (
    GenerateResponse,
    Logprobs,
    PerRequestMetrics,
    PromptTokensDetails,
    SpeculativeDecodingMetrics,
    StreamChunk,
    TextChoice,
    TokensChoice,
    Usage,
    WeightVersionSpan,
    json_encoder,
)
from gateway.generate_api.request_mapping import MappedRequest
from gateway.relay import StreamFormatter, sse_event


@dataclass(frozen=True)
class ResponseOptions:
    """Server-level switches that shape every response."""

    prompt_tokens_details: bool = False  # usage.prompt_tokens_details (--enable-prompt-tokens-details)
    routed_experts: bool = False  # --enable-return-routed-experts
    sampling_mask: bool = False  # --return-sampling-mask
    spec_decode_metrics: str = "none"  # --per-request-spec-decode-metrics: none | summary | detailed
    # --enable-per-request-metrics: the timing fields of ``metrics``.  vLLM's /generate fills
    # only ``speculative_decoding``; with the flag it gets the OpenAI routes' timing too.
    timing_metrics: bool = False
    # --return-tokens-as-token-ids: text-mode logprob tokens are "token_id:N" placeholders
    # without bytes, as vLLM's generate (_logprobs_tokenizer) writes them.
    token_id_placeholders: bool = False


def routed_experts_b64(delta: CompletionDelta) -> Optional[str]:
    """vLLM's ``numpy2base64``: base64 of the ``.npy`` bytes the worker sent."""
    return base64.b64encode(delta.routed_experts).decode("ascii") if delta.routed_experts is not None else None


def _logprobs(delta: CompletionDelta, num: Optional[int], text_mode: bool,
              placeholders: bool = False) -> Optional[Logprobs]:
    if num is None or delta.logprobs is None:
        return None
    if not text_mode:
        return Logprobs(content=logprobs_format.token_logprobs(delta.logprobs, num))
    return Logprobs(content=logprobs_format.text_logprobs(delta.logprobs, num, placeholders_only=placeholders))


def weight_version_spans(delta: CompletionDelta, num_tokens: int) -> Optional[list[WeightVersionSpan]]:
    """A finished choice's spans; ``[]`` for a choice that produced no token."""
    if delta.weight_versions is None:
        return [] if num_tokens == 0 else None
    return [WeightVersionSpan(v, s, e) for v, s, e in delta.weight_versions]


def timing_metrics(queued: Optional[float], scheduled: Optional[float], first_token: Optional[float],
                   last_token: Optional[float], num_tokens: int) -> PerRequestMetrics:
    """vLLM's ``build_per_request_timing_metrics`` (generate/base/serving.py), the OpenAI
    routes' --enable-per-request-metrics: TTFT from the first scheduling, generation time
    first to last token, tokens/s over scheduling to last token; a field whose
    timestamps are missing stays None."""
    ms = lambda a, b: (b - a) * 1e3 if a and b else None  # noqa: E731
    ttft, gen, queue = ms(scheduled, first_token), ms(first_token, last_token), ms(queued, scheduled)
    inference = ms(scheduled, last_token)
    return PerRequestMetrics(
        time_to_first_token_ms=ttft, generation_time_ms=gen, queue_time_ms=queue,
        mean_itl_ms=gen / (num_tokens - 1) if gen is not None and num_tokens > 1 else None,
        tokens_per_second=num_tokens / inference * 1e3 if inference and inference > 0 else None)


def spec_decoding_metrics(stats: SpecDecodeStats, detailed: bool) -> SpeculativeDecodingMetrics:
    """vLLM's RequestSpecDecodeMetrics.to_dict: the acceptance length counts the bonus token."""
    steps = sum(stats.histogram)
    accepted = sum(j * count for j, count in enumerate(stats.histogram))
    detail = detailed and bool(stats.per_step_accepted)
    return SpeculativeDecodingMetrics(
        mean_acceptance_length=1.0 + accepted / steps if steps else 1.0,
        draft_acceptance_rate=accepted / stats.num_draft_tokens if stats.num_draft_tokens else 0.0,
        acceptance_histogram=list(stats.histogram), num_spec_steps=steps, num_accepted_draft_tokens=accepted,
        num_draft_tokens=stats.num_draft_tokens, num_spec_tokens=stats.num_spec_tokens,
        per_step_accepted=stats.per_step_accepted if detail else None,
        per_step_drafted=stats.per_step_drafted if detail else None)


class _StreamSpecDecoding(SpeculativeDecodingMetrics, omit_defaults=True):
    pass


class _StreamMetrics(PerRequestMetrics, omit_defaults=True):
    pass


def stream_metrics(metrics: Optional[PerRequestMetrics]):
    """A usage chunk's metrics: vLLM dumps it with exclude_none, so null keys are left out."""
    if metrics is None:
        return msgspec.UNSET
    fields = msgspec.structs.asdict(metrics)
    if metrics.speculative_decoding is not None:
        fields["speculative_decoding"] = _StreamSpecDecoding(**msgspec.structs.asdict(metrics.speculative_decoding))
    return _StreamMetrics(**fields)


class _RequestFacts:
    """What the first delta of a request carries once (prompt side, passthrough params)."""

    def __init__(self, mapped: MappedRequest, spec_level: str = "none", timing: bool = False):
        self.mapped = mapped
        self.spec_level = spec_level
        self.timing = timing
        self.spec_decode: Optional[SpecDecodeStats] = None
        self.num_prompt_tokens = len(mapped.wire.prompt_token_ids)
        self.num_cached_tokens: Optional[int] = None
        self.first_delta: Optional[CompletionDelta] = None
        self.first_scheduled_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        # Echoed on the first delta; a P/D prefill leg's / an encoder worker's transfer
        # parameters come on its last.
        self.kv_transfer_params = None
        self.ec_transfer_params = None

    def observe(self, delta: CompletionDelta) -> None:
        if delta.kv_transfer_params is not None:
            self.kv_transfer_params = delta.kv_transfer_params
        if delta.ec_transfer_params is not None:
            self.ec_transfer_params = delta.ec_transfer_params
        if self.first_delta is None:
            self.first_delta = delta
            if delta.num_prompt_tokens:
                self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.first_scheduled_time and self.first_scheduled_time is None:
            self.first_scheduled_time = delta.first_scheduled_time
        if delta.first_token_time and self.first_token_time is None:
            self.first_token_time = delta.first_token_time
        if delta.spec_decode is not None:
            self.spec_decode = delta.spec_decode

    def prompt_details(self, enabled: bool, *, drop_none: bool):
        if not enabled or self.num_cached_tokens is None:
            return msgspec.UNSET if drop_none else None
        if drop_none:
            return PromptTokensDetails(self.num_cached_tokens, msgspec.UNSET, msgspec.UNSET)
        return PromptTokensDetails(self.num_cached_tokens)

    def metrics(self, num_tokens: int) -> Optional[PerRequestMetrics]:
        """vLLM's /generate: only for n == 1, ``speculative_decoding`` when the worker
        reported stats (--per-request-spec-decode-metrics), else None; the timing fields
        with --enable-per-request-metrics (the OpenAI routes' formulas)."""
        if self.mapped.wire.params.n != 1:
            return None
        metrics = None
        if self.timing and self.first_token_time is not None:
            metrics = timing_metrics(self.mapped.wire.arrival_time or None, self.first_scheduled_time,
                                     self.first_token_time, time.time(), num_tokens)
        if self.spec_level != "none" and self.spec_decode is not None:
            metrics = metrics or PerRequestMetrics()
            metrics.speculative_decoding = spec_decoding_metrics(self.spec_decode, self.spec_level == "detailed")
        return metrics


class DerenderChoices(Protocol):
    """output_mode "derender": builds a finished choice (the parsed assistant message) from
    the mode-independent choice ``fields``, the choice's text and chat-form logprobs.  The
    chat parsing lives with the OpenAI facades (gateway/openai_api/generate_derender.py's
    ``DerenderSetup``); the route hands it in, so this package imports none of them."""

    def choice(self, fields: dict, text: str, logprobs: Optional[list]) -> msgspec.Struct: ...


class ResponseAccumulator:
    """Collects every delta of a non-stream request and renders the final JSON body
    (the relay's ``BodyFormatter`` for /generate)."""

    def __init__(self, mapped: MappedRequest, options: ResponseOptions = ResponseOptions(),
                 derender: Optional[DerenderChoices] = None):
        self.mapped = mapped
        self.facts = _RequestFacts(mapped, options.spec_decode_metrics, options.timing_metrics)
        self.details = options.prompt_tokens_details
        self.options = options
        # output_mode "derender": the parsing of the choices' text (generate_derender.setup)
        if mapped.derender and derender is None:
            raise ValueError("output_mode 'derender' needs the choices' parsing (generate_derender.setup)")
        self.derender = derender if mapped.derender else None
        n = mapped.wire.params.n
        self.masks: list[Optional[list[list[int]]]] = [None] * n
        self.routed: list[Optional[str]] = [None] * n
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.logprobs: list[list] = [[] for _ in range(n)]
        self.finish: list[Optional[str]] = [None] * n
        self.stop: list = [None] * n
        self.versions: list = [None] * n

    def add(self, delta: CompletionDelta, run: int = 0) -> None:
        self.facts.observe(delta)
        i = delta.index
        if not 0 <= i < len(self.token_ids):
            raise ValueError(f"delta for choice {i} of a request with n={len(self.token_ids)}")
        self.token_ids[i].extend(delta.token_ids)
        if delta.text:
            self.texts[i].append(delta.text)
        if self.derender is not None:  # chat logprobs, as /v1/chat/completions cuts them
            self.logprobs[i].extend(logprobs_format.chat_logprobs(delta, self.mapped.wire.params.logprobs,
                                                                  self.options.token_id_placeholders) or ())
        else:
            lp = _logprobs(delta, self.mapped.wire.params.logprobs, self.mapped.text_mode,
                           self.options.token_id_placeholders)
            if lp is not None:
                self.logprobs[i].extend(lp.content)
        if delta.sampling_mask is not None and self.options.sampling_mask:
            self.masks[i] = (self.masks[i] or []) + delta.sampling_mask
        if self.options.routed_experts and delta.routed_experts is not None:
            self.routed[i] = routed_experts_b64(delta)
        if delta.finish_reason is not None:
            self.finish[i], self.stop[i] = delta.finish_reason, delta.stop_reason
            self.versions[i] = weight_version_spans(delta, len(self.token_ids[i]))

    def body(self) -> bytes:
        m, facts = self.mapped, self.facts
        choices = []
        want_lp = m.wire.params.logprobs is not None
        for i, ids in enumerate(self.token_ids):
            fields = dict(
                index=i,
                finish_reason=self.finish[i] or "stop",
                stop_reason=self.stop[i],
                token_ids=ids,
                routed_experts=self.routed[i],
                sampling_mask=self.masks[i],
                weight_versions=self.versions[i] if self.finish[i] else [],
            )
            if self.derender is not None:
                choices.append(self.derender.choice(fields, "".join(self.texts[i]),
                                                    self.logprobs[i] if want_lp else None))
                continue
            fields["logprobs"] = Logprobs(content=self.logprobs[i]) if want_lp else None
            choices.append(TextChoice(text="".join(self.texts[i]), **fields) if m.text_mode else TokensChoice(**fields))
        completion = sum(len(ids) for ids in self.token_ids)
        first = facts.first_delta
        body = GenerateResponse(
            request_id=m.wire.request_id,
            model=m.model_name,
            created=int(time.time()),
            usage=Usage(
                prompt_tokens=facts.num_prompt_tokens,
                total_tokens=facts.num_prompt_tokens + completion,
                completion_tokens=completion,
                prompt_tokens_details=facts.prompt_details(self.details, drop_none=False),
            ),
            prompt_logprobs=logprobs_format.prompt_logprobs(
                first.prompt_logprobs if first else None, m.wire.params.prompt_logprobs),
            prompt_token_id_logprobs=logprobs_format.prompt_token_id_logprobs(
                first.prompt_token_id_scores if first else None, first.prompt_token_id_shape if first else None),
            prompt_token_ids=m.wire.prompt_token_ids if m.http.return_token_ids else None,
            mm_placeholders=m.mm_placeholders if m.http.return_token_ids else None,
            metrics=facts.metrics(completion),
            kv_transfer_params=facts.kv_transfer_params,
            ec_transfer_params=facts.ec_transfer_params,
            output_mode=m.http.output_mode,
            choices=choices,
        )
        return json_encoder.encode(body)


class StreamChunker(StreamFormatter):
    """Turns each delta into at most one SSE event, vLLM's stream rules included (the
    relay's ``StreamFormatter`` for /generate)."""

    def __init__(self, mapped: MappedRequest, options: ResponseOptions = ResponseOptions()):
        self.mapped = mapped
        self.facts = _RequestFacts(mapped, options.spec_decode_metrics, options.timing_metrics)
        self.details = options.prompt_tokens_details
        self.options = options
        self.generated = [0] * mapped.wire.params.n
        self._prompt_ids_pending = bool(mapped.http.return_token_ids)

    def chunk(self, delta: CompletionDelta, run: int = 0) -> Optional[bytes]:
        m = self.mapped
        self.facts.observe(delta)
        i = delta.index
        if 0 <= i < len(self.generated):
            self.generated[i] += len(delta.token_ids)
        # A terminal chunk (abort has no tokens) is always sent so the client sees why it ended.
        if not (delta.token_ids or delta.finish_reason is not None or (m.text_mode and delta.text)):
            return None
        fields = dict(
            index=i,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            token_ids=delta.token_ids,
            # Assembled over the whole choice, on its final chunk (vLLM sends it when finished).
            routed_experts=routed_experts_b64(delta) if self.options.routed_experts else None,
            sampling_mask=delta.sampling_mask if self.options.sampling_mask else None,
            # Final chunk of the choice only, covering its whole output.
            weight_versions=(weight_version_spans(delta, self.generated[i] if 0 <= i < len(self.generated) else 0)
                             if delta.finish_reason is not None else None),
            logprobs=_logprobs(delta, m.wire.params.logprobs, m.text_mode, self.options.token_id_placeholders),
        )
        choice = TextChoice(text=delta.text or "", **fields) if m.text_mode else TokensChoice(**fields)
        usage = None
        if m.continuous_usage:
            p, c = self.facts.num_prompt_tokens, self.generated[i]
            usage = Usage(prompt_tokens=p, total_tokens=p + c, completion_tokens=c)
        chunk = StreamChunk(request_id=m.wire.request_id, usage=usage, output_mode=m.http.output_mode,
                            choices=[choice])
        if self._prompt_ids_pending:
            chunk.prompt_token_ids = m.wire.prompt_token_ids
            if m.mm_placeholders is not None:
                chunk.mm_placeholders = m.mm_placeholders
            self._prompt_ids_pending = False
        return sse_event(json_encoder.encode(chunk))

    def final(self) -> Optional[bytes]:
        """The final ``choices: []`` chunk with the total usage (include_usage only)."""
        if not self.mapped.include_usage:
            return None
        p, c = self.facts.num_prompt_tokens, sum(self.generated)
        usage = Usage(prompt_tokens=p, total_tokens=p + c, completion_tokens=c,
                      prompt_tokens_details=self.facts.prompt_details(self.details, drop_none=True),
                      completion_tokens_details=msgspec.UNSET)
        chunk = StreamChunk(request_id=self.mapped.wire.request_id, usage=usage,
                            metrics=stream_metrics(self.facts.metrics(c)),
                            output_mode=self.mapped.http.output_mode, choices=[])
        return sse_event(json_encoder.encode(chunk))
