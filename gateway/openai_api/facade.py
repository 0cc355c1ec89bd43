"""The OpenAI facade's middle step: a rendered ``GenerateRequest`` (typed, as the renderer
built it: no JSON round trip) mapped and checked as ``/inference/v1/generate`` maps one
(model check, validation), with the workers
detokenizing (text mode: stop strings are cut there, as vLLM's engine does for its
OpenAI server).  Dispatch, disconnect aborts, metrics and the SSE relay are
gateway/relay.py's; the chat / completion formatters (chat_facade, completion_facade)
turn the deltas into OpenAI objects, shaped by a ``ResponseView``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from common.validation import validate_request
from gateway.generate_api.protocol import HttpGenerateRequest, PerRequestMetrics
from gateway.generate_api.request_mapping import MappedRequest, check_encodable, cluster_for, map_request
from gateway.generate_api.response_builder import spec_decoding_metrics, timing_metrics
from gateway.relay import Generation
from gateway.state import GatewayState


async def map_rendered(state: GatewayState, req, http: HttpGenerateRequest, arrival: float) -> MappedRequest:
    """A rendered GenerateRequest (render.py's ``RenderedPrompt.request``) -> the wire
    request, checked as /generate checks one.  Its max_tokens was decided by the renderer
    (sampling.max_tokens_for) and travels as sent."""
    s = state.settings
    cluster = await cluster_for(state, http.model)
    policy = state.structured_outputs
    mapped = map_request(http, req.headers, cluster, cluster.model, served_model_names=s.served_model_names,
                         arrival_time=arrival, structured_outputs=policy)
    mapped.wire.request_id = http.request_id
    mapped.wire.output_text = True
    validate_request(mapped.wire, cluster.model, tokens_only=False, stream=mapped.stream)
    if policy is not None:
        await policy.check(mapped.wire.params.structured_outputs, state.render_pool)
    check_encodable(mapped.wire)
    return mapped


@dataclass(frozen=True)
class ResponseView:
    """What of the OpenAI request shapes its response."""

    n: int = 1
    top_logprobs: Optional[int] = None  # None: no logprobs; -1: all
    echo: bool = False
    return_token_ids: bool = False
    tokens_as_token_ids: bool = False  # return_tokens_as_token_ids: logprob tokens are "token_id:N"
    return_prompt_text: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    # Server switches (vLLM's): routed_experts on non-stream choices, per-request timing
    # metrics, metrics.speculative_decoding.
    routed_experts: bool = False
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details
    timing_metrics: bool = False
    spec_decode_metrics: str = "none"

    @classmethod
    def of(cls, request, top_logprobs: Optional[int], settings=None) -> "ResponseView":
        opts = request.stream_options if request.stream else None
        include = bool(opts and opts.include_usage)
        server = {} if settings is None else dict(
            routed_experts=settings.enable_return_routed_experts,
            prompt_tokens_details=settings.enable_prompt_tokens_details,
            timing_metrics=settings.enable_per_request_metrics,
            spec_decode_metrics=settings.per_request_spec_decode_metrics)
        return cls(n=request.n or 1, top_logprobs=top_logprobs, echo=bool(request.echo),
                   return_token_ids=bool(request.return_token_ids),
                   tokens_as_token_ids=bool(request.return_tokens_as_token_ids
                                            if request.return_tokens_as_token_ids is not None
                                            else settings is not None and settings.return_tokens_as_token_ids),
                   return_prompt_text=bool(getattr(request, "return_prompt_text", False)),
                   include_usage=include, continuous_usage=include and bool(opts.continuous_usage_stats), **server)


def request_metrics(runs: list[Generation], view: ResponseView, num_tokens: int) -> Optional[PerRequestMetrics]:
    """vLLM's per-request metrics of a chat / completion response (stream: its usage
    chunk): only when one generation stream is behind it (one prompt, n == 1); timing
    with --enable-per-request-metrics, speculative_decoding with
    --per-request-spec-decode-metrics; None otherwise."""
    if view.n != 1 or len(runs) != 1:
        return None
    run, metrics = runs[0], None
    if view.timing_metrics:
        metrics = timing_metrics(run.dispatched, run.first_scheduled_time, run.first_token_time,
                                 run.last_token_time, num_tokens)
    if view.spec_decode_metrics != "none" and run.spec_decode is not None:
        metrics = metrics or PerRequestMetrics()
        metrics.speculative_decoding = spec_decoding_metrics(run.spec_decode, view.spec_decode_metrics == "detailed")
    return metrics


def now() -> int:
    return int(time.time())


def generations(state: GatewayState, req, mapped: list[MappedRequest], detached: bool = False) -> list[Generation]:
    """The relay's runs of an OpenAI request, keeping the timestamps of its per-request
    metrics (``detached``: Generation's, for a background Response)."""
    return [Generation(state, req, m, timing=True, detached=detached) for m in mapped]
