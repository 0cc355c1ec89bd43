"""The engine on a CUDA device (skipped without one; NOT yet run on a GPU: none has been
lent so far): the Triton backend by default and no CPU-only code, HF parity in fp32
(exact greedy) and bf16 (tolerance-based: whole-vocabulary prompt log-probs against HF
fp32, calibrated by HF's own bf16 error, and greedy agreement up to near-ties),
CUDA-graph decode equal to eager decode at exact, padded and shrinking batch sizes,
device placement for cuda:N, KV sizing under gpu_memory_utilization and
kv_cache_memory_bytes, and tensor parallelism over two GPUs."""
from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from tests.support.engine_helpers import hf_greedy, hf_prompt_logprobs, make_engine, random_prompts, request

pytestmark = pytest.mark.cuda


def _run(engine, prompts, n_out, **params):
    """Greedy ids per prompt; ``n_out`` an int or one per prompt."""
    lens = n_out if isinstance(n_out, list) else [n_out] * len(prompts)
    res = engine.generate([request(str(i), p, max_tokens=n, ignore_eos=True, **params)
                           for i, (p, n) in enumerate(zip(prompts, lens))])
    return [res[str(i)][0] for i in range(len(prompts))]


def _ids(engine, prompts, n_out):
    return [d.token_ids for d in _run(engine, prompts, n_out)]


def _has_field(name: str) -> bool:
    from worker.engine import EngineConfig

    return name in {f.name for f in dataclasses.fields(EngineConfig)}


def _dense(tl, vocab: int) -> torch.Tensor:
    """A whole-vocabulary TokenLogprobs (prompt_logprobs=-1) as a dense [rows, V] tensor."""
    out = torch.full((len(tl.top_ids), vocab), float("-inf"))
    return out.scatter_(1, torch.tensor(tl.top_ids), torch.tensor(tl.top_logprobs, dtype=torch.float32))


def test_triton_is_the_cuda_default_and_no_cpu_code_runs(llama_dir, monkeypatch):
    import worker.engine.attention.backends.cpu_native as cpu_native
    import worker.engine.kernels as cpu_kernels
    import worker.engine.models.llama as llama

    def refuse(*_a, **_k):
        raise AssertionError("the CUDA engine must not run CPU-only code")

    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", refuse)  # the native CPU kernels' build / load
    monkeypatch.setattr(cpu_kernels, "resolve_cpu_kernels", refuse)
    monkeypatch.setattr(llama.LlamaForCausalLM, "pack_linears", refuse)  # CPU prepacking (oneDNN / native)
    monkeypatch.setattr(llama.LlamaDecoderLayer, "pack_linears", refuse)
    monkeypatch.setattr(cpu_native.CpuNativeBackend, "__init__", refuse)
    engine = make_engine(llama_dir, device="cuda", dtype="bfloat16")
    assert engine.attention_backend.name == "triton" and engine.runner._graphs
    assert engine.cpu_linear == "torch" and engine.model.ops is engine.attention_backend.ops
    assert engine.runner.kv_cache.is_cuda and engine.runner.kv_cache.dtype == torch.bfloat16
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in engine.model.parameters())
    out = _ids(engine, random_prompts(5, 3, 40, seed=1), 6)  # prefill, then graphed decode
    assert [len(o) for o in out] == [6] * 5


@pytest.mark.parametrize("batch", [3, 11, 16])
def test_cuda_graphs_match_eager_and_hf(llama_dir, batch):
    """Batches that hit a graph exactly and padded ones (3 rows replay the 4 graph, 11 the 16)."""
    prompts = random_prompts(batch, 3, 60, seed=5 + batch)
    eager = make_engine(llama_dir, device="cuda", dtype="float32", enforce_eager=True)
    graphs = make_engine(llama_dir, device="cuda", dtype="float32", enforce_eager=False)
    assert not eager.runner._graphs and graphs.runner._graphs, "graphs must be captured unless enforce_eager"
    out_eager = _ids(eager, prompts, 12)
    assert _ids(graphs, prompts, 12) == out_eager
    for p, got in zip(prompts[:3], out_eager):
        assert got == hf_greedy(llama_dir, p, 12)[0]
    bm = graphs.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_cuda_graphs_match_eager_while_the_batch_shrinks(llama_dir):
    """Different output lengths: the decode batch walks down 16 -> 13 -> 9 -> 5 -> 1 rows,
    through exact and padded graphs, with finished rows' blocks freed in between."""
    prompts = random_prompts(16, 3, 50, seed=21)
    lens = [2 + (i * 5) % 23 for i in range(16)]
    eager = _ids(make_engine(llama_dir, device="cuda", dtype="float32", enforce_eager=True), prompts, lens)
    graphs = make_engine(llama_dir, device="cuda", dtype="float32", enforce_eager=False)
    assert _ids(graphs, prompts, lens) == eager
    assert [len(o) for o in eager] == lens
    assert eager[0] == hf_greedy(llama_dir, prompts[0], lens[0])[0]


