"""Each family beyond Llama (the dense ones, GPT-OSS, DeepSeek-V3) served by a real worker behind the broker
and a gateway: greedy token ids and their logprobs from /inference/v1/generate equal
transformers' (a prompt past the sliding windows, prefilled in chunks); DeepSeek-V3 (its latent
KV cache) also streams transformers' greedy tokens."""
from __future__ import annotations

import json

import pytest

from tests.support.engine_helpers import hf_greedy, random_prompts
from tests.support.gateway_helpers import gen_body, post, sse_payloads, start_gateway
from tests.support.procs import ProcGroup, wait_for_workers

WORKER_ARGS = ("--max-num-seqs", "4", "--num-kv-blocks", "64", "--threads", "1", "--max-model-len", "256",
               "--max-num-batched-tokens", "16", "--dtype", "float32")


@pytest.mark.parametrize("kind", ["phi3_longrope", "smollm3_swa", "olmo2", "olmo3", "gemma3", "granite", "glm4_moe",
                                  "gpt_oss", "deepseek_v3", "deepseek_v2"])
def test_generate_through_the_stack_equals_hf(tiny_model, tmp_path, kind):
    path = tiny_model(kind)
    prompt = random_prompts(1, 30, 31, seed=11)[0]
    want_ids, rows = hf_greedy(path, prompt, 8)
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker()
        procs.worker(broker, 0, "--model", str(path), *WORKER_ARGS)
        wait_for_workers(broker.frontend, 1, timeout=120)
        gw = start_gateway(procs, broker.frontend)
        r = post(gw, gen_body(prompt, max_tokens=8, ignore_eos=True, temperature=0.0, logprobs=1))
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == want_ids
        got = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        assert got == pytest.approx([float(row[t]) for row, t in zip(rows, want_ids)], abs=1e-4)


def test_deepseek_v3_streams_hf_greedy_tokens(tiny_model, tmp_path):
    """Two prompts sharing a 24-token prefix (the second reuses its cached latent blocks),
    each streamed: the tokens the stream carries equal transformers' greedy ones."""
    path = tiny_model("deepseek_v3")
    shared = random_prompts(1, 24, 25, seed=5)[0]
    prompts = [shared + tail for tail in random_prompts(2, 6, 12, seed=6)]
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker()
        procs.worker(broker, 0, "--model", str(path), *WORKER_ARGS)
        wait_for_workers(broker.frontend, 1, timeout=120)
        gw = start_gateway(procs, broker.frontend)
        for prompt in prompts:
            want_ids, _ = hf_greedy(path, prompt, 10)
            r = post(gw, gen_body(prompt, stream=True, max_tokens=10, ignore_eos=True, temperature=0.0))
            assert r.status_code == 200, r.text
            payloads = sse_payloads(r)
            assert payloads[-1] == "[DONE]"
            streamed = [t for pl in payloads[:-1] for c in json.loads(pl)["choices"] for t in c["token_ids"]]
            assert streamed == want_ids
            assert len(payloads) > 2  # really streamed, not one final chunk
