"""Broker-native prefill/decode disaggregation (``--pd auto``): a broker with one
``--role prefill`` and one ``--role decode`` worker splits ordinary generate requests
itself.  Outputs (greedy ids, logprobs) equal the plain engine's; the decode leg is
served from the pulled KV blocks (reported as cached prompt tokens); streaming,
n > 1 and requests that cannot be split (prompt logprobs, short prompts) work."""
from __future__ import annotations

import json
import random

import httpx
import pytest

from tests.support.engine_helpers import make_engine, request
from tests.support.gateway_helpers import GENERATE, sse_payloads, start_gateway
from tests.support.procs import ProcGroup, wait_for_workers

WORKER_ARGS = ("--max-num-seqs", "8", "--num-kv-blocks", "128", "--threads", "1", "--max-model-len", "256")
BLOCK = 16


@pytest.fixture(scope="module")
def stack(tmp_path_factory, llama_dir):
    with ProcGroup(tmp_path_factory.mktemp("pd-broker")) as procs:
        broker = procs.broker("--pd", "auto")
        procs.worker(broker, 0, "--model", str(llama_dir), *WORKER_ARGS, "--role", "prefill")
        procs.worker(broker, 1, "--model", str(llama_dir), *WORKER_ARGS, "--role", "decode")
        wait_for_workers(broker.frontend, 2, timeout=120)
        gw = start_gateway(procs, broker.frontend, "--enable-prompt-tokens-details")  # cached_tokens, as vLLM's flag
        with httpx.Client(base_url=gw.url, timeout=120) as http:
            yield procs, broker, http


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(n)]


def test_split_requests_equal_plain_decoding(stack, llama_dir):
    _, _, http = stack
    prompts = [_prompt(50, s) for s in range(3)]
    plain = make_engine(llama_dir)
    want = plain.generate([request(str(i), p, max_tokens=10, logprobs=2) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        r = http.post(GENERATE, json={"token_ids": p, "sampling_params": {"max_tokens": 10, "temperature": 0,
                                                                           "logprobs": 2}})
        assert r.status_code == 200, r.text
        body = r.json()
        choice = body["choices"][0]
        assert choice["token_ids"] == want[str(i)][0].token_ids
        got = [e["logprob"] for e in choice["logprobs"]["content"]]
        assert got == pytest.approx(list(want[str(i)][0].logprobs.logprobs), abs=1e-4)
        # The decode worker served the prompt's full blocks from the pulled KV.
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(p) - 1) // BLOCK * BLOCK


def test_split_stream_and_n(stack):
    _, _, http = stack
    p = _prompt(40, 7)
    body = {"token_ids": p, "stream": True, "stream_options": {"include_usage": True},
            "sampling_params": {"max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 5}}
    r = http.post(GENERATE, json=body)
    assert r.status_code == 200, r.text
    chunks = [json.loads(x) for x in sse_payloads(r)[:-1]]
    ids = {0: [], 1: []}
    for c in chunks:
        for ch in c["choices"]:
            ids[ch["index"]] += ch["token_ids"]
    assert len(ids[0]) == len(ids[1]) == 6
    assert chunks[-1]["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize("params, prompt_len", [({"prompt_logprobs": 1}, 40), ({}, 10)])
def test_requests_that_cannot_be_split_run_whole(stack, params, prompt_len):
    _, _, http = stack
    r = http.post(GENERATE, json={"token_ids": _prompt(prompt_len, 3), "sampling_params": {
        "max_tokens": 4, "temperature": 0, **params}})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 4


def test_broker_logged_no_error(stack):
    _, broker, _ = stack
    log = broker.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "dropped" not in log, log[-2000:]
