"""Speculative decoding through the real stack: a broker, a worker started with
--speculative-config and a gateway with --per-request-spec-decode-metrics.

Outputs equal the plain engine's; metrics.speculative_decoding has vLLM's fields and
its counts add up (stream usage chunk and non-stream body), the vllm:spec_decode_*
counters sum the requests' counts, n > 1 gets no per-request metrics, and a bad
config stops the worker at start with the reason."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.support.engine_helpers import make_engine, request
from tests.support.gateway_helpers import GENERATE, sse_payloads, start_gateway
from tests.support.procs import ProcGroup, wait_for, wait_for_workers
from tests.unit.engine.test_spec_decode import NGRAM, _repetitive

WORKER_ARGS = ("--max-num-seqs", "8", "--num-kv-blocks", "128", "--threads", "1", "--max-model-len", "256")
FIELDS = {"mean_acceptance_length", "draft_acceptance_rate", "acceptance_histogram", "num_spec_steps",
          "num_accepted_draft_tokens", "num_draft_tokens", "num_spec_tokens", "per_step_accepted",
          "per_step_drafted"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, llama_dir):
    with ProcGroup(tmp_path_factory.mktemp("spec-stack")) as procs:
        broker = procs.broker()
        procs.worker(broker, 0, "--model", str(llama_dir), *WORKER_ARGS, "--speculative-config", json.dumps(NGRAM))
        wait_for_workers(broker.frontend, 1, timeout=120)
        gw = start_gateway(procs, broker.frontend, "--per-request-spec-decode-metrics", "detailed",
                           "--tokenizer", str(llama_dir))  # the OpenAI routes too
        with httpx.Client(base_url=gw.url, timeout=120) as http:
            yield procs, broker, http


def _body(prompt, stream=False, **params):
    return {"token_ids": prompt, "stream": stream, "stream_options": {"include_usage": True} if stream else None,
            "sampling_params": {"max_tokens": 32, "temperature": 0, "ignore_eos": True, **params}}


def _check_counts(spec: dict, num_tokens: int, k: int = NGRAM["num_speculative_tokens"]) -> tuple[int, int, int]:
    assert set(spec) == FIELDS and spec["num_spec_tokens"] == k
    hist = spec["acceptance_histogram"]
    steps, accepted = sum(hist), sum(j * c for j, c in enumerate(hist))
    assert len(hist) == spec["num_spec_tokens"] + 1 and spec["num_spec_steps"] == steps
    assert spec["num_accepted_draft_tokens"] == accepted == sum(spec["per_step_accepted"])
    assert accepted <= spec["num_draft_tokens"] == sum(spec["per_step_drafted"])
    assert len(spec["per_step_accepted"]) == steps
    assert spec["mean_acceptance_length"] == pytest.approx(1 + accepted / steps)
    assert spec["draft_acceptance_rate"] == pytest.approx(accepted / spec["num_draft_tokens"])
    # Every verify step emits its accepted drafts plus one token; other steps one token.
    assert accepted + steps <= num_tokens
    return steps, spec["num_draft_tokens"], accepted


def _counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_outputs_equal_plain_decoding_and_metrics_add_up(stack, llama_dir):
    _, _, http = stack
    prompts = _repetitive(4, seed=11)
    plain = make_engine(llama_dir)
    want = plain.generate([request(str(i), p, max_tokens=32, ignore_eos=True) for i, p in enumerate(prompts)])
    before = http.get("/metrics").text
    totals = [0, 0, 0]
    for i, p in enumerate(prompts):
        r = http.post(GENERATE, json=_body(p))
        assert r.status_code == 200, r.text
        body = r.json()
        tokens = body["choices"][0]["token_ids"]
        assert tokens == want[str(i)][0].token_ids
        counts = _check_counts(body["metrics"]["speculative_decoding"], len(tokens))
        totals = [a + b for a, b in zip(totals, counts)]
    assert totals[2] > 0, "nothing was accepted: the prompts must repeat"
    after = http.get("/metrics").text
    for name, total in zip(("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                            "vllm:spec_decode_num_accepted_tokens_total"), totals):
        assert _counter(after, name) - _counter(before, name) == total
    # Each accepted draft counts once at its position.
    assert _counter(after, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == \
        _counter(after, "vllm:spec_decode_num_accepted_tokens_total")


def test_stream_usage_chunk_carries_the_metrics(stack, llama_dir):
    _, _, http = stack
    prompt = _repetitive(3, seed=12)[2]
    r = http.post(GENERATE, json=_body(prompt, stream=True))
    chunks = [json.loads(p) for p in sse_payloads(r) if p != "[DONE]"]
    tokens = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == len(tokens) == 32
    _check_counts(final["metrics"]["speculative_decoding"], len(tokens))
    plain = make_engine(llama_dir).generate([request("p", prompt, max_tokens=32, ignore_eos=True)])
    assert tokens == plain["p"][0].token_ids


def test_openai_routes_carry_the_metrics_too(stack):
    """/v1/completions: metrics.speculative_decoding on the body and on the include_usage
    chunk; the timing fields stay null (no --enable-per-request-metrics), left out of the
    chunk (vLLM dumps it with exclude_none)."""
    _, _, http = stack
    prompt = _repetitive(1, seed=14)[0]
    req = dict(prompt=prompt, max_tokens=32, temperature=0, ignore_eos=True)
    r = http.post("/v1/completions", json=req)
    assert r.status_code == 200, r.text
    metrics = r.json()["metrics"]
    assert {k: v for k, v in metrics.items() if k != "speculative_decoding"} == dict.fromkeys(
        ("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second"))
    _check_counts(metrics["speculative_decoding"], 32)
    r = http.post("/v1/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(p) for p in sse_payloads(r) if p != "[DONE]"]
    assert all("metrics" not in c for c in chunks[:-1]) and list(chunks[-1]["metrics"]) == ["speculative_decoding"]
    _check_counts(chunks[-1]["metrics"]["speculative_decoding"], 32)
    r = http.post("/v1/completions", json={**req, "n": 2, "temperature": 1.0, "seed": 3})
    assert r.status_code == 200 and r.json()["metrics"] is None


def test_n_above_one_gets_no_per_request_metrics(stack):
    _, _, http = stack
    r = http.post(GENERATE, json=_body(_repetitive(1, seed=13)[0], n=2, temperature=1.0, seed=3))
    assert r.status_code == 200 and r.json()["metrics"] is None


def test_bad_config_stops_the_worker_at_start(stack, llama_dir):
    procs, broker, _ = stack
    worker = procs.worker(broker, 7, "--model", str(llama_dir), "--threads", "1", "--speculative-config",
                          '{"method": "ngram", "num_speculative_tokens": 0}')
    wait_for(lambda: not worker.alive(), 60, "the worker to exit")
    assert worker.popen.returncode != 0
    assert "num_speculative_tokens must be an integer >= 1, got 0" in worker.tail()


def test_draft_model_worker_through_the_stack(stack, llama_dir):
    """A worker started with a draft-model config (the target drafting for itself):
    pinned requests equal plain decoding and every draft is accepted."""
    procs, broker, http = stack
    cfg = {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3}
    worker = procs.worker(broker, 3, "--model", str(llama_dir), *WORKER_ARGS, "--speculative-config", json.dumps(cfg))
    try:
        wait_for_workers(broker.frontend, 2, timeout=120)
        prompts = _repetitive(2, seed=14)
        plain = make_engine(llama_dir).generate([request(str(i), p, max_tokens=32, ignore_eos=True)
                                                 for i, p in enumerate(prompts)])
        for i, p in enumerate(prompts):
            r = http.post(GENERATE, json=_body(p), headers={"X-data-parallel-rank": "3"})
            assert r.status_code == 200, r.text
            tokens = r.json()["choices"][0]["token_ids"]
            assert tokens == plain[str(i)][0].token_ids
            spec = r.json()["metrics"]["speculative_decoding"]
            _check_counts(spec, len(tokens), k=3)
            assert spec["num_draft_tokens"] > 0 and spec["draft_acceptance_rate"] == 1.0
    finally:
        worker.stop()
