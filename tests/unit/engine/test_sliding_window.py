"""Sliding-window attention (Mistral, Qwen2 with use_sliding_window): which layers use
a window, and HF parity on prompts longer than the window through every CPU backend,
prefill chunks with cached context, decode steps and the engine."""
from __future__ import annotations

import pytest

from tests.support.engine_helpers import hf_greedy, make_engine, random_prompts, request
from tests.support.model_factory import load_hf_model
from tests.unit.engine.test_model import ATOL, PagedSeqs, _tokens, hf_logits
from worker.engine.attention.backends.cpu_native import CpuNativeBackend
from worker.engine.attention.backends.torch_sdpa import TorchSDPABackend
from worker.engine.kernels import load_cpu_kernels
from worker.engine.loading.loader import load_model
from worker.engine.models.config import ModelConfig, _layer_sliding_windows


def test_layer_windows_follow_transformers(tiny_model):
    assert ModelConfig.from_dir(tiny_model("mistral_swa")).layer_sliding_windows == (8, 8)
    assert ModelConfig.from_dir(tiny_model("qwen2_swa")).layer_sliding_windows == (None, 6)
    assert ModelConfig.from_dir(tiny_model("mistral")).layer_sliding_windows == (None, None)
    assert ModelConfig.from_dir(tiny_model("qwen2")).layer_sliding_windows == (None, None)
    # Each family's rule (registry switch "sliding"): Qwen2 checkpoints record a window they do
    # not use unless use_sliding_window is set; SmolLM3 ("gated") likewise for its layer_types.
    assert _layer_sliding_windows({"sliding_window": 4, "layer_types": ["sliding_attention"]}, "gated", 1) == (None,)
    assert _layer_sliding_windows({"sliding_window": 4, "use_sliding_window": True,
                                   "layer_types": ["sliding_attention"]}, "gated", 1) == (4,)
    assert _layer_sliding_windows({"sliding_window": 4}, "all", 2) == (4, 4)
    assert _layer_sliding_windows({"sliding_window": 4}, None, 2) == (None, None)
    assert _layer_sliding_windows({"sliding_window": 4096}, "qwen", 3) == (None,) * 3
    assert _layer_sliding_windows({"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
                                  None, 2) == (4, None)
    with pytest.raises(ValueError, match="Unsupported layer_types"):
        _layer_sliding_windows({"sliding_window": 4, "layer_types": ["chunked_attention"]}, "all", 1)


def _backends():
    yield "torch", TorchSDPABackend()
    kernels = load_cpu_kernels()
    if kernels is not None:
        yield "native", CpuNativeBackend(kernels)  # windowed layers fall back to SDPA inside it


@pytest.mark.parametrize("kind", ["mistral_swa", "qwen2_swa"])
def test_paged_steps_match_hf_past_the_window(tiny_model, kind):
    path = tiny_model(kind)
    hf = load_hf_model(path)
    ids = _tokens(40, seed=7)  # 5x the window
    other = _tokens(25, seed=8)
    ref, ref_other = hf_logits(hf, ids), hf_logits(hf, other)
    full = hf_logits(hf, ids[:20])
    for name, backend in _backends():
        model = load_model(path)
        model.use_attention_backend(backend)
        seqs = PagedSeqs(model)
        # Fresh prefill beside a longer fresh prefill, then chunks after cached context, then decodes.
        a0, b0 = seqs.step([("a", ids[:20]), ("b", other[:5])])
        assert (a0 - full).abs().max() < ATOL, name
        a1, b1 = seqs.step([("a", ids[20:33]), ("b", other[5:24])])
        assert (a1 - ref[20:33]).abs().max() < ATOL, name
        assert (b1 - ref_other[5:24]).abs().max() < ATOL, name
        for pos in range(33, 40):
            (a,) = seqs.step([("a", [ids[pos]])])
            assert (a[0] - ref[pos]).abs().max() < ATOL, (name, pos)
        (a, b) = seqs.step([("a", [ids[39]]), ("b", [other[24]])])  # mixed decode batch (a repeats a token)
        assert (b[0] - ref_other[24]).abs().max() < ATOL, name


def test_window_changes_the_output(tiny_model):
    """The window matters on these prompts: full attention gives other logits (the
    parity test above could not pass by ignoring it)."""
    path = tiny_model("mistral_swa")
    model = load_model(path)
    for layer in model.layers:
        layer.attn.spec = type(layer.attn.spec)(**{**layer.attn.spec.__dict__, "sliding_window": None})
        layer.attn.set_backend(TorchSDPABackend())
    ids = _tokens(40, seed=7)
    (got,) = PagedSeqs(model).step([("a", ids)])
    ref = hf_logits(load_hf_model(path), ids)
    assert (got[:8] - ref[:8]).abs().max() < ATOL  # inside the window: identical
    assert (got[20:] - ref[20:]).abs().max() > 1e-2


def test_engine_greedy_matches_hf_generate(tiny_model):
    path = tiny_model("mistral_swa")
    engine = make_engine(path, max_num_batched_tokens=16)  # chunked prefill across the window
    prompts = random_prompts(3, 20, 30, seed=4)
    res = engine.generate([request(str(i), p, max_tokens=12, ignore_eos=True) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert res[str(i)][0].token_ids == hf_greedy(path, p, 12)[0]
