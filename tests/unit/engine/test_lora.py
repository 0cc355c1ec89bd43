"""Multi-LoRA in the engine against transformers + peft: greedy ids and logprobs per
target-module set, a mixed batch of adapters and base rows, slot eviction, the
prefix cache keyed by adapter registration, and what is refused."""
from __future__ import annotations

import pytest
import torch

from common.errors import NotFound
from tests.support.engine_helpers import (hf_greedy, hf_prompt_logprobs, make_engine, random_prompts, request,
                                  run_to_completion, tokens_of)
from tests.support.lora_factory import ATTENTION, MLP, build_adapter, edit_adapter_config, peft_greedy
from worker.engine.lora.manager import LoRAError

pytest.importorskip("peft")

TARGETS = {"qv": ["q_proj", "v_proj"], "attention": ATTENTION, "mlp": MLP, "all": ATTENTION + MLP,
           "embed_head": ["embed_tokens", "lm_head", "q_proj"]}
# Per-module ranks and alphas, and an adapter on one layer only.
CONFIGS = {"patterns": {"rank_pattern": {"k_proj": 12, "model.layers.1.mlp.down_proj": 2},
                        "alpha_pattern": {"o_proj": 3, "up_proj": 40}},
           "layer0": {"layers_to_transform": [0]}}


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    out = {name: build_adapter(llama_dir, root / name, t, rank=4 + 2 * i, alpha=8 + i, seed=i,
                               use_rslora=name == "mlp")
           for i, (name, t) in enumerate(TARGETS.items())}
    for i, (name, config) in enumerate(CONFIGS.items()):
        out[name] = build_adapter(llama_dir, root / name, ATTENTION + MLP, rank=6, alpha=9, seed=10 + i, **config)
    return out


def _lora_request(rid, prompt, adapter, **params):
    r = request(rid, prompt, **params)
    r.lora_name = adapter
    return r


def _run(engine, reqs, stagger=0):
    """Adds the requests (``stagger`` steps apart) and steps until all finished."""
    out: dict = {}
    pending = list(reqs)
    while pending or engine.has_unfinished():
        if pending:
            engine.add_request(pending.pop(0))
        for _ in range(stagger if pending else 10_000):
            if not engine.has_unfinished():
                break
            for d in engine.step():
                out.setdefault(d.request_id, []).append(d)
    return out


@pytest.fixture(scope="module")
def engine(llama_dir, adapters):
    return make_engine(llama_dir, enable_lora=True, max_loras=4, max_lora_rank=16,
                       lora_modules={k: str(v) for k, v in adapters.items()})


@pytest.mark.parametrize("target", list(TARGETS) + list(CONFIGS))
def test_greedy_ids_and_logprobs_equal_peft(engine, llama_dir, adapters, target):
    prompt = random_prompts(1, 9, 14, seed=3)[0]
    out = _run(engine, [_lora_request("r", prompt, target, max_tokens=8, logprobs=2)])
    ids, rows = peft_greedy(llama_dir, adapters[target], prompt, 8)
    assert tokens_of(out["r"]) == ids
    got = [lp for d in out["r"] for lp in d.logprobs.logprobs]
    want = [float(row[t]) for row, t in zip(rows, ids)]
    assert got == pytest.approx(want, abs=1e-4)
    assert ids != hf_greedy(llama_dir, prompt, 8)[0]  # the adapter changes the output


def test_mixed_batch_equals_each_alone(engine, llama_dir, adapters):
    prompts = random_prompts(8, 5, 30, seed=7)
    names = ["qv", "embed_head", "all", None, "patterns", "attention", None, "embed_head"]
    reqs = [_lora_request(f"m{i}", p, n, max_tokens=6) for i, (p, n) in enumerate(zip(prompts, names))]
    together = _run(engine, reqs, stagger=1)
    for i, (p, n) in enumerate(zip(prompts, names)):
        want = peft_greedy(llama_dir, adapters[n], p, 6)[0] if n else hf_greedy(llama_dir, p, 6)[0]
        assert tokens_of(together[f"m{i}"]) == want, (i, n)


