"""Offline multi-LoRA throughput: requests spread uniformly over K adapters vs the
same requests on the base model, through one engine, in one run.

The engine serves a random ~125M Llama (benchmarks/engine_throughput.py's shape)
with ``--enable-lora --max-loras K``; K random PEFT adapters of rank R on every
decoder projection (q/k/v/o/gate/up/down) are written as safetensors beside it.
Rounds alternate: base (no request names an adapter) and mixed (request i names
adapter i % K), fresh prompts each, best of ``--repeat`` kept.  Prints output tok/s
of both and the ratio (the issue's target: mixed >= 0.7x base).

    python -m benchmarks.lora_throughput                        # 32 x (128 in, 64 out), 4 adapters, rank 16
    python -m benchmarks.lora_throughput --adapters 8 --max-loras 4 --rank 8 --repeat 3
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_throughput import LLAMA_125M, _sync, build_model, make_prompts  # noqa: E402
from common.protocol import GenerateRequest, SamplingParams  # noqa: E402
from worker.engine import Engine, EngineConfig  # noqa: E402

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def build_adapter(out: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA folder on every projection of LLAMA_125M, random non-zero A and B."""
    c = LLAMA_125M
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    q = c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{TARGETS[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = 0.02 * torch.randn(rank, fan_in, generator=gen)
            tensors[f"{prefix}.lora_B.weight"] = 0.02 * torch.randn(fan_out, rank, generator=gen)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(TARGETS), "task_type": "CAUSAL_LM"}))
    return out


def run(engine: Engine, prompts, names, args) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    reqs = [GenerateRequest(request_id=str(i), prompt_token_ids=p, params=params, lora_name=n)
            for i, (p, n) in enumerate(zip(prompts, names))]
    _sync(args.device)
    t0 = time.perf_counter()
    res = engine.generate(reqs)
    _sync(args.device)
    return time.perf_counter() - t0, [res[str(i)][0].token_ids for i in range(len(prompts))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=4, help="adapters the mixed rounds spread requests over")
    ap.add_argument("--max-loras", type=int, default=None, help="device slots (default: --adapters)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: all cores)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=2, help="base / mixed round pairs; each one's best is kept")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    max_loras = args.max_loras or args.adapters
    total_out = args.num_requests * args.output_len
    with tempfile.TemporaryDirectory(prefix="tokserve-lora-bench-") as tmp:
        (Path(tmp) / "base").mkdir()
        model_dir = build_model(Path(tmp) / "base")
        loras = {f"lora{i}": str(build_adapter(Path(tmp) / f"lora{i}", args.rank, seed=i))
                 for i in range(args.adapters)}
        print(f"workload: {args.num_requests} requests x ({args.prompt_len} prompt + {args.output_len} output) "
              f"tokens, greedy, ignore_eos; ~125M Llama, {args.adapters} adapters of rank {args.rank} on every "
              f"projection, {max_loras} slots; dtype {args.dtype}, device {args.device}, torch threads "
              f"{torch.get_num_threads()} (pid {os.getpid()})")
        engine = Engine(EngineConfig(
            model=str(model_dir), tokens_only=True, dtype=args.dtype, device=args.device,
            max_num_seqs=max(args.num_requests, 1), max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=False, max_model_len=args.prompt_len + args.output_len + 16,
            num_threads=args.threads, enable_lora=True, max_loras=max_loras, max_lora_rank=args.rank,
            max_cpu_loras=max(max_loras, args.adapters), lora_modules=loras))
        warm = make_prompts(args.adapters + 1, 16, LLAMA_125M["vocab_size"], seed=99)
        run(engine, warm, [None, *loras], argparse.Namespace(**{**vars(args), "output_len": 4}))
        best = {"base": float("inf"), "mixed": float("inf")}
        differ = 0
        for r in range(args.repeat):
            prompts = make_prompts(args.num_requests, args.prompt_len, LLAMA_125M["vocab_size"], seed=r)
            mixed_names = [f"lora{i % args.adapters}" for i in range(args.num_requests)]
            t_base, base_tokens = run(engine, prompts, [None] * args.num_requests, args)
            t_mixed, mixed_tokens = run(engine, prompts, mixed_names, args)
            best["base"], best["mixed"] = min(best["base"], t_base), min(best["mixed"], t_mixed)
            differ += sum(a != b for a, b in zip(base_tokens, mixed_tokens))
            print(f"  round {r}: base {t_base:8.2f} s   mixed {t_mixed:8.2f} s", flush=True)
        base_tps, mixed_tps = total_out / best["base"], total_out / best["mixed"]
        print(f"base only        : {best['base']:8.2f} s  {base_tps:9.1f} output tok/s")
        print(f"{args.adapters} adapters mixed : {best['mixed']:8.2f} s  {mixed_tps:9.1f} output tok/s")
        print(f"ratio mixed/base : {mixed_tps / base_tps:8.2f}x   (target >= 0.70x)")
        print(f"outputs changed by their adapter: {differ}/{args.num_requests * args.repeat}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
