"""The engine on a CUDA device: HF parity in fp32, and CUDA-graph decode giving the
same tokens as eager decode (skipped without a GPU)."""
from __future__ import annotations

import pytest

from tests.engine_helpers import hf_greedy, make_engine, random_prompts, request

pytestmark = pytest.mark.cuda


def _run(engine, prompts, n_out):
    res = engine.generate([request(str(i), p, max_tokens=n_out, ignore_eos=True) for i, p in enumerate(prompts)])
    return [res[str(i)][0].token_ids for i in range(len(prompts))]


def test_cuda_graphs_match_eager_and_hf(llama_dir):
    prompts = random_prompts(11, 3, 60, seed=5)  # 11 decoders: a padded graph batch (16)
    eager = make_engine(llama_dir, device="cuda", dtype="float32", enforce_eager=True)
    graphs = make_engine(llama_dir, device="cuda", dtype="float32", enforce_eager=False)
    assert not eager.runner._graphs and graphs.runner._graphs, "graphs must be captured unless enforce_eager"
    out_eager = _run(eager, prompts, 12)
    out_graph = _run(graphs, prompts, 12)
    assert out_graph == out_eager
    for p, got in zip(prompts[:3], out_eager):
        assert got == hf_greedy(llama_dir, p, 12)[0]
    bm = graphs.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_cuda_kv_cache_is_profiled(llama_dir):
    engine = make_engine(llama_dir, device="cuda", dtype="bfloat16", max_model_len=1024)
    assert engine.runner.kv_cache.dtype.is_floating_point and engine.block_manager.num_blocks > 1000
    res = engine.generate([request("a", [5, 6, 7], max_tokens=4, ignore_eos=True, n=2, temperature=1.0, seed=3)])
    assert [len(d.token_ids) for d in res["a"]] == [4, 4]
