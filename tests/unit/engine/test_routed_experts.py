"""routed_experts (rollout routing replay) in the engine: every prompt and output
position the model ran, equal to HF's router top-k; per choice for n > 1; unchanged
by chunked prefill, preemption and prefix-cache hits; routed_experts_prompt_start."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from common.errors import BadRequest
from tests.support.engine_helpers import hf_model, make_engine, random_prompts, request
from tests.support.model_factory import MOE_KINDS


def decode(blob: bytes) -> np.ndarray:
    return np.load(io.BytesIO(blob), allow_pickle=False)


@torch.inference_mode()
def hf_routing(model_dir, ids: list[int], top_k: int = 2) -> np.ndarray:
    """[len(ids), moe layers, top_k]: HF's router top-k (output_router_logits), in the
    router's own order (descending probability)."""
    out = hf_model(model_dir)(torch.tensor([ids]), output_router_logits=True)
    return np.stack([logits.float().topk(top_k, dim=-1).indices.numpy() for logits in out.router_logits], axis=1)


def check_choice(model_dir, prompt, delta, start: int = 0):
    got = decode(delta.routed_experts)
    full = list(prompt) + list(delta.token_ids)
    ref = hf_routing(model_dir, full[:-1])  # the last sampled token never ran
    assert got.dtype == np.uint8 and got.shape == (len(full) - 1 - start, ref.shape[1], 2)
    np.testing.assert_array_equal(got, ref[start:])


@pytest.fixture(scope="module")
def engines(tiny_model):
    made = {}

    def get(kind, **kw):
        key = (kind, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = make_engine(tiny_model(kind), enable_return_routed_experts=True, **kw)
        return made[key]

    return get


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_prompt_and_output_positions_equal_hf_router(tiny_model, engines, kind):
    engine = engines(kind)
    prompts = random_prompts(3, 5, 40, seed=11)
    res = engine.generate([request(f"r{i}", p, max_tokens=7, ignore_eos=True) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        (d,) = res[f"r{i}"]
        check_choice(tiny_model(kind), p, d)


def test_each_of_n_choices_gets_its_own(tiny_model, engines):
    engine = engines("qwen3_moe")
    prompt = random_prompts(1, 21, 22, seed=2)[0]  # a partial last block: children recompute it
    (res,) = engine.generate([request("n", prompt, n=3, temperature=1.0, seed=5, max_tokens=6,
                                      ignore_eos=True)]).values()
    assert len(res) == 3 and len({tuple(d.token_ids) for d in res}) > 1
    for d in res:
        check_choice(tiny_model("qwen3_moe"), prompt, d)


def test_chunked_prefill_and_preemption_do_not_change_it(tiny_model, engines):
    path = tiny_model("mixtral")
    prompts = random_prompts(6, 20, 60, seed=4)
    reqs = lambda: [request(f"p{i}", p, max_tokens=10, ignore_eos=True) for i, p in enumerate(prompts)]
    roomy = engines("mixtral").generate(reqs())
    # 16-token steps chunk the prompts; 10 blocks of 8 cannot hold the six sequences as
    # they grow: preemption by recompute.
    tight = make_engine(path, enable_return_routed_experts=True, max_num_batched_tokens=16, num_kv_blocks=10,
                        block_size=8, max_model_len=80, enable_prefix_caching=False)
    squeezed = tight.generate(reqs())
    assert tight.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts):
        (a,), (b,) = roomy[f"p{i}"], squeezed[f"p{i}"]
        assert a.token_ids == b.token_ids
        np.testing.assert_array_equal(decode(a.routed_experts), decode(b.routed_experts))
        check_choice(path, p, b)


def test_prefix_cache_hits_return_the_cached_tokens_routing(tiny_model, engines):
    engine = engines("qwen2_moe")
    prompt = random_prompts(1, 50, 51, seed=8)[0]
    (first,) = engine.generate([request("c1", prompt, max_tokens=4, ignore_eos=True)])["c1"]
    (second,) = engine.generate([request("c2", prompt + [7, 8], max_tokens=4, ignore_eos=True)])["c2"]
    assert second.num_cached_tokens >= 48  # three full blocks came from the cache
    check_choice(tiny_model("qwen2_moe"), prompt + [7, 8], second)
    np.testing.assert_array_equal(decode(second.routed_experts)[:48], decode(first.routed_experts)[:48])


def test_prompt_start_skips_leading_prompt_rows(tiny_model, engines):
    engine = engines("qwen3_moe")
    prompt = random_prompts(1, 30, 31, seed=3)[0]
    (d,) = engine.generate([request("s", prompt, max_tokens=5, ignore_eos=True,
                                    routed_experts_prompt_start=12)])["s"]
    check_choice(tiny_model("qwen3_moe"), prompt, d, start=12)
    (whole,) = engine.generate([request("w", prompt, max_tokens=1, routed_experts_prompt_start=len(prompt))])["w"]
    assert decode(whole.routed_experts).shape == (0, 2, 2)  # one token sampled: no output position ran
    with pytest.raises(BadRequest, match=r"routed_experts_prompt_start must be between 0 and the prompt length "
                                         r"\(30\), inclusive"):
        engine.add_request(request("bad", prompt, routed_experts_prompt_start=31))


def test_only_the_finishing_delta_carries_it(engines):
    engine = engines("mixtral")
    engine.add_request(request("st", [5, 6, 7, 8], max_tokens=4, ignore_eos=True))
    deltas = []
    while engine.has_unfinished():
        deltas.extend(engine.step())
    assert [d.routed_experts is not None for d in deltas] == [False, False, False, True]
    assert decode(deltas[-1].routed_experts).shape == (7, 2, 2)


def test_abort_returns_what_ran(engines):
    engine = engines("mixtral")
    engine.add_request(request("ab", list(range(10, 40)), max_tokens=50, ignore_eos=True))
    sampled = [t for _ in range(3) for d in engine.step() for t in d.token_ids]
    (d,) = engine.abort("ab")
    arr = decode(d.routed_experts)
    assert d.finish_reason == "abort" and len(sampled) == 3
    assert arr.shape[0] == 30 + len(sampled) - 1  # prompt + every output but the last
    engine.add_request(request("ab2", list(range(10, 40)), max_tokens=5))
    (early,) = engine.abort("ab2")  # never scheduled: nothing ran
    assert early.routed_experts is None


def test_off_by_default(tiny_model):
    engine = make_engine(tiny_model("mixtral"))
    (d,) = engine.generate([request("x", [1, 2, 3], max_tokens=3)])["x"]
    assert d.routed_experts is None and d.sampling_mask is None
    assert engine.runner.routing_store is None
