"""Shared helpers of the engine tests: building engines and requests, and the
transformers greedy reference."""
from __future__ import annotations

import random
import torch

from common.protocol import GenerateRequest, SamplingParams
from worker.engine import Engine, EngineConfig

_hf_cache: dict = {}


def make_engine(model_dir, **overrides) -> Engine:
    # float32 unless a test asks otherwise: the HF parity references run in float32
    # (``auto`` would serve these float32 checkpoints in bf16 on a CPU with native bf16).
    kw = dict(model=str(model_dir), max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64,
              num_threads=1, dtype="float32")
    kw.update(overrides)
    return Engine(EngineConfig(**kw))


def request(rid: str, prompt: list[int], **params) -> GenerateRequest:
    extra = {k: params.pop(k) for k in ("priority", "cache_salt", "output_text", "kv_transfer_params")
             if k in params}
    params.setdefault("temperature", 0.0)
    return GenerateRequest(request_id=rid, prompt_token_ids=list(prompt), params=SamplingParams(**params), **extra)


def greedy_ids(engine: Engine, prompts: list[list[int]], max_tokens: int, close: bool = False) -> list[list[int]]:
    """Each prompt's greedy output ids (``ignore_eos``) through ``engine.generate``; the
    engine closed afterwards when ``close``, even when it fails."""
    try:
        res = engine.generate([request(str(i), p, max_tokens=max_tokens, ignore_eos=True)
                               for i, p in enumerate(prompts)])
    finally:
        if close:
            engine.close()
    return [list(res[str(i)][0].token_ids) for i in range(len(prompts))]


def random_prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def hf_model(model_dir):
    from tests.support.model_factory import load_hf_model

    key = str(model_dir)
    if key not in _hf_cache:
        _hf_cache[key] = load_hf_model(model_dir)
    return _hf_cache[key]


@torch.inference_mode()
def hf_greedy(model_dir, prompt: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation by full forward passes (no EOS handling) and the
    log-softmax row each token was chosen from."""
    model = hf_model(model_dir)
    ids = list(prompt)
    rows = []
    for _ in range(num_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        lp = torch.log_softmax(logits, dim=-1)
        rows.append(lp)
        ids.append(int(lp.argmax()))
    return ids[len(prompt):], rows


@torch.inference_mode()
def hf_router_choices(model_dir, ids: list[int], router_name: str) -> "np.ndarray":
    """``[len(ids), moe layers, top_k]``: the experts HF's routers (``layer.mlp.<router_name>``,
    whose output's third item holds the chosen experts) chose for each token, sorted."""
    import numpy as np

    model = hf_model(model_dir)
    seen = []
    hooks = [getattr(layer.mlp, router_name).register_forward_hook(lambda m, i, out: seen.append(out[2]))
             for layer in model.model.layers if hasattr(layer.mlp, router_name)]
    try:
        model(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return np.stack([s.sort(-1).values.numpy() for s in seen], axis=1)


def assert_routed_experts_equal_hf(model_dir, router_name: str, moe_layers: int, top_k: int) -> None:
    """An engine with routed-experts capture serves three prompts (chunked prefill, 6
    decoded tokens): each choice's routed experts ``[positions, moe_layers, top_k]`` equal
    the experts HF's routers chose (``hf_router_choices``) at every position it ran."""
    import io

    import numpy as np

    engine = make_engine(model_dir, enable_return_routed_experts=True, max_num_batched_tokens=16)
    prompts = random_prompts(3, 10, 40, seed=11)
    res = engine.generate([request(f"r{i}", p, max_tokens=6, ignore_eos=True) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        (d,) = res[f"r{i}"]
        got = np.load(io.BytesIO(d.routed_experts), allow_pickle=False)
        full = list(p) + list(d.token_ids)
        assert got.shape == (len(full) - 1, moe_layers, top_k)
        np.testing.assert_array_equal(np.sort(got, axis=-1), hf_router_choices(model_dir, full[:-1], router_name))


@torch.inference_mode()
def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """[L-1, V]: row i is the distribution that scores prompt token i+1."""
    logits = hf_model(model_dir)(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def run_to_completion(engine: Engine, max_steps: int = 10_000) -> dict:
    """Step until idle; collect every delta per (request_id, index)."""
    out: dict = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return out
        for d in engine.step():
            out.setdefault((d.request_id, d.index), []).append(d)
    raise AssertionError("engine did not finish")


def tokens_of(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def outputs(engine: Engine, reqs) -> dict[str, list[list[int]]]:
    res = engine.generate(reqs)
    return {rid: [d.token_ids for d in ds] for rid, ds in res.items()}
