"""gateway/relay.py in process, on /inference/v1/generate with a fake broker client: the
first-delta wait (an error before the first token is an HTTP error, stream or not), the
stream's framing (events, the usage chunk, ``[DONE]``), a mid-stream failure (error
event, then ``[DONE]``), and what the metrics record for each."""
from __future__ import annotations

import asyncio
import json

import pytest

from common.client import RequestError
from common.protocol import ClusterInfo, CompletionDelta, ModelInfo
from gateway.app import create_falcon_app
from gateway.disconnect import keep_receive_in_scope
from gateway.settings import GatewaySettings

MODEL = "m"


class FakeClient:
    """``generate`` yields ``n`` deltas, then fails with ``fail`` (a RequestError) if set."""

    def __init__(self, n: int = 3, fail: RequestError | None = None, fail_after: int = 0):
        self.n, self.fail, self.fail_after = n, fail, fail_after
        self.aborted: list[str] = []

    async def info(self, timeout=None):
        return ClusterInfo(workers=[], model=ModelInfo(name=MODEL, vocab_size=1000, max_model_len=4096,
                                                       max_num_seqs=8))

    async def generate(self, wire):
        rid = wire.request_id
        for i in range(self.n):
            if self.fail is not None and i == self.fail_after:
                raise self.fail
            last = i == self.n - 1
            yield CompletionDelta(request_id=rid, token_ids=[10 + i], num_prompt_tokens=4,
                                  finish_reason="length" if last else None)

    async def abort(self, ids):
        self.aborted.extend(ids)


async def _call(client: FakeClient, body: dict) -> tuple[int, dict, bytes, object]:
    app, state = create_falcon_app(GatewaySettings(), client)
    app = keep_receive_in_scope(app)
    raw = json.dumps(body).encode()
    sent = False
    never = asyncio.Event()

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await never.wait()

    start, chunks = {}, []

    async def send(msg):
        if msg["type"] == "http.response.start":
            start.update(msg)
        elif msg["type"] == "http.response.body":
            chunks.append(msg.get("body", b""))

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/inference/v1/generate", "raw_path": b"/inference/v1/generate",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"), (b"host", b"x")]}
    await app(scope, receive, send)
    headers = {k.decode().lower(): v.decode() for k, v in start.get("headers", [])}
    return start["status"], headers, b"".join(chunks), state.metrics


