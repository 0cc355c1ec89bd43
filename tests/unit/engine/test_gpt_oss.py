"""GPT-OSS (GptOssForCausalLM) against transformers, beyond the shared family parity
(tests/unit/engine/test_model_families.py runs its paged steps through every CPU backend
and the engine's greedy ids / logprobs): the config, each variation mattering on the
tiny model (so the parity could not pass by ignoring it), the SDPA sink identity, the
experts' stored layout, routed_experts equal to HF's router choice, and the released
MXFP4 expert layout against transformers' reader."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.engine_helpers import assert_routed_experts_equal_hf
from tests.support.model_factory import load_hf_model
from tests.unit.engine.test_model import ATOL, PagedSeqs, _tokens, hf_logits
from worker.engine.attention.backends.torch_sdpa import sdpa_with_sinks
from worker.engine.loading.loader import load_model
from worker.engine.models.config import ModelConfig
from worker.engine.models.moe import clamped_swiglu


def test_config(tiny_model):
    c = ModelConfig.from_dir(tiny_model("gpt_oss"))
    assert c.architecture == "GptOssForCausalLM" and c.attention_sinks
    assert c.layer_sliding_windows == (8, None) and c.qkv_bias and c.o_bias
    assert c.rope_scaling["rope_type"] == "yarn" and c.rope_scaling["truncate"] is False
    moe = c.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.scoring) == (8, 4, 64, "topk_softmax")
    assert moe.router_bias and moe.expert_bias and moe.swiglu_clamp == (1.702, 0.5)
    assert moe.sparse_layers == (True, True)


def test_sdpa_with_sinks_equals_eager_concatenation():
    """transformers' eager formula: the sink column joins the softmax, then is dropped."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 5, 8, generator=g) for _ in range(3))
    sinks = torch.randn(4, generator=g)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    logits = (q @ k.transpose(-1, -2)) * 0.3
    logits = logits.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(torch.cat((logits, sinks.view(1, 4, 1, 1).expand(1, 4, 5, 1)), dim=-1), dim=-1)
    ref = probs[..., :-1] @ v
    got = sdpa_with_sinks(q, k, v, mask, 0.3, sinks.view(1, 4, 1, 1))
    torch.testing.assert_close(got, ref)


