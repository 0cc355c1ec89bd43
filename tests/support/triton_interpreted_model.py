"""The model and the engine on the Triton backend, run on CPU tensors by Triton's
interpreter.  Not collected on its own (the kernels must be decorated with
TRITON_INTERPRET=1 set): tests/integration/test_triton_interpreted.py runs this file in a
subprocess with the interpreter on."""
from __future__ import annotations

import os

import pytest

from tests.support.engine_helpers import hf_greedy, make_engine, random_prompts, request
from tests.support.model_factory import load_hf_model
from tests.unit.engine.test_model import PagedSeqs, _tokens, hf_logits
from worker.engine.attention.selector import resolve_attention_backend
from worker.engine.loading.loader import load_model

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")

ATOL = 2e-4  # Triton's online softmax sums in another order than HF's eager attention


def _triton_model(path):
    import torch

    model = load_model(path)
    backend = resolve_attention_backend("triton", "auto", torch.device("cpu"), torch.float32, 4)
    assert backend.name == "triton" and backend.ops is not None
    model.use_attention_backend(backend)
    return model


# + the dense families: Phi-3's partial rotary (the Triton rotary on a head slice) and
# windows, SmolLM3's NoPE layers, OLMo 3's post-norm blocks and local rope, Gemma 3's
# attention scale (query_pre_attn_scalar) through the unified kernel; GPT-OSS's attention
# sinks in the unified kernel (its experts on the grouped torch path); DeepSeek-V3/V2's decode
# rows through the latent decode kernel (mla_decode), their prefill chunks expanded on torch ops.
@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral_swa", "qwen2_moe", "qwen3_moe", "phi3_longrope",
                                  "smollm3_swa", "olmo3", "gemma3", "glm4_moe", "gpt_oss", "deepseek_v3",
                                  "deepseek_v2"])
def test_mixed_steps_match_hf(tiny_model, kind):
    """Fresh prefill, a chunk after cached context beside decode rows, decode-only
    steps: one kernel launch per layer for every row kind, and the Triton RMSNorm,
    rotary, SwiGLU and cache write (and the fused-MoE GEMMs of the expert layers)."""
    path = tiny_model(kind)
    hf, model = load_hf_model(path), _triton_model(path)
    if kind.startswith("deepseek"):  # decode rows through the Triton latent kernel, not torch's
        assert all(layer.latent_attn.decode_kernel is not None for layer in model.layers)
    a, b = _tokens(30, seed=11), _tokens(14, seed=12)
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    seqs = PagedSeqs(model)
    (got,) = seqs.step([("a", a[:17])])
    assert (got - ref_a[:17]).abs().max() < ATOL
    got_a, got_b = seqs.step([("a", a[17:26]), ("b", b[:10])])
    assert (got_a - ref_a[17:26]).abs().max() < ATOL and (got_b - ref_b[:10]).abs().max() < ATOL
    for i in range(4):
        got_a, got_b = seqs.step([("a", [a[26 + i]]), ("b", [b[10 + i]])])
        assert (got_a[0] - ref_a[26 + i]).abs().max() < ATOL
        assert (got_b[0] - ref_b[10 + i]).abs().max() < ATOL


def test_engine_on_triton_matches_hf_greedy(llama_dir):
    engine = make_engine(llama_dir, attention_backend="triton", max_num_batched_tokens=32)
    assert engine.attention_backend.name == "triton"
    prompts = random_prompts(3, 10, 40, seed=3)
    res = engine.generate([request(str(i), p, max_tokens=6, ignore_eos=True) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert res[str(i)][0].token_ids == hf_greedy(llama_dir, p, 6)[0]
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_lora_engine_on_triton_matches_peft(llama_dir, tmp_path):
    """Mixed adapter and base rows through the Triton attention backend, whose LoRA
    products run in the segmented kernels."""
    pytest.importorskip("peft")
    from tests.support.lora_factory import ATTENTION, MLP, build_adapter, peft_greedy

    ads = {"a": build_adapter(llama_dir, tmp_path / "a", ATTENTION + MLP, rank=4, seed=1),
           "b": build_adapter(llama_dir, tmp_path / "b", ["q_proj", "v_proj", "down_proj", "embed_tokens", "lm_head"],
                              rank=8, seed=2)}
    engine = make_engine(llama_dir, attention_backend="triton", max_num_batched_tokens=32, enable_lora=True,
                         max_loras=2, lora_modules={k: str(v) for k, v in ads.items()})
    assert engine.lora.manager.use_triton
    prompts = random_prompts(3, 5, 12, seed=4)
    reqs = []
    for i, (p, name) in enumerate(zip(prompts, ["a", None, "b"])):
        r = request(f"l{i}", p, max_tokens=4)
        r.lora_name = name
        reqs.append(r)
    out = engine.generate(reqs)
    for i, (p, name) in enumerate(zip(prompts, ["a", None, "b"])):
        want = peft_greedy(llama_dir, ads[name], p, 4)[0] if name else hf_greedy(llama_dir, p, 4)[0]
        assert [t for d in out[f"l{i}"] for t in d.token_ids] == want, (i, name)


def test_speculative_decoding_on_triton_equals_plain(llama_dir):
    """Verification rows (the last token plus drafts: a short prefill with context)
    through the Triton attention backend: greedy ids equal plain decoding."""
    prompts = [(p * 3)[:20] for p in random_prompts(2, 4, 8, seed=9)]
    reqs = lambda: [request(str(i), p, max_tokens=6, ignore_eos=True) for i, p in enumerate(prompts)]  # noqa: E731
    plain = make_engine(llama_dir, attention_backend="triton").generate(reqs())
    spec = make_engine(llama_dir, attention_backend="triton", spec_max_step_tokens=0,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                           "prompt_lookup_max": 3})
    got = spec.generate(reqs())
    assert [got[str(i)][0].token_ids for i in range(2)] == [plain[str(i)][0].token_ids for i in range(2)]
    assert sum(sum(got[str(i)][0].spec_decode.histogram[1:]) for i in range(2)) > 0  # drafts were accepted


def test_qwen2_vl_engine_on_triton_matches_hf(tmp_path):
    """Image prompts on the Triton backend: the vision tower's window and full attention
    through the variable-length kernel, M-RoPE rotation rows through the Triton rotary,
    image embeddings scattered into the prefill (chunked across an image), decode on
    delta-shifted positions beside a text request."""
    pytest.importorskip("transformers")
    from tests.unit.engine.test_qwen2_vl_engine import _build, _check, _hf_greedy, _img, _prompt, _req, _as_uint8

    model = _build("qwen2_5_vl", tmp_path / "vl")
    ids, items = _prompt([_img("a"), _img("b")], seed=3)
    text = list(range(3, 40))
    exp_img = _hf_greedy(model, ids, [_img("a"), _img("b")])
    exp_txt = _hf_greedy(model, text, [])
    engine = make_engine(tmp_path / "vl", attention_backend="triton", max_num_batched_tokens=32, tokens_only=True)
    assert engine.attention_backend.name == "triton"
    assert engine.model.visual.blocks[0].attn.varlen_attention is not None  # windows and full blocks in one launch
    out = engine.generate([_req("img", ids, _as_uint8(items, "ab"), logprobs=20), _req("txt", text, None, logprobs=20)])
    _check(out["img"][0], *exp_img)
    _check(out["txt"][0], *exp_txt)
