"""Hypothesis fuzz of ``POST /inference/v1/generate`` against a real gateway, broker and
worker (tiny Llama with its byte tokenizer, max_model_len 64 so any accepted request
finishes quickly).

Bodies range from raw bytes and arbitrary JSON to well-shaped requests whose every
field (SamplingParams included) gets wild values: wrong types, huge and negative
numbers, NaN/Infinity, unicode, out-of-vocabulary ids, nested junk; headers get junk
too.  The server may only answer 2xx or 4xx (never 5xx), a 200 stream must end with
[DONE], and the stack must still serve normal requests afterwards.
"""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.gateway_helpers import ABORT, GENERATE, start_gateway
from tests.support.procs import ProcGroup, wait_for_workers

pytestmark = pytest.mark.timeout(300)

VOCAB = 320  # tests/support/model_factory.py
MAX_MODEL_LEN = 64
WORKER_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16", "--num-kv-blocks", "128",
               "--threads", "1")


@pytest.fixture(scope="module")
def gw(tmp_path_factory, llama_dir):
    with ProcGroup(tmp_path_factory.mktemp("fuzz-http")) as procs:
        broker = procs.broker()
        procs.worker(broker, 0, "--model", str(llama_dir), *WORKER_ARGS)
        wait_for_workers(broker.frontend, 1, timeout=120)
        gateway = start_gateway(procs, broker.frontend)
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            yield gateway, client, procs


# ----------------------------------------------------------------------------- strategies
huge_ints = st.sampled_from([2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64, -2 ** 63 - 1, 10 ** 30, -(10 ** 30)])
numbers = st.one_of(st.integers(-5, 400), huge_ints, st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([0, -1, 1, 1e-6, 2.0000001, -2.5, 1e308]))
junk_text = st.text(max_size=20) | st.sampled_from(["", "@", "a/b", "\\", "\x00", "x" * 200, "\ud7ff\U0010ffff"])
scalars = st.one_of(st.none(), st.booleans(), numbers, junk_text)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) |
                           st.dictionaries(junk_text, inner, max_size=4), max_leaves=12)
token_lists = st.one_of(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
                        st.lists(st.integers(-3, VOCAB + 3), max_size=6),
                        st.lists(numbers | junk_text, max_size=4))

# Each SamplingParams field: a plausible value of its type, or anything at all.
PLAUSIBLE = {
    "n": st.integers(-1, 20),
    "temperature": st.floats(-1, 3) | st.none(),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-2, VOCAB + 5),
    "min_p": st.floats(-0.5, 1.5),
    "seed": st.integers(-5, 2 ** 64) | st.none(),
    "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3),
    "stop": st.none() | junk_text | st.lists(junk_text, max_size=3),
    "stop_token_ids": st.none() | st.lists(st.integers(-2, VOCAB + 2), max_size=3),
    "ignore_eos": st.booleans(),
    "max_tokens": st.none() | st.integers(-2, MAX_MODEL_LEN + 5),
    "min_tokens": st.integers(-2, MAX_MODEL_LEN + 5),
    "logprobs": st.none() | st.integers(-2, VOCAB + 5),
    "prompt_logprobs": st.none() | st.integers(-2, VOCAB + 5),
    "prompt_logprob_token_ids": st.none() | st.lists(st.lists(st.integers(-2, VOCAB + 2), max_size=3), max_size=3),
    "detokenize": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "logit_bias": st.none() | st.dictionaries(st.integers(-2, VOCAB + 2).map(str), st.floats(-1e6, 1e6),
                                               max_size=3),
    "allowed_token_ids": st.none() | st.lists(st.integers(-2, VOCAB + 2), max_size=4),
    "bad_words": st.none() | st.lists(junk_text, max_size=3),
    "spaces_between_special_tokens": st.booleans(),
}
sampling_params = st.fixed_dictionaries({}, optional={
    name: strategy | json_values for name, strategy in PLAUSIBLE.items()}) | json_values

TOP_LEVEL = {
    "token_ids": token_lists | json_values,
    "sampling_params": sampling_params,
    "stream": st.booleans() | json_values,
    "stream_options": st.none() | st.fixed_dictionaries({}, optional={
        "include_usage": st.booleans() | json_values, "continuous_usage_stats": st.booleans() | json_values}),
    "output_mode": st.sampled_from(["tokens", "text", "TEXT", None, ""]) | json_values,
    "request_id": junk_text | json_values,
    "model": st.none() | junk_text,
    "return_token_ids": st.booleans() | json_values,
    "cache_salt": junk_text | json_values,
    "priority": numbers | json_values,
    "kv_transfer_params": json_values,
    "ec_transfer_params": json_values,
}
requests_ = st.fixed_dictionaries({"token_ids": token_lists, "sampling_params": sampling_params},
                                  optional={**{k: v for k, v in TOP_LEVEL.items()
                                               if k not in ("token_ids", "sampling_params")},
                                            "junk_extra_field": json_values})
# Printable ASCII without edge spaces: anything else the HTTP client itself refuses to send.
header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=30).map(str.strip)
headers_ = st.fixed_dictionaries({}, optional={
    "X-Request-Id": header_text, "X-data-parallel-rank": header_text | st.sampled_from(["0", "1", "-1", "99"]),
    "X-Session-ID": header_text, "traceparent": header_text, "tracestate": header_text,
    "Authorization": header_text,
    "Content-Type": st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain",
                                     "APPLICATION/JSON", ""])})


def _check(client: httpx.Client, content: bytes, headers: dict) -> None:
    h = {"Content-Type": "application/json", **headers}
    with client.stream("POST", GENERATE, content=content, headers=h) as resp:
        body = resp.read()
    assert 200 <= resp.status_code < 500, (resp.status_code, content[:500], headers, body[:500])
    if resp.status_code >= 400:
        err = json.loads(body)["error"]
        assert err["code"] == resp.status_code and isinstance(err["message"], str), body[:300]
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        events = body.decode().split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""], body[-300:]
        for event in events[:-2]:
            chunk = json.loads(event[len("data: "):])
            assert "error" not in chunk, chunk  # a request the gateway accepted must not fail mid-way
    else:
        assert json.loads(body)["choices"], body[:300]


def fuzz(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                    derandomize=True)


@fuzz(250)
@given(body=requests_, headers=headers_)
def test_shaped_requests_with_wild_fields(gw, body, headers):
    _, client, _ = gw
    _check(client, json.dumps(body).encode(), headers)


@fuzz(80)
@given(body=json_values)
def test_arbitrary_json_bodies(gw, body):
    _, client, _ = gw
    _check(client, json.dumps(body).encode(), {})


@fuzz(60)
@given(raw=st.binary(max_size=200) | st.text(max_size=100).map(str.encode))
def test_raw_byte_bodies(gw, raw):
    _, client, _ = gw
    _check(client, raw, {})
    r = client.post(ABORT, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code in (200, 400), (r.status_code, raw, r.text)


@fuzz(60)
@given(body=st.fixed_dictionaries({}, optional={"request_ids": st.lists(junk_text, max_size=4) | json_values,
                                                "junk": json_values}) | json_values)
def test_abort_endpoint_bodies(gw, body):
    _, client, _ = gw
    r = client.post(ABORT, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    assert r.status_code in (200, 400), (r.status_code, body, r.text)


def test_server_alive_and_serving_after_fuzz(gw):
    gateway, client, procs = gw
    assert all(p.alive() for p in procs.procs), procs.tails()
    assert client.get("/health").status_code == 200
    r = client.post(GENERATE, json={"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 5, "temperature": 0,
                                                                                "ignore_eos": True}})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 5, r.text
