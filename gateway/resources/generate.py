"""``POST /inference/v1/generate``: decode, validate, dispatch, relay as JSON or SSE."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Optional

import falcon
import msgspec

from common.client import RequestError
from common.errors import Overloaded, ServingError
from common.validation import validate_request
from gateway.body import decode_json, read_body
from gateway.disconnect import RECEIVE_SCOPE_KEY, DisconnectWatcher
from gateway.errors import stream_error_json
from gateway.generate_api.protocol import generate_request_decoder
from gateway.metrics import RequestTracker
from gateway.multimodal import attach_images
from gateway.generate_api.request_mapping import MappedRequest, knows_model, map_request
from gateway.generate_api.response_builder import SSE_DONE, ResponseAccumulator, ResponseOptions, StreamChunker, sse_event
from gateway.state import GatewayState

log = logging.getLogger("tokserve.gateway")
_wire_encoder = msgspec.msgpack.Encoder()
_NOTHING = object()


def as_serving_error(err: RequestError) -> ServingError:
    return ServingError(err.message, err.param, status=err.status, type=err.type)


def is_json(content_type: Optional[str]) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() == "application/json"


async def cluster_for(state: GatewayState, model: Optional[str]):
    """The cluster view a request is mapped against (503 while no worker has registered)."""
    cluster = await state.cluster.get()
    if cluster.model is None:
        raise Overloaded("No inference worker is available yet.")
    if model and not knows_model(model, cluster, state.settings.served_model_names):
        # An adapter loaded through another gateway a moment ago: ask the broker
        # before answering 404.
        cluster = await state.cluster.fresh()
    return cluster


def check_encodable(wire) -> None:
    """Ints beyond 64 bits and the like cannot travel; vLLM answers 400 for these too."""
    try:
        _wire_encoder.encode(wire)
    except (OverflowError, TypeError, ValueError) as exc:
        raise ServingError(str(exc), status=400, type="BadRequestError") from None


class GenerateResource:
    def __init__(self, state: GatewayState):
        self.state = state

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        arrival = time.time()
        s = self.state.settings
        if not is_json(req.content_type):
            raise ServingError("Unsupported Media Type: Only 'application/json' is allowed", status=400,
                               type="BadRequestError")
        body = await read_body(req, s.max_body_bytes)
        http = decode_json(generate_request_decoder, body)
        del body  # a big body need not outlive its decoding
        cluster = await cluster_for(self.state, http.model)
        mapped = map_request(http, req.headers, cluster, cluster.model, served_model_names=s.served_model_names,
                             arrival_time=arrival)
        validate_request(mapped.wire, cluster.model, tokens_only=s.tokens_only, stream=mapped.stream)
        await attach_images(mapped, self.state.image, s)  # after the cheap checks
        if s.tokens_only:
            mapped.wire.params.detokenize = False  # after validation, as vLLM's --tokens-only does
        check_encodable(mapped.wire)

        tracker = self.state.metrics.tracker(mapped.model_name, len(http.token_ids), arrival)
        deltas = self.state.client.generate(mapped.wire)
        request_id = mapped.wire.request_id
        watcher = DisconnectWatcher(req.scope.get(RECEIVE_SCOPE_KEY),
                                    lambda: self.state.client.abort([request_id]), s.disconnect_grace_s)
        details = ResponseOptions(prompt_tokens_details=bool(cluster.model.enable_prefix_caching),
                                  routed_experts=self.state.settings.enable_return_routed_experts,
                                  sampling_mask=self.state.settings.return_sampling_mask,
                                  spec_decode_metrics=self.state.settings.per_request_spec_decode_metrics,
                                  timing_metrics=self.state.settings.enable_per_request_metrics)
        try:
            watcher.start()
            # Wait for the first delta before answering, so that a rejection by the
            # broker or worker (503 overloaded, 400) keeps its HTTP status even when streaming.
            first = await anext(deltas, _NOTHING)
            if mapped.stream:
                resp.content_type = "text/event-stream"
                resp.set_header("Cache-Control", "no-cache")
                resp.stream = self._sse(mapped, deltas, first, tracker, watcher, details)
                return
            resp.content_type = falcon.MEDIA_JSON
            resp.data = await self._collect(mapped, deltas, first, tracker, details)
        except RequestError as exc:
            await self.close_relay(deltas, watcher, tracker, exc.status)
            raise as_serving_error(exc) from None
        except asyncio.CancelledError:
            await self.close_relay(deltas, watcher, tracker, 499)
            if watcher.cancelled_relay:
                return  # the client is gone; nobody reads an answer
            raise
        except BaseException as exc:
            status = exc.status if isinstance(exc, ServingError) else 500
            await self.close_relay(deltas, watcher, tracker, status)
            raise
        await self.close_relay(deltas, watcher, tracker)

    @staticmethod
    async def close_relay(deltas, watcher: DisconnectWatcher, tracker: RequestTracker,
                     error_status: Optional[int] = None) -> None:
        watcher.stop()
        if watcher.disconnected and tracker.reason is None:
            tracker.reason = "abort"  # cut short locally before the terminal delta came
        tracker.finish(error_status)
        try:
            await deltas.aclose()  # no-op when finished; sends ABORT when cut short
        except Exception:
            log.debug("closing the delta stream failed", exc_info=True)

    @staticmethod
    async def _collect(mapped: MappedRequest, deltas, first, tracker: RequestTracker,
                       details: ResponseOptions) -> bytes:
        acc = ResponseAccumulator(mapped, details)
        if first is not _NOTHING:
            tracker.observe(first)
            acc.add(first)
            async for delta in deltas:
                tracker.observe(delta)
                acc.add(delta)
        return acc.build()

    async def _sse(self, mapped: MappedRequest, deltas, first, tracker: RequestTracker,
                   watcher: DisconnectWatcher, details: ResponseOptions) -> AsyncIterator[bytes]:
        chunker = StreamChunker(mapped, details)
        error_status = None
        watcher.start(asyncio.current_task())  # the relay now runs in the response task
        try:
            if first is not _NOTHING:
                tracker.observe(first)
                event = chunker.chunk(first)
                if event is not None:
                    yield event
                async for delta in deltas:
                    tracker.observe(delta)
                    if watcher.disconnected:
                        continue  # nobody listens: drain until the abort's terminal delta
                    event = chunker.chunk(delta)
                    if event is not None:
                        yield event
            if not watcher.disconnected:
                usage = chunker.usage_chunk()
                if usage is not None:
                    yield usage
        except asyncio.CancelledError:
            if not watcher.cancelled_relay:
                raise
            error_status = 499  # client went away and the abort never completed
            return
        except Exception as exc:
            error_status, body = stream_error_json(exc, mapped.wire.request_id)
            yield sse_event(body)
        finally:
            await self.close_relay(deltas, watcher, tracker, error_status)
        yield SSE_DONE
