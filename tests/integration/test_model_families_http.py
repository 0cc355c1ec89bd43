"""Each family beyond Llama (the dense ones and GPT-OSS) served by a real worker behind the broker and a
gateway: greedy token ids and their logprobs from /inference/v1/generate equal
transformers' (a prompt past the sliding windows, prefilled in chunks)."""
from __future__ import annotations

import pytest

from tests.support.engine_helpers import hf_greedy, random_prompts
from tests.support.gateway_helpers import gen_body, post, start_gateway
from tests.support.procs import ProcGroup, wait_for_workers

WORKER_ARGS = ("--max-num-seqs", "4", "--num-kv-blocks", "64", "--threads", "1", "--max-model-len", "256",
               "--max-num-batched-tokens", "16", "--dtype", "float32")


@pytest.mark.parametrize("kind", ["phi3_longrope", "smollm3_swa", "olmo3", "gemma3", "gpt_oss"])
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