def test_experts_are_held_as_checkpoints_store_them(tiny_model):
    """w13 / w2 hold the fused tensors as stored (gate/up interleaved): the checkpoint
    names map to transposed views, so a load or update is one in-place copy."""
    from safetensors.torch import load_file

    layer = load_model(tiny_model("gpt_oss")).layers[1]
    state = load_file(str(tiny_model("gpt_oss") / "model.safetensors"))
    x = "model.layers.1.mlp.experts."
    torch.testing.assert_close(layer.moe.w13.data, state[x + "gate_up_proj"].transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(layer.moe.w2.data, state[x + "down_proj"].transpose(1, 2), rtol=0, atol=0)
    # interleaved [g0 u0 g1 u1]: gate 9 (clamped at 7) with up 9 (clamped), gate -1 with up -9 (-> -7)
    got = clamped_swiglu(torch.tensor([[9.0, 9.0, -1.0, -9.0]]), 1.702, 7.0)
    want = torch.tensor([[8.0 * 7.0 * torch.sigmoid(torch.tensor(7.0 * 1.702)),
                          -6.0 * -1.0 * torch.sigmoid(torch.tensor(-1.702))]])
    torch.testing.assert_close(got, want)


def _variant_logits(path, ids, change):
    model = load_model(path)
    change(model)
    (got,) = PagedSeqs(model).step([("a", ids)])
    return got


def test_each_variation_matters(tiny_model):
    path = tiny_model("gpt_oss")
    ids = _tokens(40, seed=7)
    ref = hf_logits(load_hf_model(path), ids)
    torch.testing.assert_close(_variant_logits(path, ids, lambda m: None), ref, atol=ATOL, rtol=0)

    def no_sinks(m):
        for layer in m.layers:
            layer.sinks.data.fill_(float("-inf"))

    def no_clamp(m):
        for layer in m.layers:
            layer.moe.moe = type(layer.moe.moe)(**{**layer.moe.moe.__dict__, "swiglu_clamp": (1.702, 1e9)})

    def no_router_bias(m):
        for layer in m.layers:
            layer.moe.gate_bias.data.zero_()

    def no_window(m):
        for layer in m.layers:
            layer.attn.spec = type(layer.attn.spec)(**{**layer.attn.spec.__dict__, "sliding_window": None})
            layer.attn.set_backend(layer.attn.backend)

    for change in (no_sinks, no_clamp, no_router_bias, no_window):
        assert (_variant_logits(path, ids, change) - ref).abs().max() > 1e-3, change.__name__


def test_routed_experts_equal_hf_router_choice(tiny_model):
    assert_routed_experts_equal_hf(tiny_model("gpt_oss"), "router", moe_layers=2, top_k=4)


def test_mxfp4_dequant_equals_transformers():
    """Every code, both nibbles, scales around the bias: transformers' reader as the reference."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from worker.engine.quantization.dequant import dequant_mxfp4

    blocks = torch.arange(256, dtype=torch.uint8).view(2, 4, 2, 16)  # [E, rows, G, 16]
    scales = torch.tensor([[[120, 127], [128, 130], [127, 1], [250, 127]]] * 2, dtype=torch.uint8)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, rows]
    torch.testing.assert_close(dequant_mxfp4(blocks, scales).transpose(1, 2), ref, rtol=0, atol=0)


def test_mxfp4_checkpoint_matches_hf(tiny_model, tmp_path):
    """The released layout (``*_blocks`` / ``*_scales``, quant_method mxfp4) dequantized on
    load: paged steps equal transformers holding the same experts, dequantized by
    transformers' own MXFP4 reader."""
    from tests.support import quantized_factory as qf
    from worker.engine.loading.loader import checkpoint_quantization

    src = tiny_model("gpt_oss")
    path, dense = qf.write_mxfp4(src, tmp_path / "mxfp4")
    assert checkpoint_quantization(path).method == "mxfp4" and len(dense) == 4
    ref_model = qf.reference_with_weights(src, dense, tmp_path)
    ids, other = _tokens(40, seed=5), _tokens(20, seed=6)
    ref, ref_other = hf_logits(ref_model, ids), hf_logits(ref_model, other)
    assert (ref - hf_logits(load_hf_model(src), ids)).abs().max() > 1e-2  # the experts did change
    seqs = PagedSeqs(load_model(path))
    a, b = seqs.step([("a", ids[:30]), ("b", other[:9])])
    torch.testing.assert_close(a, ref[:30], atol=ATOL, rtol=0)
    torch.testing.assert_close(b, ref_other[:9], atol=ATOL, rtol=0)
    a, b = seqs.step([("a", ids[30:]), ("b", other[9:])])
    torch.testing.assert_close(a, ref[30:], atol=ATOL, rtol=0)
    torch.testing.assert_close(b, ref_other[9:], atol=ATOL, rtol=0)


def test_mxfp4_missing_scales_are_named(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    from tests.support import quantized_factory as qf

    path, _ = qf.write_mxfp4(tiny_model("gpt_oss"), tmp_path / "broken")
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks model.layers.1.mlp.experts.down_proj_scales"):
        load_model(path)


# openai/gpt-oss-20b's config.json as released (data: the keys and values its loader must read).
RELEASED_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 201088}


def test_released_config_reads(tmp_path):
    c = ModelConfig.from_dicts(tmp_path, RELEASED_20B)
    assert c.layer_sliding_windows == (128, None) * 12 and c.attention_sinks and c.qkv_bias and c.o_bias
    assert c.rope_theta == 150000 and c.rope_scaling["factor"] == 32.0 and c.rope_scaling["truncate"] is False
    assert (c.moe.num_experts, c.moe.top_k, c.moe.intermediate_size) == (32, 4, 2880)
    assert c.moe.swiglu_clamp == (1.702, 7.0) and c.quantization.method == "mxfp4"
    assert c.quantization.scheme_for("model.layers.3.mlp.router") is None
    del RELEASED_20B["num_experts_per_tok"]  # older exports name only experts_per_token
    try:
        assert ModelConfig.from_dicts(tmp_path, RELEASED_20B).moe.top_k == 4
    finally:
        RELEASED_20B["num_experts_per_tok"] = 4


def test_released_yarn_table_equals_transformers():
    """GPT-OSS's YaRN (factor 32, truncate off) as transformers computes its inv_freq."""
    import transformers

    from worker.engine.models.rotary import build_cos_sin_table

    cfg = transformers.GptOssConfig(**{k: v for k, v in RELEASED_20B.items() if k not in ("quantization_config",)})
    rope = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(cfg)
    pos = torch.tensor([[0, 1, 127, 4095, 4096, 50000]])
    cos, sin = rope(torch.zeros(1, dtype=torch.float32), pos)
    c = ModelConfig.from_dicts(Path("."), RELEASED_20B)
    table = build_cos_sin_table(c.rotary_dim, c.rope_theta, 50001, c.rope_scaling)[pos[0]]
    torch.testing.assert_close(table[:, :32], cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(table[:, 32:], sin[0], rtol=1e-5, atol=1e-5)