def test_load_reports_adapters_of_running_and_waiting_requests(llama_dir, adapters):
    engine = make_engine(llama_dir, enable_lora=True, max_loras=1, max_lora_rank=16,
                         lora_modules={k: str(adapters[k]) for k in ("qv", "mlp")})
    prompt = random_prompts(1, 5, 6, seed=2)[0]
    for i, name in enumerate(["qv", "mlp", None]):
        engine.add_request(_lora_request(f"w{i}", prompt, name, max_tokens=4))
    engine.step()  # one slot: mlp waits until qv's request is done
    load = engine.load()
    assert (load.running_loras, load.waiting_loras, load.max_loras) == (["qv"], ["mlp"], 1)
    assert load.resident_loras == ["qv"]
    run_to_completion(engine)
    assert engine.load().running_loras == engine.load().waiting_loras == []


def test_two_slots_four_adapters_in_rotation(llama_dir, adapters):
    engine = make_engine(llama_dir, enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=16,
                         lora_modules={k: str(v) for k, v in adapters.items()})
    names = list(TARGETS) * 2
    prompts = random_prompts(len(names), 5, 20, seed=11)
    reqs = [_lora_request(f"e{i}", p, n, max_tokens=5) for i, (p, n) in enumerate(zip(prompts, names))]
    out = _run(engine, reqs, stagger=1)
    for i, (p, n) in enumerate(zip(prompts, names)):
        assert tokens_of(out[f"e{i}"]) == peft_greedy(llama_dir, adapters[n], p, 5)[0], (i, n)
    assert len(engine.lora.manager.resident) <= 2


def test_prefix_cache_is_keyed_by_adapter(engine, llama_dir, adapters):
    prompt = random_prompts(1, 40, 41, seed=5)[0]
    first = _run(engine, [_lora_request("p1", prompt, "qv", max_tokens=3)])
    same = _run(engine, [_lora_request("p2", prompt, "qv", max_tokens=3)])
    other = _run(engine, [_lora_request("p3", prompt, "all", max_tokens=3)])
    base = _run(engine, [request("p4", prompt, max_tokens=3)])
    assert first["p1"][0].num_cached_tokens == 0
    assert same["p2"][0].num_cached_tokens > 0
    assert other["p3"][0].num_cached_tokens == 0 and base["p4"][0].num_cached_tokens == 0
    assert tokens_of(other["p3"]) == peft_greedy(llama_dir, adapters["all"], prompt, 3)[0]
    assert tokens_of(base["p4"]) == hf_greedy(llama_dir, prompt, 3)[0]


def test_runtime_load_unload_and_reload_under_the_same_name(llama_dir, adapters):
    engine = make_engine(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=16)
    prompt = random_prompts(1, 33, 34, seed=9)[0]
    engine.lora.load("x", str(adapters["qv"]))
    with pytest.raises(LoRAError, match="already been loaded"):
        engine.lora.load("x", str(adapters["all"]))
    engine.add_request(_lora_request("long", prompt, "x", max_tokens=12))
    first = engine.step()
    engine.lora.unload("x")  # the running request keeps its adapter
    with pytest.raises(NotFound):
        engine.add_request(_lora_request("late", prompt, "x", max_tokens=2))
    out = run_to_completion(engine)
    assert tokens_of(first + out[("long", 0)]) == peft_greedy(llama_dir, adapters["qv"], prompt, 12)[0]
    with pytest.raises(LoRAError, match="cannot be found") as e:
        engine.lora.unload("x")
    assert e.value.status == 404
    engine.lora.load("x", str(adapters["all"]))  # same name, other weights: no stale KV
    out = _run(engine, [_lora_request("again", prompt, "x", max_tokens=4)])
    assert out["again"][0].num_cached_tokens == 0
    assert tokens_of(out["again"]) == peft_greedy(llama_dir, adapters["all"], prompt, 4)[0]


