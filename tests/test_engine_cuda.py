"""The engine on a CUDA device (skipped without one): the Triton backend by default,
HF parity in fp32 and bf16 (tolerance-based), CUDA-graph decode equal to eager decode
at several batch sizes, device placement for cuda:N, KV sizing under
gpu_memory_utilization, tensor parallelism over two GPUs, and no CPU-only code."""
from __future__ import annotations

import pytest
import torch

from tests.engine_helpers import hf_greedy, hf_prompt_logprobs, make_engine, random_prompts, request

pytestmark = pytest.mark.cuda


def _run(engine, prompts, n_out):
    res = engine.generate([request(str(i), p, max_tokens=n_out, ignore_eos=True) for i, p in enumerate(prompts)])
    return [res[str(i)][0].token_ids for i in range(len(prompts))]


def test_triton_is_the_cuda_default_and_no_cpu_code_runs(llama_dir, monkeypatch):
    import worker.engine.kernels as cpu_kernels

    def refuse(*_a, **_k):
        raise AssertionError("the CUDA engine must not load the CPU kernels")

    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", refuse)
    engine = make_engine(llama_dir, device="cuda", dtype="bfloat16")
    assert engine.attention_backend.name == "triton" and engine.runner._graphs
    assert engine.cpu_linear == "torch" and engine.model.ops is engine.attention_backend.ops
    assert engine.runner.kv_cache.is_cuda and engine.runner.kv_cache.dtype == torch.bfloat16
    assert len(_run(engine, [[5, 6, 7]], 4)[0]) == 4


@pytest.mark.parametrize("batch", [3, 11, 16])
def test_cuda_graphs_match_eager_and_hf(llama_dir, batch):
    """Batches that hit a graph exactly and padded ones (3 rows replay the 4 graph, 11 the 16)."""
    prompts = random_prompts(batch, 3, 60, seed=5 + batch)
    eager = make_engine(llama_dir, device="cuda", dtype="float32", enforce_eager=True)
    graphs = make_engine(llama_dir, device="cuda", dtype="float32", enforce_eager=False)
    assert not eager.runner._graphs and graphs.runner._graphs, "graphs must be captured unless enforce_eager"
    out_eager = _run(eager, prompts, 12)
    assert _run(graphs, prompts, 12) == out_eager
    for p, got in zip(prompts[:3], out_eager):
        assert got == hf_greedy(llama_dir, p, 12)[0]
    bm = graphs.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_bf16_matches_hf_within_tolerance(llama_dir):
    """bf16: prompt log-probabilities close to HF's fp32 ones, and greedy tokens equal
    for the first steps (later near-ties may flip in bf16)."""
    engine = make_engine(llama_dir, device="cuda", dtype="bfloat16")
    prompt = random_prompts(1, 40, 41, seed=9)[0]
    d = engine.generate([request("p", prompt, max_tokens=8, ignore_eos=True, prompt_logprobs=0)])["p"][0]
    ref = hf_prompt_logprobs(llama_dir, prompt)
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    got = torch.tensor(d.prompt_logprobs.logprobs)
    assert (got - want).abs().max() < 0.1
    assert d.token_ids[:4] == hf_greedy(llama_dir, prompt, 4)[0]


def test_sliding_window_and_qwen3_on_triton(tiny_model):
    for kind in ("mistral_swa", "qwen3"):
        path = tiny_model(kind)
        engine = make_engine(path, device="cuda", dtype="float32")
        prompts = random_prompts(3, 20, 40, seed=2)
        for p, got in zip(prompts, _run(engine, prompts, 8)):
            assert got == hf_greedy(path, p, 8)[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_index_places_cache_and_graphs_on_that_device(llama_dir):
    engine = make_engine(llama_dir, device="cuda:1", dtype="bfloat16")
    assert engine.runner.kv_cache.device == torch.device("cuda", 1)
    assert torch.cuda.current_device() == 1
    assert all(p.device == torch.device("cuda", 1) for p in engine.model.parameters())
    assert len(_run(engine, random_prompts(3, 5, 9, seed=1), 6)[2]) == 6


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensor_parallel_on_two_gpus_matches_one(qwen3_dir):
    prompts = random_prompts(4, 5, 30, seed=4)
    one = _run(make_engine(qwen3_dir, device="cuda", dtype="float32"), prompts, 8)
    engine = make_engine(qwen3_dir, device="cuda:0", dtype="float32", tensor_parallel_size=2)
    try:
        assert _run(engine, prompts, 8) == one
    finally:
        engine.close()


def test_kv_cache_follows_gpu_memory_utilization(llama_dir):
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    # What this process may fill, others included; small enough to stay under the block cap.
    low = total - free + int(0.01 * total)
    small = make_engine(llama_dir, device="cuda", dtype="bfloat16", max_model_len=1024,
                        gpu_memory_utilization=low / total)
    n_small = small.block_manager.num_blocks
    del small
    torch.cuda.empty_cache()
    big = make_engine(llama_dir, device="cuda", dtype="bfloat16", max_model_len=1024,
                      gpu_memory_utilization=min(0.95, (low + 0.01 * total) / total))
    assert big.block_manager.num_blocks > 1.5 * n_small and n_small > 1000
    res = big.generate([request("a", [5, 6, 7], max_tokens=4, ignore_eos=True, n=2, temperature=1.0, seed=3)])
    assert [len(d.token_ids) for d in res["a"]] == [4, 4]
