"""Tensor parallelism on CPU with gloo: TP=2 equals TP=1 (logits within 1e-4, greedy
ids identical), KV heads split or replicated, and one engine owning two ranks."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.engine_helpers import greedy_ids, make_engine, random_prompts, request
from tests.support.tp_model_check import run_steps
from worker.engine.config import EngineConfig
from worker.engine.loading.loader import load_model
from worker.engine.parallel.sharding import head_shard, vocab_shard

ROOT = Path(__file__).resolve().parents[2]


def test_head_sharding_rules():
    assert head_shard(8, 4, 1, 2) == head_shard(8, 4, 1, 2)
    s = head_shard(8, 4, 1, 2)
    assert (s.num_heads, s.num_kv_heads, s.head_start, s.kv_head_start) == (4, 2, 4, 2)
    # Fewer KV heads than ranks: each rank keeps the one head its query heads use.
    for rank in range(4):
        s = head_shard(8, 2, rank, 4)
        assert (s.num_heads, s.num_kv_heads) == (2, 1)
        assert s.kv_head_start == s.head_start // (8 // 2)
    with pytest.raises(ValueError, match="must divide num_attention_heads"):
        head_shard(6, 2, 0, 4)
    with pytest.raises(ValueError, match="must divide tensor_parallel_size"):
        head_shard(12, 2, 0, 3)
    assert vocab_shard(10, 1, 4) == (3, 3, 3) and vocab_shard(10, 3, 4) == (9, 1, 3)


def _tp_logits(model_dir: Path, tmp_path: Path, world: int) -> np.ndarray:
    init = f"file://{tmp_path / 'rendezvous'}"
    out = tmp_path / "logits.npy"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "tests.support.tp_model_check", "--rank", str(r), "--world", str(world),
                               "--init", init, "--model", str(model_dir), "--out", str(out)],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    logs = [p.communicate(timeout=240)[0].decode(errors="replace") for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    return np.load(out, allow_pickle=False)


def _hf_step_logits(path: Path) -> np.ndarray:
    """transformers' logits in run_steps' row order (full forwards of each sequence)."""
    from tests.support.model_factory import load_hf_model
    from tests.support.tp_model_check import STEPS_A, STEPS_B

    hf = load_hf_model(path)
    with torch.no_grad():
        a = hf(torch.tensor([STEPS_A[:29]])).logits[0].float()
        b = hf(torch.tensor([STEPS_B[:12]])).logits[0].float()
    rows = [a[:18], a[18:26], b[:9]] + [r for i in range(3) for r in (a[26 + i:27 + i], b[9 + i:10 + i])]
    return torch.cat(rows).numpy()


# kv heads 2 -> split; 1 -> replicated; Phi-3's fused checkpoint tensors are cut per rank;
# SmolLM3's NoPE and sliding layers; Gemma 3's local/global layers, tied head and soft-capping;
# OLMo's whole-projection q/k norms (all-reduced mean square), with KV heads split and replicated;
# the mixture-of-experts families with their experts split along the intermediate dimension
# (Qwen2-MoE's gated shared expert, GLM-4.5's grouped routing, dense first layer and shared
# experts, GPT-OSS's interleaved fused experts with biases and its per-head attention sinks);
# DeepSeek's latent attention split by heads (q_b_proj / q_proj, kv_b_proj rows, o_proj columns)
# over the replicated latent, with and without q_lora_rank, V3's and V2's routers.
# Granite: its embedding, residual, attention and logits multipliers on every rank.
@pytest.mark.parametrize("kind", ["llama", "qwen3", "llama_mqa", "phi3", "smollm3_swa", "gemma3", "olmo3", "granite",
                                  "olmo2_mqa", "mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe", "gpt_oss",
                                  "deepseek_v3", "deepseek_v3_plain", "deepseek_v2"])
def test_tp2_logits_match_tp1(tiny_model, tmp_path, kind):
    """A prefill, a chunk after cached context beside a second prefill, and decodes
    over the paged cache: TP=2 logits equal TP=1's and transformers' within 1e-4."""
    path = tiny_model(kind)
    ref = torch.cat(run_steps(load_model(path))).numpy()
    got = _tp_logits(path, tmp_path, 2)
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() < 1e-4
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    assert np.abs(got - _hf_step_logits(path)).max() < 1e-4


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_with_two_ranks_matches_one(tiny_model, async_scheduling):
    """Two ranks give one rank's tokens; with async scheduling the leader's device thread
    broadcasts each step with the tokens in flight filled in (the followers need them),
    and the steps overlap."""
    path = tiny_model("qwen3")
    prompts = random_prompts(5, 4, 40, seed=9)

    def greedy(engine):
        return greedy_ids(engine, prompts, 10)

    one = greedy(make_engine(path))
    engine = make_engine(path, tensor_parallel_size=2, async_scheduling=async_scheduling)
    try:
        assert engine.model.layers[0].num_kv_heads == 1 and engine.runner.kv_cache.shape[-2] == 1
        assert greedy(engine) == one
        assert (engine.step_counts.get("overlapped", 0) > 5) == async_scheduling, engine.step_counts
        procs = engine.tp_leader.procs
        assert all(p.is_alive() for p in procs)
    finally:
        engine.close()
    assert not any(p.is_alive() for p in procs)


def test_async_two_ranks_with_staggered_arrivals_and_chunks(tiny_model):
    """Requests joining mid-run, prefill chunks and finishes change the batch every few
    steps: the tokens in flight land at scattered input positions, and the followers
    still compute what rank 0 does (the same tokens as the synchronous single rank)."""
    path = tiny_model("llama")
    prompts = random_prompts(6, 5, 40, seed=17)

    def run(engine):
        pending = [request(f"s{i}", p, max_tokens=4 + 2 * i, ignore_eos=True) for i, p in enumerate(prompts)]
        got: dict[str, list[int]] = {}
        for _ in range(10_000):
            if pending:
                engine.add_request(pending.pop(0))
            elif not engine.has_unfinished():
                break
            for d in engine.step():
                got.setdefault(d.request_id, []).extend(d.token_ids)
        return got

    ref = run(make_engine(path, max_num_batched_tokens=16))
    engine = make_engine(path, tensor_parallel_size=2, async_scheduling=True, max_num_batched_tokens=16)
    try:
        assert run(engine) == ref
        assert engine.step_counts.get("overlapped", 0) > 10, engine.step_counts
    finally:
        engine.close()


@pytest.mark.parametrize("kind", ["glm4_moe", "deepseek_v3"])
def test_moe_engine_with_two_ranks_matches_one(tiny_model, kind):
    """A mixture-of-experts engine over two ranks (experts split, GLM-4.5's / DeepSeek-V3's
    grouped routing and shared experts; DeepSeek's latent attention split by heads): the
    same greedy tokens and the same routed experts (recorded by rank 0, whose router is
    the replicated one) as one rank."""
    import io

    path = tiny_model(kind)
    prompts = random_prompts(4, 6, 30, seed=5)

    def run(engine):
        res = engine.generate([request(str(i), p, max_tokens=8, ignore_eos=True) for i, p in enumerate(prompts)])
        outs = [res[str(i)][0] for i in range(len(prompts))]
        return ([o.token_ids for o in outs],
                [np.load(io.BytesIO(o.routed_experts), allow_pickle=False) for o in outs])

    one = make_engine(path, enable_return_routed_experts=True)
    try:
        ids_one, routes_one = run(one)
    finally:
        one.close()
    two = make_engine(path, enable_return_routed_experts=True, tensor_parallel_size=2)
    try:
        assert two.model.layers[1].moe.w13.shape[1] == one.model.layers[1].moe.w13.shape[1] // 2
        ids_two, routes_two = run(two)
    finally:
        two.close()
    assert ids_two == ids_one
    for a, b in zip(routes_two, routes_one):
        np.testing.assert_array_equal(a, b)


def test_gemma3_image_text_checkpoint_shards_as_its_language_model(tiny_model):
    """Gemma 3's image-text checkpoints (the released 4B-27B) under tensor parallelism:
    refused with the way out named; with --limit-mm-per-prompt '{"image": 0}' (vLLM's
    flag) the vision tower is not loaded, the language model shards, text gives the
    single-rank engine's tokens and image input is refused."""
    from common.errors import BadRequest
    from common.protocol import MultiModalItem

    path = tiny_model("gemma3_mm")
    with pytest.raises(ValueError, match=r"tensor parallelism of vision-language models is not implemented.*"
                                         r"--limit-mm-per-prompt"):
        make_engine(path, tensor_parallel_size=2)
    prompts = random_prompts(3, 5, 30, seed=23)

    def greedy(engine):
        return greedy_ids(engine, prompts, 8)

    one = make_engine(path)
    try:
        assert one.model.vision is not None
        want = greedy(one)
    finally:
        one.close()
    two = make_engine(path, tensor_parallel_size=2, limit_mm_per_prompt={"image": 0})
    try:
        assert two.model.vision is None and not two.model_config.is_multimodal
        assert greedy(two) == want
        image = request("img", [5, 6, 7], max_tokens=2)
        image.mm_items = [MultiModalItem(modality="image", mm_hash="h", offset=0, length=1, grid_thw=[1, 1, 1],
                                         pixel_values=b"\0" * 3, shape=[1, 1, 3])]
        with pytest.raises(BadRequest, match="does not accept image input"):
            two.add_request(image)
    finally:
        two.close()


def test_idle_followers_outlive_the_step_timeout(tiny_model, monkeypatch):
    """Between steps followers wait on the control group, not under the step collectives'
    timeout: an idle server longer than that timeout still serves."""
    import time

    monkeypatch.setenv("TOKSERVE_TP_STEP_TIMEOUT_S", "2")  # read by the spawned follower at import
    path = tiny_model("llama")
    engine = make_engine(path, tensor_parallel_size=2)
    try:
        first = engine.generate([request("a", [5, 6, 7], max_tokens=3, ignore_eos=True)])["a"][0].token_ids
        time.sleep(4)
        again = engine.generate([request("b", [5, 6, 7], max_tokens=3, ignore_eos=True)])["b"][0].token_ids
        assert again == first and all(p.is_alive() for p in engine.tp_leader.procs)
    finally:
        engine.close()


@pytest.mark.parametrize("fmt", ["awq", "awq_g64", "gptq_act_order", "fp8_block", "gptq_moe"])
def test_quantized_checkpoint_over_two_ranks(tiny_model, tmp_path, fmt):
    """Quantized checkpoints (issue 43) over two ranks on CPU: each rank dequantizes the
    layers it reads and takes its shard of the dense weight (column-parallel rows,
    row-parallel columns, experts), so the scales and packed integers never need slicing
    at group or block edges; the greedy tokens equal one rank's and the dequantized HF
    reference's.  int4 checkpoints stay int4 on CPU under TP too: each rank cuts the
    scales and zero points to its rows (q/k/v, gate/up) or whole groups of its columns
    (o, down) before packing its shard."""
    from tests.support import quantized_factory as qf

    src = tiny_model("mixtral" if fmt == "gptq_moe" else "llama")
    if fmt.startswith("awq"):
        path, dense = qf.write_awq(src, tmp_path / fmt, group=64 if fmt == "awq_g64" else 32)
    elif fmt == "fp8_block":
        path, dense = qf.write_fp8_block(src, tmp_path / fmt), None
    else:
        path, dense = qf.write_gptq(src, tmp_path / fmt, sym=fmt == "gptq_moe", act_order=fmt == "gptq_act_order")
    ref = qf.load_dequantized_reference(path) if dense is None else qf.reference_with_weights(src, dense)
    prompts = random_prompts(3, 5, 30, seed=21)

    def greedy(engine):
        return greedy_ids(engine, prompts, 8, close=True)

    one = greedy(make_engine(path))
    assert one == [qf.greedy(ref, p, 8) for p in prompts]
    two = make_engine(path, tensor_parallel_size=2)
    if fmt in ("awq", "gptq_moe"):  # int4 stays int4 on CPU, each rank holding its shard's nibbles and scales
        from worker.engine.quantization.kept import CpuInt4Weight

        layer = two.model.layers[0]
        assert all(isinstance(getattr(layer, n), CpuInt4Weight) for n in layer._LINEAR_WEIGHTS)
        cfg = two.model.config
        assert tuple(layer.o_weight.shape) == (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim // 2)
        if fmt == "gptq_moe":  # every expert int4 too, each rank its half of the intermediate rows / columns
            w13, w2 = layer.moe.w13[0], layer.moe.w2[0]
            assert isinstance(w13, CpuInt4Weight) and tuple(w13.shape) == (cfg.intermediate_size, cfg.hidden_size)
            assert isinstance(w2, CpuInt4Weight) and tuple(w2.shape) == (cfg.hidden_size, cfg.intermediate_size // 2)
    if fmt == "awq_g64":  # o_proj's 64 columns split 32 + 32 inside a 64-column group: that layer stays dense
        from worker.engine.quantization.kept import CpuInt4Weight

        layer = two.model.layers[0]
        assert not isinstance(layer.o_weight, CpuInt4Weight) and isinstance(layer.down_weight, CpuInt4Weight)
    if fmt == "gptq_act_order":  # column-parallel rows keep their act-order; o/down split the input: dense
        from worker.engine.quantization.kept import CpuInt4Weight

        layer = two.model.layers[0]
        assert isinstance(layer.qkv_weight, CpuInt4Weight) and layer.qkv_weight.perm is not None
        assert isinstance(layer.gate_up_weight, CpuInt4Weight)
        assert not isinstance(layer.o_weight, CpuInt4Weight) and not isinstance(layer.down_weight, CpuInt4Weight)
    assert greedy(two) == one


def test_unshardable_sizes_are_refused_before_starting(tiny_model):
    with pytest.raises(ValueError, match="must divide num_attention_heads 4"):
        make_engine(tiny_model("llama"), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(model="x", tensor_parallel_size=0)


def _children(pid: int) -> list[int]:
    """Descendant process ids (from /proc: no psutil here)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in parents.items() if p in frontier]
        found += kids
        frontier = kids
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_tensor_parallel_worker_is_one_broker_peer(tiny_model, tmp_path):
    """A real `tokserve worker --tensor-parallel-size 2` behind a real broker: one
    registered worker, outputs equal to the in-process TP=1 engine, and its follower
    rank stops with it."""
    from common.client import Client
    from common.protocol import GenerateRequest, SamplingParams
    from tests.support.procs import ProcGroup, wait_for, wait_for_workers

    path = tiny_model("qwen3")
    prompt = [5, 6, 7, 8, 9, 10]
    ref = make_engine(path).generate([request("r", prompt, max_tokens=8, ignore_eos=True)])["r"][0].token_ids
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker()
        worker = procs.worker(broker, 0, "--model", str(path), "--threads", "1", "--num-kv-blocks", "64",
                              "--tensor-parallel-size", "2")
        info = wait_for_workers(broker.frontend, 1, timeout=120)
        assert len(info.workers) == 1
        followers = _children(worker.pid)
        assert followers, "the follower rank runs as a child of the worker"
        with Client(broker.frontend) as client:
            req = GenerateRequest(request_id="tp", prompt_token_ids=prompt,
                                  params=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            assert [t for d in client.generate(req) for t in d.token_ids] == ref
        worker.terminate()
        wait_for(lambda: not any(_running(p) for p in followers), 20, "follower ranks exit with their worker")
        # A worker killed outright leaves no orphan rank: its broken process group ends it.
        worker = procs.worker(broker, 1, "--model", str(path), "--threads", "1", "--num-kv-blocks", "64",
                              "--tensor-parallel-size", "2")
        wait_for_workers(broker.frontend, 1, timeout=120, ranks={1})
        followers = _children(worker.pid)
        assert followers
        worker.kill9()
        wait_for(lambda: not any(_running(p) for p in followers), 60, "follower ranks exit after a kill -9")
