"""Offline MoE throughput: this engine vs. Hugging Face transformers batched ``generate``.

Same workload through both, in one run: N concurrent requests of P random prompt
tokens, O greedy output tokens each (EOS ignored), on a random-weight Qwen3-MoE of
~110M active parameters (hidden 768, 12 layers, 16 experts of 768, top-2,
norm_topk_prob; ~420M in all) saved as a real HF checkpoint into a temporary
folder.  Prints output tokens/s of each, the ratio, and how many greedy outputs agree;
then the same for a prefill-only pass (one output token), which separates the
compute-bound prefill from the weight-bandwidth-bound decode.  HF runs its default
experts implementation (``grouped_mm`` in transformers 5), or ``--hf-experts eager``
(its per-expert loop).

    python -m benchmarks.moe_throughput                          # 32 x (128 in, 64 out)
    python -m benchmarks.moe_throughput --num-requests 8 --output-len 32 --experts 8
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


def build_model(out: Path, experts: int, seed: int = 0) -> Path:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    config = transformers.Qwen3MoeConfig(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=4, head_dim=64, num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=768,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, use_sliding_window=False)
    config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # seeded noise on every weight, norms included (not HF's ones)
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: all cores)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--hf-experts", default=None, help="transformers experts implementation (default: its own)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="alternate engine / HF rounds (fresh prompts each) and keep each one's best")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="tokserve-moe-bench-") as tmp:
        model_dir = build_model(Path(tmp), args.experts)
        print(f"workload: {args.num_requests} requests x ({args.prompt_len} prompt + {args.output_len} output) "
              f"tokens, greedy, ignore_eos; random Qwen3-MoE ({args.experts} experts, top-2, ~110M active), "
              f"dtype {args.dtype}, device {args.device}, torch threads {torch.get_num_threads()} (pid {os.getpid()})")
        engine = make_engine(model_dir, args)
        hf = load_hf(model_dir, args)
        if args.hf_experts:
            hf.set_experts_implementation(args.hf_experts)
        print(f"HF experts implementation: {hf.config._experts_implementation}")
        for label, output_len in ((f"{args.output_len} output tokens", args.output_len), ("prefill only", 1)):
            best_engine = best_hf = float("inf")
            same = 0
            for r in range(args.repeat):
                prompts = make_prompts(args.num_requests, args.prompt_len, 32000, seed=r)
                t_engine, engine_tokens = run_engine(engine, prompts, output_len, args)
                t_hf, hf_tokens = run_hf(hf, prompts, output_len, args)
                best_engine, best_hf = min(best_engine, t_engine), min(best_hf, t_hf)
                same += sum(a == b for a, b in zip(engine_tokens, hf_tokens))
            total = args.num_requests * output_len
            tokens = args.num_requests * (args.prompt_len if output_len == 1 else output_len)
            unit = "prompt tok/s" if output_len == 1 else "output tok/s"
            print(f"[{label}]")
            print(f"  tokserve engine : {best_engine:8.2f} s  {tokens / best_engine:9.1f} {unit}")
            print(f"  HF generate     : {best_hf:8.2f} s  {tokens / best_hf:9.1f} {unit}")
            print(f"  ratio engine/HF : {best_hf / best_engine:8.2f}x")
            print(f"  identical greedy outputs: {same}/{args.num_requests * args.repeat} requests ({total} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
