"""routed_experts and sampling_mask over HTTP: a real broker, a Qwen3-MoE worker and
gateways started with and without --enable-return-routed-experts /
--return-sampling-mask.  Stream == non-stream, n > 1, the HF router reference, nulls
where the flags are off, and a dense model refused at worker start."""
from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest

from tests.support.gateway_helpers import GENERATE, gen_body, sse_payloads, start_gateway
from tests.support.procs import ProcGroup, wait_for, wait_for_workers
from tests.unit.engine.test_routed_experts import hf_routing

FLAGS = ("--enable-return-routed-experts", "--return-sampling-mask")
PROMPT = [5, 9, 11, 40, 77, 3, 100, 23, 18, 64, 7, 7, 200, 31, 90, 12, 45, 30, 2]


def routed(choice) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])), allow_pickle=False)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    model = tiny_model("qwen3_moe")
    with ProcGroup(tmp_path_factory.mktemp("replay")) as procs:
        broker = procs.broker()
        procs.worker(broker, 0, "--model", str(model), "--threads", "1", "--max-model-len", "256",
                     "--num-kv-blocks", "128", *FLAGS)
        wait_for_workers(broker.frontend, 1, timeout=120)
        on = start_gateway(procs, broker.frontend, *FLAGS)
        off = start_gateway(procs, broker.frontend)
        with httpx.Client(base_url=on.url, timeout=120) as http_on, \
                httpx.Client(base_url=off.url, timeout=120) as http_off:
            yield model, procs, broker, http_on, http_off


def test_non_stream_and_stream_agree_and_equal_hf(stack):
    model, _, _, http, _ = stack
    params = dict(temperature=1.0, seed=4, top_k=5, max_tokens=6, ignore_eos=True)
    r = http.post(GENERATE, json=gen_body(PROMPT, **params))
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    arr = routed(choice)
    assert arr.dtype == np.uint8 and arr.shape == (len(PROMPT) + 5, 2, 2)
    np.testing.assert_array_equal(arr, hf_routing(model, PROMPT + choice["token_ids"][:-1]))
    mask = choice["sampling_mask"]
    assert len(mask) == 6 and all(len(m) == 5 and t in m for m, t in zip(mask, choice["token_ids"]))

    s = http.post(GENERATE, json=gen_body(PROMPT, stream=True, **params))
    chunks = [json.loads(p)["choices"][0] for p in sse_payloads(s)[:-1]]
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    assert [m for c in chunks for m in c["sampling_mask"]] == mask  # each chunk: its own tokens'
    assert all(c["routed_experts"] is None for c in chunks[:-1])  # sent once, when the choice finishes
    np.testing.assert_array_equal(routed(chunks[-1]), arr)


def test_n_choices_each_get_their_own(stack):
    model, _, _, http, _ = stack
    r = http.post(GENERATE, json=gen_body(PROMPT, n=3, temperature=1.0, seed=9, max_tokens=5, ignore_eos=True))
    choices = r.json()["choices"]
    assert len(choices) == 3 and len({tuple(c["token_ids"]) for c in choices}) > 1
    for c in choices:
        np.testing.assert_array_equal(routed(c), hf_routing(model, PROMPT + c["token_ids"][:-1]))
        assert len(c["sampling_mask"]) == 5


def test_greedy_masks_and_prompt_start(stack):
    model, _, _, http, _ = stack
    r = http.post(GENERATE, json=gen_body(PROMPT, temperature=0.0, max_tokens=4, ignore_eos=True,
                                          routed_experts_prompt_start=15))
    (c,) = r.json()["choices"]
    assert c["sampling_mask"] == [[t] for t in c["token_ids"]]
    np.testing.assert_array_equal(routed(c), hf_routing(model, PROMPT + c["token_ids"][:-1])[15:])
    bad = http.post(GENERATE, json=gen_body(PROMPT, routed_experts_prompt_start=len(PROMPT) + 1))
    assert bad.status_code == 400
    err = bad.json()["error"]
    assert "routed_experts_prompt_start must be between 0 and the prompt length (19)" in err["message"]


def test_gateway_without_the_flags_returns_null(stack):
    _, _, _, _, http = stack
    for stream in (False, True):
        r = http.post(GENERATE, json=gen_body(PROMPT, stream=stream, max_tokens=3, temperature=0.0))
        assert r.status_code == 200
        choices = ([json.loads(p)["choices"][0] for p in sse_payloads(r)[:-1]] if stream
                   else r.json()["choices"])
        assert all("routed_experts" in c and c["routed_experts"] is None and c["sampling_mask"] is None
                   for c in choices)


def test_dense_model_with_routed_experts_fails_at_start(stack, tiny_model):
    _, procs, broker, _, _ = stack
    worker = procs.worker(broker, 5, "--model", str(tiny_model("llama")), "--threads", "1",
                          "--enable-return-routed-experts")
    wait_for(lambda: not worker.alive(), 60, "the worker to exit")
    assert worker.popen.returncode == 1
    assert "--enable-return-routed-experts needs a mixture-of-experts model; LlamaForCausalLM" in worker.tail()
