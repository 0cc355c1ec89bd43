"""Offline throughput per model family: this engine vs Hugging Face transformers
batched ``generate`` on the same random checkpoint of each registered dense family.

Each family gets one tiny-but-not-trivial configuration (hidden 512, 8 layers, 8 heads
/ 4 KV heads of 64, MLP 1536, vocabulary 32k: ~60M parameters) with its own features
on: Phi-3 with LongRoPE and a 64-token window, SmolLM3 with NoPE every 4th layer and
windows, OLMo 2 (post-norm, whole-projection q/k norm), OLMo 3 (3 sliding layers of 64
per full one), Gemma 3 (local layers of 64 and global ones, 1 + w norms, GeGLU,
soft-capped logits), GPT-OSS (sinks, alternating 64-token windows and full layers, YaRN,
8 experts of 512 top-4 with biases and the clamped SwiGLU), DeepSeek-V3 (multi-head latent
attention: q_lora_rank 256, kv_lora_rank 128, qk 64 nope + 32 rope, v 64, YaRN with mscale;
a dense first layer, then 8 experts of 512 in 4 groups, top-2 by noaux_tc, one shared
expert), Granite 3.x (embedding, residual, attention and logits multipliers), GLM-4.5 (8 experts of
512 in 4 groups by sigmoid scores with the correction bias, a shared expert, a dense first layer,
partial rotary, q/k norm); Llama as the reference point.  Prints output tokens/s of each side,
the ratio and how many greedy outputs agree.

    python -m benchmarks.family_throughput --threads 1                # all families
    python -m benchmarks.family_throughput --families gemma3,phi3 --num-requests 4
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_throughput import load_hf, make_engine, make_prompts, run_engine, run_hf  # noqa: E402

VOCAB = 32000
_COMMON = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
               num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
               pad_token_id=0, tie_word_embeddings=False)


def _config(family: str):
    import transformers

    if family == "llama":
        return transformers.LlamaConfig(**_COMMON)
    if family == "phi3":
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 2048,
                "short_factor": [1.0 + 0.05 * i for i in range(32)], "long_factor": [1.0 + 0.5 * i for i in range(32)]}
        return transformers.Phi3Config(**_COMMON, sliding_window=64, rope_parameters=rope,
                                       original_max_position_embeddings=2048)
    if family == "smollm3":
        return transformers.SmolLM3Config(**_COMMON, use_sliding_window=True, sliding_window=64)
    if family == "olmo2":
        return transformers.Olmo2Config(**_COMMON)
    if family == "olmo3":
        return transformers.Olmo3Config(**_COMMON, sliding_window=64)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(**_COMMON, sliding_window=64, query_pre_attn_scalar=64,
                                             final_logit_softcapping=30.0)
    if family == "gpt_oss":
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}
        return transformers.GptOssConfig(**{**_COMMON, "intermediate_size": 512}, num_local_experts=8,
                                         num_experts_per_tok=4, sliding_window=64, rope_parameters=rope,
                                         layer_types=["sliding_attention", "full_attention"] * 4,
                                         attention_bias=True)
    if family == "deepseek_v3":
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
                "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
        common = {k: v for k, v in _COMMON.items() if k != "head_dim"}
        return transformers.DeepseekV3Config(**{**common, "num_key_value_heads": 8}, q_lora_rank=256, kv_lora_rank=128,
                                             qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                                             n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                                             moe_intermediate_size=512, n_shared_experts=1, first_k_dense_replace=1,
                                             routed_scaling_factor=2.5, rope_parameters=rope)
    if family == "granite":  # Granite 3.x's multipliers far from 1
        return transformers.GraniteConfig(**_COMMON, embedding_multiplier=12.0, residual_multiplier=0.22,
                                          attention_multiplier=0.015625, logits_scaling=8.0)
    if family == "glm4_moe":  # GLM-4.5: sigmoid grouped routing, shared experts, a dense first layer
        return transformers.Glm4MoeConfig(**{**_COMMON, "intermediate_size": 1536}, n_routed_experts=8,
                                          num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=512,
                                          n_shared_experts=1, first_k_dense_replace=1, partial_rotary_factor=0.5,
                                          use_qk_norm=True, routed_scaling_factor=2.5)
    raise ValueError(f"unknown family {family!r}")


def build_model(out: Path, family: str, seed: int = 0) -> Path:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    config = _config(family)
    config.architectures = [{"llama": "LlamaForCausalLM", "phi3": "Phi3ForCausalLM",
                             "smollm3": "SmolLM3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
                             "olmo3": "Olmo3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                             "gpt_oss": "GptOssForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                             "granite": "GraniteForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}[family]]
    torch.manual_seed(seed)
    model = getattr(transformers, config.architectures[0])(config).to(torch.float32)
    with torch.no_grad():  # seeded noise on every weight, norms included (Gemma's norms are 1 + w)
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_((0.0 if family == "gemma3" else 1.0) + 0.05 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="llama,phi3,smollm3,olmo2,olmo3,gemma3")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"workload: {args.num_requests} requests x ({args.prompt_len} prompt + {args.output_len} output) tokens, "
          f"greedy, ignore_eos, dtype {args.dtype}, device {args.device}, torch threads {torch.get_num_threads()} "
          f"(pid {os.getpid()})")
    print(f"{'family':<8} {'engine tok/s':>12} {'HF tok/s':>9} {'ratio':>6}  identical")
    for family in args.families.split(","):
        with tempfile.TemporaryDirectory(prefix=f"tokserve-{family}-bench-") as tmp:
            model_dir = build_model(Path(tmp), family)
            engine = make_engine(model_dir, args)
            hf = load_hf(model_dir, args)
            prompts = make_prompts(args.num_requests, args.prompt_len, VOCAB)
            t_engine, engine_tokens = run_engine(engine, prompts, args.output_len, args)
            t_hf, hf_tokens = run_hf(hf, prompts, args.output_len, args)
            tokens = args.num_requests * args.output_len
            same = sum(a == b for a, b in zip(engine_tokens, hf_tokens))
            print(f"{family:<8} {tokens / t_engine:12.1f} {tokens / t_hf:9.1f} {t_hf / t_engine:5.2f}x  "
                  f"{same}/{args.num_requests}", flush=True)
            del engine, hf
    return 0


if __name__ == "__main__":
    sys.exit(main())
