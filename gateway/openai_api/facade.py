"""The OpenAI facade's middle step: a rendered ``GenerateRequest`` run through the same
path as ``/inference/v1/generate`` (model check, validation, broker dispatch, disconnect
aborts, metrics), with the workers detokenizing (text mode: stop strings are cut there,
as vLLM's engine does for its OpenAI server).

``Generation`` yields the request's ``CompletionDelta``s; the chat / completion
assemblers turn them into OpenAI objects.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional

import msgspec

from common.client import RequestError
from common.errors import BadRequest
from common.protocol import CompletionDelta, SpecDecodeStats
from common.validation import validate_request
from gateway.disconnect import RECEIVE_SCOPE_KEY, DisconnectWatcher
from gateway.generate_api.protocol import HttpGenerateRequest, PerRequestMetrics
from gateway.metrics import RequestTracker
from gateway.generate_api.request_mapping import MappedRequest, map_request
from gateway.resources.generate import GenerateResource, as_serving_error, check_encodable, cluster_for
from gateway.generate_api.response_builder import spec_decoding_metrics, timing_metrics
from gateway.state import GatewayState



async def map_rendered(state: GatewayState, req, generate: dict, arrival: float) -> MappedRequest:
    """A rendered GenerateRequest -> the wire request, checked as /generate checks one."""
    s = state.settings
    try:
        http = msgspec.convert(generate, HttpGenerateRequest)
    except msgspec.ValidationError as exc:
        raise BadRequest(str(exc)) from None
    cluster = await cluster_for(state, http.model)
    mapped = map_request(http, req.headers, cluster, cluster.model, served_model_names=s.served_model_names,
                         arrival_time=arrival)
    mapped.wire.request_id = generate["request_id"]
    mapped.wire.output_text = True
    validate_request(mapped.wire, cluster.model, tokens_only=False, stream=mapped.stream)
    check_encodable(mapped.wire)
    return mapped


class Generation:
    """One dispatched request: its deltas, its metrics tracker and its disconnect watcher."""

    def __init__(self, state: GatewayState, req, mapped: MappedRequest):
        self.state = state
        self.mapped = mapped
        self.tracker: RequestTracker = state.metrics.tracker(mapped.model_name, len(mapped.wire.prompt_token_ids),
                                                             mapped.wire.arrival_time)
        self.deltas = state.client.generate(mapped.wire)
        request_id = mapped.wire.request_id
        self.watcher = DisconnectWatcher(req.scope.get(RECEIVE_SCOPE_KEY),
                                         lambda: state.client.abort([request_id]),
                                         state.settings.disconnect_grace_s)
        self.first: Optional[CompletionDelta] = None
        self._closed = False
        # Per-request metrics: dispatch stands for vLLM's queued time, the workers stamp
        # scheduling and the first token, the last token is when its delta got here.
        self.dispatched = time.time()
        self.first_scheduled_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.spec_decode: Optional[SpecDecodeStats] = None

    def _observe(self, delta: CompletionDelta) -> None:
        self.tracker.observe(delta)
        if delta.first_scheduled_time and self.first_scheduled_time is None:
            self.first_scheduled_time = delta.first_scheduled_time
        if delta.first_token_time and self.first_token_time is None:
            self.first_token_time = delta.first_token_time
        if delta.token_ids:
            self.last_token_time = time.time()
        if delta.spec_decode is not None:
            self.spec_decode = delta.spec_decode

    async def start(self) -> None:
        """Wait for the first delta, so that a rejection keeps its HTTP status."""
        self.watcher.start()
        try:
            self.first = await anext(self.deltas, None)
        except RequestError as exc:
            await self.close(exc.status)
            raise as_serving_error(exc) from None
        except BaseException:
            await self.close(500)
            raise

    def relay_in_current_task(self) -> None:
        self.watcher.start(asyncio.current_task())

    async def __aiter__(self) -> AsyncIterator[CompletionDelta]:
        if self.first is not None:
            self._observe(self.first)
            yield self.first
        async for delta in self.deltas:
            self._observe(delta)
            yield delta

    @property
    def disconnected(self) -> bool:
        return self.watcher.disconnected

    async def close(self, error_status: Optional[int] = None) -> None:
        if self._closed:
            return
        self._closed = True
        await GenerateResource.close_relay(self.deltas, self.watcher, self.tracker, error_status)


async def start_all(state: GatewayState, req, mapped: list[MappedRequest]) -> list[Generation]:
    runs = [Generation(state, req, m) for m in mapped]
    try:
        await asyncio.gather(*(r.start() for r in runs))
    except BaseException:
        for r in runs:
            await r.close(400)
        raise
    return runs


async def merged(runs: list[Generation]) -> AsyncIterator[tuple[int, CompletionDelta]]:
    """Deltas of several generations as they come, tagged with the generation's position."""
    if len(runs) == 1:
        async for delta in runs[0]:
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, run: Generation) -> None:
        try:
            async for delta in run:
                await queue.put((i, delta))
        except BaseException as exc:  # surfaced to the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(runs)]
    remaining = len(runs)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


@dataclass(frozen=True)
class ResponseView:
    """What of the OpenAI request shapes its response."""

    n: int = 1
    top_logprobs: Optional[int] = None  # None: no logprobs; -1: all
    echo: bool = False
    return_token_ids: bool = False
    return_prompt_text: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    # Server switches (vLLM's): routed_experts on non-stream choices, per-request timing
    # metrics, metrics.speculative_decoding.
    routed_experts: bool = False
    timing_metrics: bool = False
    spec_decode_metrics: str = "none"

    @classmethod
    def of(cls, request, top_logprobs: Optional[int], settings=None) -> "ResponseView":
        opts = request.stream_options if request.stream else None
        include = bool(opts and opts.include_usage)
        server = {} if settings is None else dict(
            routed_experts=settings.enable_return_routed_experts,
            timing_metrics=settings.enable_per_request_metrics,
            spec_decode_metrics=settings.per_request_spec_decode_metrics)
        return cls(n=request.n or 1, top_logprobs=top_logprobs, echo=bool(request.echo),
                   return_token_ids=bool(request.return_token_ids),
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