def _sample(metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def _outcome(metrics) -> dict:
    """What the request's tracker recorded: successes by reason, errors by status, in flight."""
    return {"success": {r: _sample(metrics, "vllm:request_success_total", model_name=MODEL, finished_reason=r)
                        for r in ("length", "stop", "abort") if _sample(metrics, "vllm:request_success_total",
                                                                      model_name=MODEL, finished_reason=r)},
            "errors": {s: _sample(metrics, "tokserve:request_errors_total", model_name=MODEL, status=s)
                       for s in ("400", "499", "500", "503") if _sample(metrics, "tokserve:request_errors_total",
                                                                       model_name=MODEL, status=s)},
            "in_flight": _sample(metrics, "tokserve:gateway_requests_in_flight")}


def run(client, body):
    return asyncio.run(_call(client, body))


BODY = {"token_ids": [1, 2, 3, 4], "sampling_params": {"max_tokens": 3, "ignore_eos": True}}


def test_stream_events_usage_and_done():
    status, headers, raw, metrics = run(FakeClient(3), dict(BODY, stream=True,
                                                            stream_options={"include_usage": True}))
    assert status == 200
    assert _outcome(metrics) == {"success": {"length": 1.0}, "errors": {}, "in_flight": 0.0}
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["cache-control"] == "no-cache"
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    assert events[-2] == b"data: [DONE]"
    payloads = [json.loads(e[len(b"data: "):]) for e in events[:-2]]
    assert [p["choices"][0]["token_ids"] for p in payloads[:3]] == [[10], [11], [12]]
    assert payloads[2]["choices"][0]["finish_reason"] == "length"
    assert payloads[3]["choices"] == [] and payloads[3]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("stream", [False, True])
def test_error_before_the_first_delta_is_an_http_error(stream):
    err = RequestError("no capacity", status=503)
    status, headers, raw, metrics = run(FakeClient(3, fail=err, fail_after=0), dict(BODY, stream=stream))
    assert status == 503
    assert _outcome(metrics) == {"success": {}, "errors": {"503": 1.0}, "in_flight": 0.0}
    assert headers["content-type"].startswith("application/json")
    assert json.loads(raw)["error"]["code"] == 503
    assert b"[DONE]" not in raw


def test_error_mid_stream_is_an_error_event_then_done():
    err = RequestError("worker lost", status=503)
    status, _, raw, metrics = run(FakeClient(3, fail=err, fail_after=1), dict(BODY, stream=True))
    assert status == 200
    assert _outcome(metrics) == {"success": {}, "errors": {"503": 1.0}, "in_flight": 0.0}
    events = raw.split(b"\n\n")
    assert events[-2] == b"data: [DONE]"
    error = json.loads(events[-3][len(b"data: "):])
    assert error["error"]["code"] == 503 and error["error"]["message"] == "worker lost"
    assert json.loads(events[0][len(b"data: "):])["choices"][0]["token_ids"] == [10]


def test_error_mid_collect_keeps_its_status():
    err = RequestError("bad", status=400)
    status, _, raw, metrics = run(FakeClient(3, fail=err, fail_after=1), BODY)
    assert status == 400
    assert _outcome(metrics) == {"success": {}, "errors": {"400": 1.0}, "in_flight": 0.0}
    assert json.loads(raw)["error"]["message"] == "bad"


def test_body_collects_every_delta():
    status, _, raw, metrics = run(FakeClient(3), BODY)
    assert status == 200
    assert _outcome(metrics) == {"success": {"length": 1.0}, "errors": {}, "in_flight": 0.0}
    body = json.loads(raw)
    assert body["choices"][0]["token_ids"] == [10, 11, 12]
    assert body["usage"]["completion_tokens"] == 3


class SlowClient(FakeClient):
    """Deltas 10 ms apart, forever, until aborted: then the abort's terminal delta
    (``abort_ends=False``: the abort never ends it)."""

    def __init__(self, abort_ends: bool = True):
        super().__init__()
        self.abort_ends = abort_ends
        self._aborted = asyncio.Event()

    async def generate(self, wire):
        i = 0
        while True:
            if self._aborted.is_set() and self.abort_ends:
                yield CompletionDelta(request_id=wire.request_id, finish_reason="abort", num_prompt_tokens=4)
                return
            yield CompletionDelta(request_id=wire.request_id, token_ids=[10 + i], num_prompt_tokens=4)
            i += 1
            await asyncio.sleep(0.01)

    async def abort(self, ids):
        await super().abort(ids)
        self._aborted.set()


async def _disconnecting(client: SlowClient, body: dict, grace_s: float = 5.0):
    app, state = create_falcon_app(GatewaySettings(disconnect_grace_s=grace_s), client)
    app = keep_receive_in_scope(app)
    raw = json.dumps(body).encode()
    first_body = asyncio.Event()
    calls = 0
    chunks = []

    async def receive():
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": raw, "more_body": False}
        await first_body.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        if msg["type"] == "http.response.body" and msg.get("body"):
            chunks.append(msg["body"])
            first_body.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/inference/v1/generate", "raw_path": b"/inference/v1/generate",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"), (b"host", b"x")]}
    try:
        await asyncio.wait_for(app(scope, receive, send), 10)
    except asyncio.CancelledError:
        pass
    return b"".join(chunks), state.metrics


def test_client_disconnect_aborts_and_records_the_abort():
    client = SlowClient()
    body = dict(BODY, stream=True, stream_options={"include_usage": True})
    body["sampling_params"] = {"max_tokens": 1000, "ignore_eos": True}
    raw, metrics = asyncio.run(_disconnecting(client, body))
    assert len(client.aborted) == 1
    assert b'"choices":[]' not in raw  # no usage chunk for a client that left
    assert _outcome(metrics) == {"success": {"abort": 1.0}, "errors": {}, "in_flight": 0.0}


def test_abort_that_never_ends_cancels_the_relay_after_the_grace_period():
    client = SlowClient(abort_ends=False)
    body = dict(BODY, stream=True)
    body["sampling_params"] = {"max_tokens": 1000, "ignore_eos": True}
    raw, metrics = asyncio.run(_disconnecting(client, body, grace_s=0.05))
    assert len(client.aborted) == 1
    assert not raw.endswith(b"data: [DONE]\n\n")
    assert _outcome(metrics) == {"success": {}, "errors": {"499": 1.0}, "in_flight": 0.0}
