"""Gateway behaviour when the engine fails: real broker and gateway, the fake worker
process (tests/support/fake_worker.py) whose engine raises on a marked prompt."""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.support.fake_worker import CRASH_TOKEN
from tests.support.gateway_helpers import GENERATE, gen_body, iter_sse, post, start_gateway
from tests.support.procs import ProcGroup, wait_for_workers


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    with ProcGroup(tmp_path_factory.mktemp("gateway-failures")) as procs:
        broker = procs.broker()
        procs.fake_worker(broker, 0, "--step-delay", "0.02")
        wait_for_workers(broker.frontend, 1)
        yield start_gateway(procs, broker.frontend)


def test_engine_failure_mid_stream_sends_error_chunk_then_done(gw):
    body = gen_body([5, 6, 7], stream=True, max_tokens=2000)
    with httpx.stream("POST", gw.url + GENERATE, json=body, timeout=60) as resp:
        assert resp.status_code == 200
        payloads = iter_sse(resp.iter_lines())
        first = json.loads(next(payloads))
        assert first["choices"][0]["token_ids"]
        crasher = threading.Thread(target=post, args=(gw, gen_body([CRASH_TOKEN], max_tokens=2)))
        crasher.start()
        rest = list(payloads)
        crasher.join(30)
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])
    assert list(error) == ["error"], rest[-3:]
    assert error["error"]["code"] == 500 and error["error"]["message"]


def test_engine_failure_before_first_token_is_http_500(gw):
    r = post(gw, gen_body([CRASH_TOKEN], stream=True, max_tokens=2))
    assert r.status_code == 500, r.text
    assert r.json()["error"]["type"] == "InternalServerError"
    ok = post(gw, gen_body([1, 2], max_tokens=3))  # the worker keeps serving afterwards
    assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"] == [0, 1, 2]