def test_refusals_name_the_problem(llama_dir, adapters, tmp_path, tiny_model):
    engine = make_engine(llama_dir, enable_lora=True, max_loras=1, max_lora_rank=4)
    src = adapters["qv"]
    a = torch.ones(4, 64)
    q_proj = "base_model.model.model.layers.0.self_attn.q_proj"
    cases = {
        "dora": ({"use_dora": True}, "DoRA"),
        "bias": ({"bias": "all"}, "bias"),
        "lora_bias": ({"lora_bias": True}, "lora_bias"),
        "saved": ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        "rank": ({"r": 64}, "max-lora-rank"),
        "pattern_rank": ({"rank_pattern": {"q_proj": 8}}, "rank 8 is greater than --max-lora-rank 4"),
        "pissa": ({"init_lora_weights": "pissa"}, "pissa"),
        "alora": ({"alora_invocation_tokens": [5, 6]}, "alora"),
        "tokens": ({"trainable_token_indices": [1, 2]}, "trainable_token_indices"),
        "other_base": ({"tensors": {f"{q_proj}.lora_A.weight": torch.ones(4, 32),
                                    f"{q_proj}.lora_B.weight": a.T.contiguous()}},
                       r"layer 0 q_proj has A \(4, 32\).*another base model"),
        "classifier": ({"tensors": {"base_model.model.score.lora_A.weight": a,
                                    "base_model.model.score.lora_B.weight": a.T.contiguous()}}, "score"),
        "half": ({"tensors": {"base_model.model.model.layers.1.mlp.up_proj.lora_A.weight": a}}, "lacks lora_B"),
        "deep": ({"tensors": {"base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": a,
                              "base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight": a.T.contiguous()}},
                 "2 layers"),
        "not_json": ({"tensors": {}}, "holds no LoRA weights"),
    }
    for name, (changes, needle) in cases.items():
        with pytest.raises(LoRAError, match=needle) as e:
            engine.lora.load(name, str(edit_adapter_config(src, tmp_path / name, **changes)))
        assert e.value.status == 400 and e.value.type == "BadRequestError", name
    with pytest.raises(LoRAError, match="Loading lora missing failed: No adapter found for") as e:
        engine.lora.load("missing", str(tmp_path / "nowhere"))
    assert e.value.status == 404
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoRAError, match="adapter_config.json"):
        engine.lora.load("empty", str(tmp_path / "empty"))
    with pytest.raises(LoRAError, match="already been loaded") as e:
        engine.lora.load("ok", str(src))
        engine.lora.load("ok", str(src))
    assert e.value.type == "InvalidUserInput"
    engine.lora.unload("ok")
    with pytest.raises(LoRAError, match="max-lora-rank"):  # rank 4 adapter is fine, rank 6 is not
        engine.lora.load("big", str(adapters["attention"]))
    engine.lora.load("ok", str(src))
    assert engine.lora.adapters() == {"ok": str(src)}
    no_lora = make_engine(llama_dir)
    with pytest.raises(NotFound):
        no_lora.add_request(_lora_request("n", [5, 6, 7], "ok", max_tokens=2))


def test_moe_expert_lora_is_refused(tiny_model, tmp_path):
    moe = tiny_model("mixtral")
    ad = build_adapter(moe, tmp_path / "moe-attn", ["q_proj", "o_proj"], rank=4)
    engine = make_engine(moe, enable_lora=True, max_lora_rank=8)
    a = torch.ones(4, 64)
    for name, module in (("experts", "mlp.experts.0.w1"), ("block", "block_sparse_moe.experts.1.w2"),
                         ("router", "mlp.gate")):
        tensors = {f"base_model.model.model.layers.0.{module}.lora_A.weight": a,
                   f"base_model.model.model.layers.0.{module}.lora_B.weight": a.T.contiguous()}
        with pytest.raises(LoRAError, match="not supported|not a LoRA weight of a module this server supports"):
            engine.lora.load(name, str(edit_adapter_config(ad, tmp_path / name, tensors=tensors)))
    engine.lora.load("attn", str(ad))  # attention LoRA on a MoE model is served
    prompt = [5, 9, 13, 21, 34]
    out = _run(engine, [_lora_request("q", prompt, "attn", max_tokens=4)])
    assert tokens_of(out["q"]) == peft_greedy(moe, ad, prompt, 4)[0]


def test_lora_flags_are_checked():
    from worker.engine.config import EngineConfig

    with pytest.raises(ValueError, match="needs --enable-lora"):
        EngineConfig(model="m", lora_modules={"a": "/x"})
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(model="m", enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="tensor-parallel"):
        EngineConfig(model="m", enable_lora=True, tensor_parallel_size=2)


