"""The generation relay: what ``/inference/v1/generate`` and the OpenAI routes share once
a request is mapped onto the wire.

It submits each wire request to the broker client (``Generation``), waits for the first
delta before answering (a rejection by the broker or a worker — 503 overloaded, 400 —
stays a real HTTP error, even for a stream), then either collects every delta into one
JSON body or streams them as SSE events ending with ``data: [DONE]`` (or the
formatter's own ``done``: Anthropic's and the Responses API's streams end on their last
event); a failure after the stream began becomes an error event and that ending.  It watches for the client
going away (gateway/disconnect.py: abort at once, cancel the relay after the grace
period), feeds the request's metrics tracker (gateway/metrics.py) and closes the delta
streams (an ABORT when cut short) with the status the metrics record.

What the events and the body say belongs to the API, through a formatter:

* ``StreamFormatter``: ``head()`` (events before any delta), ``chunk(delta, run)`` (a
  delta -> at most one event, ``None`` for none), ``final()`` (the usage event after the
  last delta, not sent to a client that left), ``error_chunk(exc, what)`` (the status to
  record and the error event);
* ``BodyFormatter``: ``add(delta, run)`` for every delta, then ``body()``.

``run`` is the position of the generation the delta belongs to (several for a
multi-prompt completion).  The per-delta path is one ``observe`` and one ``chunk`` call.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Iterable, Optional, Protocol

import falcon

from common.client import RequestError
from common.errors import ServingError
from common.protocol import CompletionDelta, SpecDecodeStats
from gateway.disconnect import RECEIVE_SCOPE_KEY, DisconnectWatcher
from gateway.errors import stream_error_json
from gateway.metrics import RequestTracker
from gateway.state import GatewayState

log = logging.getLogger("tokserve.gateway")

SSE_DONE = b"data: [DONE]\n\n"


# JSON may carry U+2028, U+2029 and U+0085 raw inside strings, and the SSE grammar does
# not treat them as line ends, but every reader that splits decoded text with
# ``str.splitlines`` (requests' ``iter_lines(decode_unicode=True)``, many hand-written
# clients, log shippers) does: a generated token holding one cut its event in two and the
# client lost the chunk.  Escaped as ``\\uXXXX`` they are the same JSON string.  In
# valid UTF-8 these byte sequences only ever encode those characters, so a byte replace
# is exact.
_LINE_SEPARATORS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))


def sse_event(payload: bytes) -> bytes:
    """One ``data:`` event; ``payload`` is JSON (UTF-8), kept on one line."""
    for raw, escaped in _LINE_SEPARATORS:
        if raw in payload:
            payload = payload.replace(raw, escaped)
    return b"data: " + payload + b"\n\n"


def as_serving_error(err: RequestError) -> ServingError:
    return ServingError(err.message, err.param, status=err.status, type=err.type)


class StreamFormatter:
    """An API's SSE events; subclasses define ``chunk`` and may override the rest.
    ``done``: the stream's last bytes (OpenAI's ``[DONE]``; empty for APIs whose last
    event says so itself, as Anthropic's ``message_stop``)."""

    done: bytes = SSE_DONE

    def head(self) -> Iterable[bytes]:
        return ()

    def chunk(self, delta: CompletionDelta, run: int = 0) -> Optional[bytes]:
        raise NotImplementedError

    def final(self) -> Optional[bytes]:
        return None

    def error_chunk(self, exc: Exception, what: str) -> tuple[int, bytes]:
        status, body = stream_error_json(exc, what)
        return status, sse_event(body)


class BodyFormatter(Protocol):
    """An API's non-stream answer."""

    def add(self, delta: CompletionDelta, run: int = 0) -> None: ...

    def body(self) -> bytes: ...