@pytest.mark.parametrize("batch", [1, 11, 16])
def test_cuda_graphs_match_eager_in_bf16(llama_dir, batch):
    """bf16: identical greedy ids, or a first difference at a near-tie of eager's top two
    (a padded graph's GEMMs may round differently from the unpadded eager ones)."""
    prompts = random_prompts(batch, 3, 60, seed=40 + batch)
    eager = _run(make_engine(llama_dir, device="cuda", dtype="bfloat16", enforce_eager=True), prompts, 12,
                 logprobs=2)
    graphs = _run(make_engine(llama_dir, device="cuda", dtype="bfloat16"), prompts, 12, logprobs=2)
    for e, g in zip(eager, graphs):
        if e.token_ids != g.token_ids:
            k = next(i for i, (a, b) in enumerate(zip(e.token_ids, g.token_ids)) if a != b)
            top = e.logprobs.top_logprobs[k]
            assert top[0] - top[1] < 0.05, f"graphs parted from eager at token {k} beyond a near-tie: {top}"


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_bf16_matches_hf_within_tolerance(tiny_model, kind):
    """bf16 vs HF fp32 on the same weights, whole vocabulary, every position of a prompt
    + HF's greedy continuation: our error at most 2x HF's own bf16 error (+ slack);
    teacher-forced argmax equal to fp32's except at near-ties; free-running greedy equal
    to fp32 HF's until a near-tie."""
    from tests.support.model_factory import load_hf_model

    path = tiny_model(kind)
    prompt = random_prompts(1, 30, 31, seed=9)[0]
    n = 16
    hf_ids, _ = hf_greedy(path, prompt, n)
    seq = prompt + hf_ids
    ref = hf_prompt_logprobs(path, seq)  # fp32, CPU
    vocab = ref.shape[1]
    hf_bf16 = load_hf_model(path).to("cuda", torch.bfloat16)
    with torch.inference_mode():
        low = torch.log_softmax(hf_bf16(torch.tensor([seq], device="cuda")).logits[0, :-1].float(), -1).cpu()
    del hf_bf16
    engine = make_engine(path, device="cuda", dtype="bfloat16", max_logprobs=-1)
    d = _run(engine, [seq], 1, prompt_logprobs=-1)[0]
    mine = _dense(d.prompt_logprobs, vocab)
    assert mine.shape == ref.shape

    err, hf_err = (mine - ref).abs(), (low - ref).abs()
    assert err.max() <= 2 * hf_err.max() + 0.02, (float(err.max()), float(hf_err.max()))
    assert err.mean() <= 2 * hf_err.mean() + 0.002, (float(err.mean()), float(hf_err.mean()))
    tie = max(0.05, 2 * float(hf_err.max()))
    rows = torch.arange(ref.shape[0])
    ref_top, my_top = ref.argmax(-1), mine.argmax(-1)
    margin = ref[rows, ref_top] - ref[rows, my_top]
    assert bool((margin[my_top != ref_top] <= tie).all()), margin[my_top != ref_top]
    assert float((my_top == ref_top).float().mean()) >= 0.9

    free = _ids(engine, [prompt], n)[0]
    k = next((i for i, (a, b) in enumerate(zip(free, hf_ids)) if a != b), n)
    if k < n:  # parted from fp32 HF: only at a near-tie (same prefix, so ``ref`` row is that context)
        r = len(prompt) - 1 + k
        assert float(ref[r, hf_ids[k]] - ref[r, free[k]]) <= tie, (k, free, hf_ids)


