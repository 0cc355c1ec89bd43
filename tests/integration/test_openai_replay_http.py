"""routed_experts and per-request metrics on the OpenAI facade, through a real broker, a
Qwen3-MoE worker started with --enable-return-routed-experts and two gateways: one with
--enable-return-routed-experts --enable-per-request-metrics, one with neither.

As vLLM 0.32: routed_experts on non-stream chat / completion choices only (equal to what
/inference/v1/generate returns for the same prompt tokens), never on stream chunks;
metrics (timing) on the non-stream response and on the stream's include_usage chunk,
for one prompt with n == 1 only; null / absent where vLLM leaves them out."""
from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest

from tests.support.gateway_helpers import GENERATE, gen_body, sse_payloads, start_gateway
from tests.support.procs import ProcGroup, wait_for_workers
from tests.integration.test_openai_http import build_chat_model

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Route me through the experts"}]
PROMPT = [5, 9, 11, 40, 77, 3, 100, 23, 18, 64, 7, 7, 200, 31, 90, 12, 45, 30, 2]
GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
TIMING = ("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second")


def routed(s: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(s)), allow_pickle=False)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("openai-replay")
    model = build_chat_model(tiny_model("qwen3_moe"), root / "model")
    with ProcGroup(root / "procs") as procs:
        broker = procs.broker()
        procs.worker(broker, 0, "--model", str(model), "--threads", "1", "--max-model-len", "256",
                     "--num-kv-blocks", "128", "--enable-return-routed-experts")
        wait_for_workers(broker.frontend, 1, timeout=120)
        on = start_gateway(procs, broker.frontend, "--tokenizer", str(model), "--enable-return-routed-experts",
                           "--enable-per-request-metrics")
        off = start_gateway(procs, broker.frontend, "--tokenizer", str(model))
        with httpx.Client(base_url=on.url, timeout=120) as http_on, \
                httpx.Client(base_url=off.url, timeout=120) as http_off:
            yield http_on, http_off


def generate_routing(http: httpx.Client, prompt: list[int], **params) -> tuple[list[int], np.ndarray]:
    r = http.post(GENERATE, json=gen_body(prompt, **GREEDY, **params))
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    return choice["token_ids"], routed(choice["routed_experts"])


def check_timing(metrics: dict, num_tokens: int) -> None:
    assert all(isinstance(metrics[k], float) for k in TIMING), metrics
    assert 0 < metrics["time_to_first_token_ms"] < 60_000 and 0 <= metrics["queue_time_ms"] < 60_000
    assert 0 < metrics["generation_time_ms"] < 60_000
    assert metrics["mean_itl_ms"] == pytest.approx(metrics["generation_time_ms"] / (num_tokens - 1))
    # all tokens over scheduling -> last token, which covers first token -> last token
    assert 0 < metrics["tokens_per_second"] < num_tokens / metrics["generation_time_ms"] * 1e3


def stream(http: httpx.Client, path: str, body: dict) -> list[dict]:
    r = http.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    payloads = sse_payloads(r)
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def test_chat_routed_experts_equal_generate_and_metrics(stack):
    http, _ = stack
    r = http.post(CHAT, json=dict(messages=MESSAGES, return_token_ids=True, **GREEDY))
    assert r.status_code == 200, r.text
    body = r.json()
    (choice,) = body["choices"]
    prompt, out = body["prompt_token_ids"], choice["token_ids"]
    ids, ref = generate_routing(http, prompt)
    assert out == ids and len(out) == 6
    got = routed(choice["routed_experts"])
    assert got.dtype == np.uint8 and got.shape == (len(prompt) + len(out) - 1, 2, 2)  # 2 MoE layers, top-2
    np.testing.assert_array_equal(got, ref)
    metrics = body["metrics"]
    check_timing(metrics, len(out))
    assert "speculative_decoding" in metrics and metrics["speculative_decoding"] is None  # no spec decode

    # routed_experts_prompt_start skips leading prompt rows, as on /generate
    r = http.post(CHAT, json=dict(messages=MESSAGES, routed_experts_prompt_start=4, **GREEDY))
    np.testing.assert_array_equal(routed(r.json()["choices"][0]["routed_experts"]), ref[4:])


def test_chat_stream_metrics_ride_on_the_usage_chunk_only(stack):
    http, _ = stack
    chunks = stream(http, CHAT, dict(messages=MESSAGES, stream_options={"include_usage": True}, **GREEDY))
    assert all("routed_experts" not in c for chunk in chunks for c in chunk["choices"])  # not a stream field
    assert all("metrics" not in chunk for chunk in chunks[:-1])
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert set(last["metrics"]) == set(TIMING)  # null keys left out (exclude_none)
    check_timing(last["metrics"], 6)
    chunks = stream(http, CHAT, dict(messages=MESSAGES, **GREEDY))  # no usage chunk: no metrics
    assert not any("metrics" in chunk for chunk in chunks)


