"""Tiny random-weight HF checkpoints built at test time with transformers.

Every kind is a real ``save_pretrained`` safetensors checkpoint plus the
byte-level tokenizer of the demo model (ids 0..255 = bytes, then specials; the
vocabulary is filled up with ``<|reserved_N|>`` special tokens so every id of the
model decodes).  Weights are seeded, and every parameter (norm weights and
biases included) is randomised so loading mistakes cannot hide behind HF's
ones/zeros init.

Kinds (``KINDS``):
  llama          LlamaForCausalLM, hidden 64, 2 layers, 4 heads / 2 kv heads, vocab 320
  qwen2          Qwen2ForCausalLM (q/k/v bias); generation_config with two eos ids,
                 max_new_tokens=32, temperature=0.7, top_p=0.9
  qwen3          Qwen3ForCausalLM (q/k norm) with explicit head_dim 32 != hidden/heads
  mistral        MistralForCausalLM (no sliding window)
  mistral_swa    MistralForCausalLM with sliding_window=8 on every layer
  qwen2_swa      Qwen2ForCausalLM with use_sliding_window: layer 0 full, layer 1 a window of 6
  llama_mqa      LlamaForCausalLM with one KV head (replicated under tensor parallelism)
  llama_sharded  same weights as ``llama`` (same seed) in several safetensors shards
  llama_tied     tie_word_embeddings=True (no lm_head.weight in the checkpoint)
  llama_rope_llama3 / llama_rope_linear / llama_rope_yarn   rope_scaling variants
  mixtral        MixtralForCausalLM, 8 experts, top-2 (renormalised)
  qwen2_moe      Qwen2MoeForCausalLM, 8 experts top-2 (not renormalised) + gated shared expert
  qwen3_moe      Qwen3MoeForCausalLM, 3 layers, layer 1 dense (mlp_only_layers), 8 experts top-2,
                 norm_topk_prob
  phi3           Phi3ForCausalLM (fused qkv_proj / gate_up_proj tensors)
  phi3_longrope  Phi3ForCausalLM with LongRoPE (original context 128 of 1024), partial rotary 0.5
                 (Phi-4-mini's kind) and sliding_window=8 on every layer
  smollm3        SmolLM3ForCausalLM, 4 layers: layer 3 is NoPE (no_rope_layer_interval 4)
  smollm3_swa    the same with use_sliding_window: the NoPE layer attends within 8 positions
  olmo2          Olmo2ForCausalLM: post-norm blocks, q/k RMSNorm over the whole projection
  olmo2_mqa      the same with one KV head (replicated under tensor parallelism)
  olmo3          Olmo3ForCausalLM, 4 layers: 3 sliding (window 8) + 1 full; YaRN on the full layer only
  gemma3         Gemma3ForCausalLM, 4 layers: local (window 8, rope base 10000) and global (base 1e6,
                 linear x8) layers, query_pre_attn_scalar 24, final_logit_softcapping 30, tied head
  gpt_oss        GptOssForCausalLM, 2 layers (sliding 8, full), sinks, YaRN, 8 experts top-4 with
                 router/expert biases, swiglu_limit 0.5 (the clamp bites)
  glm4_moe       Glm4MoeForCausalLM, 3 layers: layer 0 dense (first_k_dense_replace), 8 experts in 4
                 groups (2 chosen) top-2 by sigmoid + correction bias, routed_scaling_factor 2.5, one
                 shared expert, q/k norm, q/k/v bias, partial rotary 0.5
  deepseek_v3    DeepseekV3ForCausalLM (MLA), 3 layers: layer 0 dense (first_k_dense_replace), q_lora_rank 32,
                 kv_lora_rank 32, qk nope 16 + rope 8, v 12, YaRN x4 with mscale / mscale_all_dim, interleaved
                 rotary; 8 experts in 4 groups (2 chosen) top-2, sigmoid + correction bias,
                 routed_scaling_factor 2.5, one shared expert
  deepseek_v3_plain  the same without q_lora_rank (plain q_proj), default rope, rope_interleave false
  deepseek_v2    DeepseekV2ForCausalLM (MLA), 3 layers, layer 0 dense, no q_lora_rank, YaRN x4 with
                 mscale_all_dim, 8 experts group_limited_greedy (4 groups, 1 chosen) top-2 softmax,
                 routed_scaling_factor 2.0, two shared experts
  gemma3_mm      Gemma3ForConditionalGeneration: gemma3's text tower (2 layers, no soft-capping) + a
                 tiny SigLIP tower (56x56 images, 14-pixel patches, 4 tokens per image; image token 300,
                 start/end of image 301/302)
Use ``tiny_model_dir(kind, root)``; tests get them through the conftest fixtures.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from worker.engine.loading.demo_model import BOS_TOKEN, BYTE_VOCAB, EOS_TOKEN, build_byte_tokenizer

VOCAB_SIZE = 320
BOS_ID, EOS_ID, EXTRA_EOS_ID = BYTE_VOCAB, BYTE_VOCAB + 1, BYTE_VOCAB + 2
MAX_POSITIONS = 1024

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=VOCAB_SIZE, max_position_embeddings=MAX_POSITIONS,
               rms_norm_eps=1e-6, bos_token_id=BOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=False)

_ROPE = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
}

KINDS = ("llama", "qwen2", "qwen3", "mistral", "mistral_swa", "qwen2_swa", "llama_mqa", "llama_sharded",
         "llama_tied", "llama_rope_llama3", "llama_rope_linear", "llama_rope_yarn", "mixtral", "qwen2_moe",
         "qwen3_moe", "phi3", "phi3_longrope", "smollm3", "smollm3_swa", "olmo2", "olmo2_mqa", "olmo3", "gemma3", "gemma3_mm", "glm4_moe", "granite",
         "gpt_oss", "deepseek_v3", "deepseek_v3_plain", "deepseek_v2")
MOE_KINDS = ("mixtral", "qwen2_moe", "qwen3_moe")
_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
         "qwen3_moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
         "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
         "glm4_moe": "Glm4MoeForCausalLM", "granite": "GraniteForCausalLM", "gemma3": "Gemma3ForConditionalGeneration",
         "gpt_oss": "GptOssForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
         "deepseek_v2": "DeepseekV2ForCausalLM"}


def special_tokens(vocab_size: int = VOCAB_SIZE) -> tuple[str, ...]:
    reserved = tuple(f"<|reserved_{i}|>" for i in range(vocab_size - BYTE_VOCAB - 2))
    return (BOS_TOKEN, EOS_TOKEN) + reserved


def write_tokenizer(out: Path, vocab_size: int = VOCAB_SIZE) -> None:
    specials = special_tokens(vocab_size)
    (out / "tokenizer.json").write_text(build_byte_tokenizer(specials).to_str(), encoding="utf-8")
    added = {str(BYTE_VOCAB + i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                   "normalized": False, "single_word": False} for i, t in enumerate(specials)}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN,
           "model_max_length": MAX_POSITIONS, "clean_up_tokenization_spaces": False,
           "added_tokens_decoder": added}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")


def _quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def _hf_config(kind: str):
    import transformers

    if kind == "qwen2":
        return transformers.Qwen2Config(**_COMMON, use_sliding_window=False)
    if kind == "qwen3":
        return transformers.Qwen3Config(**_COMMON, head_dim=32)
    if kind == "mistral":
        return transformers.MistralConfig(**_COMMON, sliding_window=None)
    if kind == "mistral_swa":
        return transformers.MistralConfig(**_COMMON, sliding_window=8)
    if kind == "mixtral":
        return transformers.MixtralConfig(**_COMMON, num_local_experts=8, num_experts_per_tok=2, sliding_window=None)
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**_COMMON, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                                           shared_expert_intermediate_size=96, norm_topk_prob=False,
                                           decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**{**_COMMON, "num_hidden_layers": 3}, head_dim=32, num_experts=8,
                                           num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                                           decoder_sparse_step=1, mlp_only_layers=[1], use_sliding_window=False)
    if kind == "granite":  # multipliers far from 1, so each one shows in the logits
        return transformers.GraniteConfig(**_COMMON, embedding_multiplier=6.0, residual_multiplier=0.3,
                                          attention_multiplier=0.05, logits_scaling=4.0)
    if kind == "phi3":
        return transformers.Phi3Config(**_COMMON, pad_token_id=0, sliding_window=None)
    if kind == "phi3_longrope":
        # rotary dim 8 (partial 0.5 of head_dim 16): 4 factors each
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.3, 2.1, 3.4], "long_factor": [1.5, 4.0, 9.0, 17.0],
                "original_max_position_embeddings": 128}
        return transformers.Phi3Config(**_COMMON, pad_token_id=0, sliding_window=8, rope_parameters=rope,
                                       original_max_position_embeddings=128, partial_rotary_factor=0.5)
    if kind in ("smollm3", "smollm3_swa"):
        swa = kind == "smollm3_swa"
        return transformers.SmolLM3Config(**{**_COMMON, "num_hidden_layers": 4}, pad_token_id=0,
                                          use_sliding_window=swa, sliding_window=8 if swa else None)
    if kind in ("olmo2", "olmo2_mqa"):
        return transformers.Olmo2Config(**{**_COMMON, "num_key_value_heads": 1 if kind == "olmo2_mqa" else 2},
                                        pad_token_id=0)
    if kind == "olmo3":
        rope = {"full_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 256},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
        return transformers.Olmo3Config(**{**_COMMON, "num_hidden_layers": 4}, pad_token_id=0, sliding_window=8,
                                        rope_parameters=rope)
    if kind == "gemma3":
        rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
        return transformers.Gemma3TextConfig(
            **{**_COMMON, "num_hidden_layers": 4, "tie_word_embeddings": True}, head_dim=16, pad_token_id=0,
            query_pre_attn_scalar=24, sliding_window=8, final_logit_softcapping=30.0, rope_parameters=rope,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"])
    if kind == "gemma3_mm":
        text = _hf_config("gemma3").to_dict()
        # No final soft-capping: transformers' image-text class skips it (vLLM, and we, apply it
        # when configured; released Gemma 3 configs leave it unset).
        text.update(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                    final_logit_softcapping=None)
        # 4x4 patches pooled 2x2 to 4 tokens per image: enough tokens for the bidirectional
        # attention within an image to change the outputs.
        vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                 num_attention_heads=2, image_size=56, patch_size=14,
                                                 vision_use_head=False)
        return transformers.Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4,
                                         image_token_index=300, boi_token_index=301, eoi_token_index=302)
    if kind == "glm4_moe":
        return transformers.Glm4MoeConfig(
            **{**_COMMON, "num_hidden_layers": 3}, head_dim=32, pad_token_id=0, n_routed_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=48, n_shared_experts=1,
            first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True,
            attention_bias=True, partial_rotary_factor=0.5)
    if kind == "gpt_oss":
        # Both layer types (window 8 for short prompts), YaRN with truncate off as the released
        # configs, top-4 of 8 experts (intermediate a multiple of MXFP4's 32-value groups), and
        # a SwiGLU limit these small activations reach.
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 256}
        return transformers.GptOssConfig(
            **{**_COMMON, "intermediate_size": 64}, head_dim=16, pad_token_id=0, num_local_experts=8,
            num_experts_per_tok=4, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
            rope_parameters=rope, swiglu_limit=0.5, attention_bias=True)
    if kind in ("deepseek_v3", "deepseek_v3_plain", "deepseek_v2"):
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
                "mscale": 0.8, "mscale_all_dim": 0.9, "beta_fast": 32, "beta_slow": 1}
        mla = dict(**{**_COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4}, pad_token_id=0, kv_lora_rank=32,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
                   n_group=4, topk_group=2, moe_intermediate_size=48, first_k_dense_replace=1)
        if kind == "deepseek_v2":
            # one group of four chosen: with two, top-2 of the best groups' maxima is plain top-2
            return transformers.DeepseekV2Config(**{**mla, "topk_group": 1}, q_lora_rank=None,
                                                 topk_method="group_limited_greedy",
                                                 n_shared_experts=2, routed_scaling_factor=2.0, rope_parameters=yarn)
        plain = kind == "deepseek_v3_plain"
        return transformers.DeepseekV3Config(
            **mla, q_lora_rank=None if plain else 32, n_shared_experts=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, rope_interleave=not plain,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0} if plain else yarn)
    if kind == "qwen2_swa":
        return transformers.Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    extra = {}
    if kind == "llama_mqa":
        extra["num_key_value_heads"] = 1
    if kind == "llama_tied":
        extra["tie_word_embeddings"] = True
    if kind.startswith("llama_rope_"):
        extra["rope_scaling"] = dict(_ROPE[kind.removeprefix("llama_rope_")])
    return transformers.LlamaConfig(**{**_COMMON, **extra})


def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.08 * noise)


def build_tiny_model(kind: str, out: Path, seed: int = 0) -> Path:
    import transformers

    if kind not in KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; known: {KINDS}")
    _quiet_transformers()
    config = _hf_config(kind)
    config.architectures = [_ARCH[config.model_type]]
    cls = getattr(transformers, config.architectures[0])
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    _randomise(model, seed)
    if kind in ("glm4_moe", "deepseek_v3", "deepseek_v3_plain"):
        # the router's correction bias is a buffer: steer the choice with it too
        gen = torch.Generator().manual_seed(seed + 1)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.3 * torch.randn(8, generator=gen))
    if kind == "gpt_oss":  # sinks and router biases large enough to change the outcome
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=gen))
                layer.mlp.router.bias.copy_(0.5 * torch.randn(layer.mlp.router.bias.shape, generator=gen))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size="40KB" if kind == "llama_sharded" else "1GB")
    gen = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
    if kind == "qwen2":
        gen.update(eos_token_id=[EOS_ID, EXTRA_EOS_ID], max_new_tokens=32, temperature=0.7, top_p=0.9)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2), encoding="utf-8")
    write_tokenizer(out)
    return out


def tiny_model_dir(kind: str, root: Path, seed: int = 0) -> Path:
    """Build ``kind`` under ``root`` once; later calls reuse it."""
    out = Path(root) / f"{kind}-s{seed}"
    if not (out / "config.json").is_file():
        build_tiny_model(kind, out, seed)
    return out


def load_hf_model(model_dir: Path):
    """The transformers reference for a tiny model: fp32, eager attention."""
    import transformers

    _quiet_transformers()
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def tiny_bf16_model_dir(kind: str, root: Path, seed: int = 0) -> Path:
    """``kind``'s checkpoint stored in bfloat16 (config torch_dtype bfloat16), as most
    published checkpoints are; built once under ``root``."""
    import shutil

    import transformers

    src = tiny_model_dir(kind, root, seed)
    out = Path(root) / f"{kind}-s{seed}-bf16"
    if not (out / "config.json").is_file():
        _quiet_transformers()
        model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
        model.save_pretrained(out)
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
                shutil.copy(f, out / f.name)
    return out


def load_hf_model_bf16(model_dir: Path):
    """The transformers reference in bfloat16 (eager attention), as HF users run it."""
    import transformers

    _quiet_transformers()
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="eager").eval()