def test_sliding_window_and_qwen3_on_triton(tiny_model):
    for kind in ("mistral_swa", "qwen3"):
        path = tiny_model(kind)
        engine = make_engine(path, device="cuda", dtype="float32")
        prompts = random_prompts(3, 20, 40, seed=2)
        for p, got in zip(prompts, _ids(engine, prompts, 8)):
            assert got == hf_greedy(path, p, 8)[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_index_places_cache_and_graphs_on_that_device(llama_dir):
    dev = torch.device("cuda", 1)
    engine = make_engine(llama_dir, device="cuda:1", dtype="bfloat16")
    assert engine.runner.kv_cache.device == dev
    assert torch.cuda.current_device() == 1
    assert all(p.device == dev for p in engine.model.parameters())
    graphs = engine.runner._graphs
    assert graphs, "no CUDA graphs captured on cuda:1"
    for g in graphs.values():  # the graphs' static buffers and outputs live on cuda:1 too
        assert g.input_ids.device == dev and g.block_tables.device == dev and g.output.device == dev
    assert [len(o) for o in _ids(engine, random_prompts(3, 5, 9, seed=1), 6)] == [6, 6, 6]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensor_parallel_on_two_gpus_matches_one(qwen3_dir):
    prompts = random_prompts(4, 5, 30, seed=4)
    one = _ids(make_engine(qwen3_dir, device="cuda", dtype="float32"), prompts, 8)
    engine = make_engine(qwen3_dir, device="cuda:0", dtype="float32", tensor_parallel_size=2)
    try:
        assert _ids(engine, prompts, 8) == one
    finally:
        engine.close()


def _build_measured(path, **kw):
    """An engine and the device memory (mem_get_info) it took."""
    gc.collect()  # an engine dropped just before must be gone, its cache freed
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free0, total = torch.cuda.mem_get_info()
    engine = make_engine(path, device="cuda", dtype="bfloat16", max_model_len=1024, **kw)
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    return engine, free0 - free1, total - free1


def test_kv_cache_follows_gpu_memory_utilization(llama_dir):
    """Two utilizations a little above what is in use (a tiny model's cache would hit
    the block cap at 0.5 of an H200): the higher one gets more blocks and takes more
    memory, and neither takes the device past its share."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    low = total - free + int(0.01 * total)  # what this process may fill, others included
    u_small, u_big = low / total, min(0.95, (low + 0.01 * total) / total)
    small, used_small, in_use = _build_measured(llama_dir, gpu_memory_utilization=u_small)
    n_small = small.block_manager.num_blocks
    assert in_use <= (u_small + 0.005) * total
    del small
    big, used_big, in_use = _build_measured(llama_dir, gpu_memory_utilization=u_big)
    assert in_use <= (u_big + 0.005) * total
    assert big.block_manager.num_blocks > 1.5 * n_small and n_small > 1000
    assert used_big > used_small
    res = big.generate([request("a", [5, 6, 7], max_tokens=4, ignore_eos=True, n=2, temperature=1.0, seed=3)])
    assert [len(d.token_ids) for d in res["a"]] == [4, 4]


@pytest.mark.skipif(not _has_field("kv_cache_memory_bytes"), reason="EngineConfig has no kv_cache_memory_bytes")
def test_kv_cache_memory_bytes_sets_the_cache_size(llama_dir):
    from worker.engine.models import kv_bytes_per_block

    size = 64 << 20
    engine, used, _ = _build_measured(llama_dir, kv_cache_memory_bytes=size)
    per_block = kv_bytes_per_block(engine.model_config, engine.config.block_size, torch.bfloat16)
    assert engine.block_manager.num_blocks == size // per_block
    kv = engine.runner.kv_cache
    assert abs(kv.numel() * kv.element_size() - size) <= 2 * per_block  # + the graphs' scratch block
    assert used < size + (512 << 20)  # weights, graphs and workspaces of a tiny model on top


def test_weight_update_and_sleep_under_cuda_graphs(tiny_model_root):
    """Weights written in place keep the captured graphs valid; a level-2 sleep/wake
    re-captures them over the new KV cache and reloaded weights."""
    from safetensors.torch import load_file

    from tests.support.model_factory import tiny_model_dir

    a, b = tiny_model_dir("llama", tiny_model_root, 0), tiny_model_dir("llama", tiny_model_root, 1)
    prompts = [[5, 9, 11, 40], [100, 23, 18, 64, 2]]
    engine = make_engine(a, device="cuda", dtype="float32", enforce_eager=False)
    fresh_b = _ids(make_engine(b, device="cuda", dtype="float32", enforce_eager=False), prompts, 10)
    engine.rl.write_weights(load_file(str(b / "model.safetensors")))
    assert _ids(engine, prompts, 10) == fresh_b
    engine.rl.sleep(2)
    assert engine.runner.kv_cache is None and engine.model is None
    assert engine.rl.wake_up(None)
    fresh_a = _ids(make_engine(a, device="cuda", dtype="float32", enforce_eager=False), prompts, 10)
    assert _ids(engine, prompts, 10) == fresh_a  # over the wire: reloaded from the model's own checkpoint
    assert engine.rl.weight_version == "default"


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_on_triton_with_graphs_matches_hf_and_returns_routing(tiny_model, kind):
    """Expert layers through the Triton fused-MoE kernel, decode under CUDA graphs
    (routing recorded inside the graph): fp32 greedy ids equal HF, routed experts equal
    the eager engine's and HF's router top-k."""
    import io

    import numpy as np

    from tests.unit.engine.test_routed_experts import hf_routing

    path = tiny_model(kind)
    prompts = random_prompts(4, 5, 40, seed=6)
    graphs = make_engine(path, device="cuda", dtype="float32", enable_return_routed_experts=True)
    eager = make_engine(path, device="cuda", dtype="float32", enforce_eager=True, enable_return_routed_experts=True)
    assert graphs.runner._graphs and graphs.runner.routing_store.is_cuda
    got, ref = _run(graphs, prompts, 8), _run(eager, prompts, 8)
    for p, g, e in zip(prompts, got, ref):
        assert g.token_ids == e.token_ids == hf_greedy(path, p, 8)[0]
        routed = np.load(io.BytesIO(g.routed_experts))
        np.testing.assert_array_equal(routed, np.load(io.BytesIO(e.routed_experts)))
        np.testing.assert_array_equal(routed, hf_routing(path, p + g.token_ids[:-1]))


def test_lora_decode_under_cuda_graphs_matches_eager_and_peft(llama_dir, tmp_path):
    """Rows of three adapters (embedding and head included) and base rows, staggered
    lengths so decode batches shrink through padded graphs: the LoRA graph set replays
    the same ids as eager steps, and both equal peft / HF."""
    pytest.importorskip("peft")
    from tests.support.lora_factory import ATTENTION, MLP, build_adapter, peft_greedy

    ads = {"a": build_adapter(llama_dir, tmp_path / "a", ATTENTION + MLP, rank=4, seed=1),
           "b": build_adapter(llama_dir, tmp_path / "b", ["q_proj", "embed_tokens", "lm_head"], rank=8, seed=2),
           "c": build_adapter(llama_dir, tmp_path / "c", MLP, rank=16, seed=3)}
    kw = dict(device="cuda", dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16,
              lora_modules={k: str(v) for k, v in ads.items()})
    graphs, eager = make_engine(llama_dir, **kw), make_engine(llama_dir, enforce_eager=True, **kw)
    assert graphs.runner._lora_graphs and graphs.runner._graphs
    prompts = random_prompts(11, 4, 40, seed=8)
    names = ["a", "b", None, "c", "a", None, "b", "c", "c", None, "a"]
    lens = [3 + (i * 4) % 13 for i in range(len(prompts))]

    def run(engine):
        reqs = []
        for i, (p, n, m) in enumerate(zip(prompts, names, lens)):
            r = request(str(i), p, max_tokens=m, ignore_eos=True)
            r.lora_name = n
            reqs.append(r)
        res = engine.generate(reqs)
        return [res[str(i)][0].token_ids for i in range(len(prompts))]

    got = run(graphs)
    assert got == run(eager)
    for p, n, m, ids in zip(prompts, names, lens, got):
        assert ids == (peft_greedy(llama_dir, ads[n], p, m)[0] if n else hf_greedy(llama_dir, p, m)[0])


def test_speculative_decoding_on_cuda_matches_plain(llama_dir, tmp_path):
    """Verification rows through the Triton backend on the GPU (eager steps beside the
    graphed plain decodes), for both proposers: greedy ids and logprobs equal plain."""
    from tests.unit.engine.test_spec_decode import _noisy_copy, _repetitive

    prompts = _repetitive(6, seed=31)
    plain = _run(make_engine(llama_dir, device="cuda", dtype="float32"), prompts, 24, logprobs=1)
    draft = _noisy_copy(llama_dir, tmp_path / "noisy", 0.3)
    for cfg in ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
                {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}):
        engine = make_engine(llama_dir, device="cuda", dtype="float32", speculative_config=cfg)
        got = _run(engine, prompts, 24, logprobs=1)
        assert [g.token_ids for g in got] == [p.token_ids for p in plain], cfg["method"]
        for g, p in zip(got, plain):
            assert max(abs(a - b) for a, b in zip(g.logprobs.logprobs, p.logprobs.logprobs)) < 1e-4
        assert sum(sum(g.spec_decode.histogram[1:]) for g in got) > 0, cfg["method"]


def test_structured_outputs_on_cuda(llama_dir):
    """The grammar mask through the Triton kernel (pinned bitmask, async copy), with CUDA graphs."""
    from tests.support.structured_output_cases import cases, is_valid

    engine = make_engine(llama_dir, device="cuda", dtype="bfloat16", max_model_len=1024)
    chosen = cases()[:6] + cases()[-6:]
    reqs = [request(f"so{i}", [1, 2, i], max_tokens=600, temperature=1.0, seed=i, n=2, structured_outputs=so)
            for i, (_, so, _) in enumerate(chosen)]
    res = engine.generate(reqs)
    for r, (_, _, check) in zip(reqs, chosen):
        for d in res[r.request_id]:
            assert d.finish_reason == "stop" and is_valid(check, engine.tokenizer.decode(d.token_ids))