def test_completion_routed_experts_equal_generate(stack):
    http, _ = stack
    ids, ref = generate_routing(http, PROMPT)
    r = http.post(COMPLETIONS, json=dict(prompt=PROMPT, return_token_ids=True, **GREEDY))
    assert r.status_code == 200, r.text
    body = r.json()
    (choice,) = body["choices"]
    assert choice["token_ids"] == ids
    np.testing.assert_array_equal(routed(choice["routed_experts"]), ref)
    check_timing(body["metrics"], 6)

    chunks = stream(http, COMPLETIONS, dict(prompt=PROMPT, stream_options={"include_usage": True}, **GREEDY))
    assert all("routed_experts" not in c for chunk in chunks for c in chunk["choices"])
    assert all("metrics" not in chunk for chunk in chunks[:-1])
    assert set(chunks[-1]["metrics"]) == set(TIMING)
    check_timing(chunks[-1]["metrics"], 6)


def test_each_choice_gets_its_own_and_no_metrics_past_one_stream(stack):
    http, _ = stack
    other = PROMPT[::-1]
    # two prompts: each choice its prompt's routing; metrics cannot be attributed -> null
    r = http.post(COMPLETIONS, json=dict(prompt=[PROMPT, other], return_token_ids=True, **GREEDY))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["metrics"] is None
    for choice, prompt in zip(body["choices"], (PROMPT, other)):
        ids, ref = generate_routing(http, prompt)
        assert choice["token_ids"] == ids
        np.testing.assert_array_equal(routed(choice["routed_experts"]), ref)
    # n > 1: each sampled choice its own routing (its tokens replayed greedily equal it)
    r = http.post(CHAT, json=dict(messages=MESSAGES, n=2, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True,
                                  return_token_ids=True))
    body = r.json()
    assert body["metrics"] is None and len(body["choices"]) == 2
    prompt = body["prompt_token_ids"]
    for choice in body["choices"]:
        got = routed(choice["routed_experts"])
        assert got.shape[0] == len(prompt) + len(choice["token_ids"]) - 1
        # the prompt rows are the prompt's whatever was sampled after it
        np.testing.assert_array_equal(got[:len(prompt)], generate_routing(http, prompt)[1][:len(prompt)])
    chunks = stream(http, CHAT, dict(messages=MESSAGES, n=2, temperature=1.0, max_tokens=3,
                                     stream_options={"include_usage": True}))
    assert chunks[-1]["usage"]["completion_tokens"] == 6 and "metrics" not in chunks[-1]


def test_gateway_without_the_flags_returns_null(stack):
    _, http = stack
    r = http.post(CHAT, json=dict(messages=MESSAGES, **GREEDY))
    body = r.json()
    assert r.status_code == 200 and body["metrics"] is None
    assert "routed_experts" in body["choices"][0] and body["choices"][0]["routed_experts"] is None
    r = http.post(COMPLETIONS, json=dict(prompt=PROMPT, **GREEDY))
    body = r.json()
    assert r.status_code == 200 and body["metrics"] is None and body["choices"][0]["routed_experts"] is None
    for path, req in ((CHAT, dict(messages=MESSAGES)), (COMPLETIONS, dict(prompt=PROMPT))):
        chunks = stream(http, path, dict(stream_options={"include_usage": True}, **req, **GREEDY))
        assert chunks[-1]["usage"]["completion_tokens"] == 6 and not any("metrics" in c for c in chunks)


def test_bad_prompt_start_is_a_400(stack):
    http, _ = stack
    r = http.post(COMPLETIONS, json=dict(prompt=PROMPT, routed_experts_prompt_start=len(PROMPT) + 1, **GREEDY))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and "routed_experts_prompt_start" in err["message"]


def test_generate_metrics_as_vllm_and_timing_with_the_flag(stack):
    """/inference/v1/generate: vLLM fills ``metrics`` only with speculative-decoding stats,
    so without spec decode it is null (stream: no key); --enable-per-request-metrics adds
    the OpenAI routes' timing fields there too."""
    on, off = stack
    body = gen_body(PROMPT, **GREEDY)
    r = off.post(GENERATE, json=body)
    assert r.status_code == 200 and r.json()["metrics"] is None
    chunks = stream(off, GENERATE, {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"]["completion_tokens"] == 6 and not any("metrics" in c for c in chunks)
    r = on.post(GENERATE, json=body)
    assert r.status_code == 200
    check_timing(r.json()["metrics"], 6)
    chunks = stream(on, GENERATE, {**body, "stream_options": {"include_usage": True}})
    assert set(chunks[-1]["metrics"]) == set(TIMING)
    check_timing(chunks[-1]["metrics"], 6)