class Generation:
    """One wire request submitted to the broker: its deltas, metrics tracker and
    disconnect watcher.  ``timing`` keeps the timestamps of the OpenAI routes'
    per-request metrics (``dispatched``, ``first_scheduled_time``, ``first_token_time``,
    ``last_token_time``, ``spec_decode``); without it a delta costs only the tracker's
    ``observe``."""

    def __init__(self, state: GatewayState, req, mapped, *, num_prompt_tokens: Optional[int] = None,
                 timing: bool = False, detached: bool = False):
        self.state = state
        self.mapped = mapped  # gateway.generate_api.request_mapping.MappedRequest
        wire = mapped.wire
        self.tracker: RequestTracker = state.metrics.tracker(
            mapped.model_name, len(wire.prompt_token_ids) if num_prompt_tokens is None else num_prompt_tokens,
            wire.arrival_time)
        self.deltas = state.client.generate(wire)
        request_id = wire.request_id
        # detached: no connection waits on it (a background Response): the client that
        # asked for it going away does not abort it.
        self.watcher = DisconnectWatcher(None if detached else req.scope.get(RECEIVE_SCOPE_KEY),
                                         lambda: state.client.abort([request_id]),
                                         state.settings.disconnect_grace_s)
        self.first: Optional[CompletionDelta] = None
        self._closed = False
        self.observe = self._observe_timed if timing else self.tracker.observe
        # Per-request metrics: dispatch stands for vLLM's queued time, the workers stamp
        # scheduling and the first token, the last token is when its delta got here.
        self.dispatched = time.time()
        self.first_scheduled_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.spec_decode: Optional[SpecDecodeStats] = None

    def _observe_timed(self, delta: CompletionDelta) -> None:
        self.tracker.observe(delta)
        if delta.first_scheduled_time and self.first_scheduled_time is None:
            self.first_scheduled_time = delta.first_scheduled_time
        if delta.first_token_time and self.first_token_time is None:
            self.first_token_time = delta.first_token_time
        if delta.token_ids:
            self.last_token_time = time.time()
        if delta.spec_decode is not None:
            self.spec_decode = delta.spec_decode

    async def start(self, relay_task: Optional[asyncio.Task] = None) -> None:
        """Wait for the first delta, so that a rejection keeps its HTTP status."""
        self.watcher.start(relay_task)
        try:
            self.first = await anext(self.deltas, None)
        except RequestError as exc:
            await self.close(exc.status)
            raise as_serving_error(exc) from None
        except asyncio.CancelledError:
            await self.close(499)
            raise
        except BaseException as exc:
            await self.close(exc.status if isinstance(exc, ServingError) else 500)
            raise

    async def __aiter__(self) -> AsyncIterator[CompletionDelta]:
        observe = self.observe
        if self.first is not None:
            observe(self.first)
            yield self.first
        async for delta in self.deltas:
            observe(delta)
            yield delta

    @property
    def disconnected(self) -> bool:
        return self.watcher.disconnected

    async def close(self, error_status: Optional[int] = None) -> None:
        """Once: stop watching, record the outcome, close the delta stream (ABORT when cut short)."""
        if self._closed:
            return
        self._closed = True
        watcher, tracker = self.watcher, self.tracker
        watcher.stop()
        if watcher.disconnected and tracker.reason is None:
            tracker.reason = "abort"  # cut short locally before the terminal delta came
        tracker.finish(error_status)
        try:
            await self.deltas.aclose()  # no-op when finished; sends ABORT when cut short
        except Exception:
            log.debug("closing the delta stream failed", exc_info=True)


async def start_all(runs: list[Generation], relay_task: Optional[asyncio.Task] = None) -> None:
    """Every run's first delta; on a failure every run is closed (400 for those that did not fail)."""
    try:
        if len(runs) == 1:
            await runs[0].start(relay_task)
        else:
            await asyncio.gather(*(r.start(relay_task) for r in runs))
    except BaseException:
        await close_all(runs, 400)
        raise


async def close_all(runs: list[Generation], error_status: Optional[int] = None) -> None:
    for r in runs:
        await r.close(error_status)


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


async def respond(resp: falcon.asgi.Response, runs: list[Generation], formatter, stream: bool) -> None:
    """Start the runs (errors before the first delta are HTTP errors), then answer:
    ``resp.stream`` of SSE events through a ``StreamFormatter``, or ``resp.data`` from
    a ``BodyFormatter``.  Every run is closed with the outcome the metrics record."""
    try:
        await start_all(runs, asyncio.current_task())
        if stream:
            resp.content_type = "text/event-stream"
            resp.set_header("Cache-Control", "no-cache")
            resp.stream = _sse(runs, formatter)
            return
        resp.content_type = falcon.MEDIA_JSON
        resp.data = await _collect(runs, formatter)
    except RequestError as exc:
        await close_all(runs, exc.status)
        raise as_serving_error(exc) from None
    except asyncio.CancelledError:
        await close_all(runs, 499)
        if any(r.watcher.cancelled_relay for r in runs):
            return  # the client is gone; nobody reads an answer
        raise
    except BaseException as exc:
        await close_all(runs, exc.status if isinstance(exc, ServingError) else 500)
        raise
    await close_all(runs)


async def _collect(runs: list[Generation], formatter: BodyFormatter) -> bytes:
    add = formatter.add
    if len(runs) == 1:
        run = runs[0]
        observe = run.observe
        if run.first is not None:
            observe(run.first)
            add(run.first)
            async for delta in run.deltas:
                observe(delta)
                add(delta)
    else:
        async for i, delta in merged(runs):
            add(delta, i)
    return formatter.body()


async def _sse(runs: list[Generation], formatter: StreamFormatter) -> AsyncIterator[bytes]:
    error_status = None
    task = asyncio.current_task()
    for r in runs:
        r.watcher.start(task)  # the relay now runs in the response task
    chunk = formatter.chunk
    try:
        for event in formatter.head():
            yield event
        if len(runs) == 1:
            run = runs[0]
            observe, watcher = run.observe, run.watcher
            if run.first is not None:
                observe(run.first)
                if not watcher.disconnected:
                    event = chunk(run.first)
                    if event is not None:
                        yield event
                async for delta in run.deltas:
                    observe(delta)
                    if watcher.disconnected:
                        continue  # nobody listens: drain until the abort's terminal delta
                    event = chunk(delta)
                    if event is not None:
                        yield event
        else:
            async for i, delta in merged(runs):
                if any(r.watcher.disconnected for r in runs):
                    continue
                event = chunk(delta, i)
                if event is not None:
                    yield event
        if not any(r.watcher.disconnected for r in runs):
            event = formatter.final()
            if event is not None:
                yield event
    except asyncio.CancelledError:
        error_status = 499
        if not any(r.watcher.cancelled_relay for r in runs):
            raise
        return  # client went away and the abort never completed
    except Exception as exc:
        error_status, event = formatter.error_chunk(exc, runs[0].mapped.wire.request_id if runs else "a stream")
        yield event
    finally:
        await close_all(runs, error_status)
    done = getattr(formatter, "done", SSE_DONE)
    if done:
        yield done