def test_level_two_sleep_releases_the_model_and_wake_up_keeps_the_adapters(llama_dir, adapters):
    import gc
    import weakref

    engine = make_engine(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=16,
                         lora_modules={"all": str(adapters["all"]), "embed_head": str(adapters["embed_head"])})
    prompt = random_prompts(1, 6, 7, seed=12)[0]
    before = _run(engine, [_lora_request("s1", prompt, "embed_head", max_tokens=4, ignore_eos=True)])
    old = weakref.ref(engine.model)
    engine.rl.sleep(2)
    gc.collect()
    assert old() is None  # the LoRA slots do not keep the released weights alive
    assert engine.rl.wake_up()
    after = _run(engine, [_lora_request("s2", prompt, "embed_head", max_tokens=4, ignore_eos=True),
                          _lora_request("s3", prompt, "all", max_tokens=4, ignore_eos=True)])
    assert tokens_of(after["s2"]) == tokens_of(before["s1"]) == \
        peft_greedy(llama_dir, adapters["embed_head"], prompt, 4)[0]
    assert tokens_of(after["s3"]) == peft_greedy(llama_dir, adapters["all"], prompt, 4)[0]


def test_prompt_logprobs_of_adapter_rows_equal_peft(engine, llama_dir, adapters):
    """Prompt positions scored over chunks beside a base row: the head's LoRA is applied
    to exactly the adapter request's logits rows."""
    from tests.support.lora_factory import peft_model

    prompt = random_prompts(1, 90, 91, seed=14)[0]
    out = _run(engine, [_lora_request("lp", prompt, "embed_head", max_tokens=2, prompt_logprobs=1),
                        request("base", prompt[:30], max_tokens=2, prompt_logprobs=1)])
    with torch.inference_mode():
        logits = peft_model(llama_dir, adapters["embed_head"])(input_ids=torch.tensor([prompt])).logits[0, :-1]
    ref = torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    got = [lp for d in out["lp"] if d.prompt_logprobs is not None for lp in d.prompt_logprobs.logprobs]
    assert got == pytest.approx(ref.tolist(), abs=1e-4)
    base_ref = hf_prompt_logprobs(llama_dir, prompt[:30]).gather(1, torch.tensor(prompt[1:30])[:, None])[:, 0]
    base = [lp for d in out["base"] if d.prompt_logprobs is not None for lp in d.prompt_logprobs.logprobs]
    assert base == pytest.approx(base_ref.tolist(), abs=1e-4)


def test_vanished_adapter_files_fail_only_new_requests(llama_dir, adapters, tmp_path):
    """Host copies beyond --max-cpu-loras are re-read when a request arrives (and kept
    while it runs): deleted files fail that request at once with vLLM's 404, never a
    step, and a running request's adapter is never re-read."""
    import shutil

    copies = {n: shutil.copytree(adapters[n], tmp_path / n) for n in ("qv", "mlp", "all")}
    engine = make_engine(llama_dir, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=16,
                         lora_modules={n: str(p) for n, p in copies.items()})  # host cache: "all" only
    prompt = random_prompts(1, 6, 7, seed=15)[0]
    engine.add_request(_lora_request("keep", prompt, "mlp", max_tokens=6, ignore_eos=True))  # read, pinned
    shutil.rmtree(copies["mlp"])
    shutil.rmtree(copies["qv"])
    with pytest.raises(LoRAError, match="Loading lora qv failed: No adapter found") as e:
        engine.add_request(_lora_request("gone", prompt, "qv", max_tokens=2))
    assert e.value.status == 404 and "gone" not in engine.requests
    engine.add_request(_lora_request("other", prompt, "all", max_tokens=6, ignore_eos=True))
    out = run_to_completion(engine)
    assert tokens_of(out[("keep", 0)]) == peft_greedy(llama_dir, adapters["mlp"], prompt, 6)[0]
    assert tokens_of(out[("other", 0)]) == peft_greedy(llama_dir, adapters["all"], prompt, 6)[0]
    assert not engine.lora.manager._pins and len(engine.lora.manager._host) == 1  # unpinned, trimmed back to --max-cpu-loras
