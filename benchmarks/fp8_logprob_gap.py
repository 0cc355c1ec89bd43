"""Online FP8 (``--quantization fp8``) against the unquantized model: the logprob gap on
the tokens the FP8 model samples, which is what an RL trainer's importance-sampling
correction sees when rollouts run in FP8 and training in bf16.

    python -m benchmarks.fp8_logprob_gap                       # 8x512 preset, bf16
    python -m benchmarks.fp8_logprob_gap --size 125m --prompts 16 --tokens 128

The FP8 engine samples (temperature 1, seeded) and reports each sampled token's logprob;
the bf16 engine scores the same sequences (prompt logprobs of prompt + completion).
Printed: mean, p50, p99 and max of |logprob_fp8 - logprob_bf16| over sampled tokens, and
the mean of the per-token importance ratio exp(bf16 - fp8), with the run's settings.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_throughput import make_prompts  # noqa: E402
from benchmarks.model_presets import SIZES, build_preset_model  # noqa: E402
from common.protocol import GenerateRequest, SamplingParams  # noqa: E402
from worker.engine import Engine, EngineConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="8x512", choices=sorted(SIZES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    model = build_preset_model(args.size, dtype=args.dtype)
    vocab = SIZES[args.size]["vocab_size"]
    prompts = make_prompts(args.prompts, args.prompt_len, vocab, seed=1)
    common = dict(model=str(model), tokens_only=True, num_threads=args.threads, dtype=args.dtype,
                  max_model_len=args.prompt_len + args.tokens + 8)

    fp8 = Engine(EngineConfig(**common, quantization="fp8"))
    reqs = [GenerateRequest(request_id=f"s{i}", prompt_token_ids=p, params=SamplingParams(
        max_tokens=args.tokens, temperature=1.0, seed=1000 + i, ignore_eos=True, logprobs=0))
        for i, p in enumerate(prompts)]
    sampled = {}
    for rid, deltas in fp8.generate(reqs).items():
        ids = [t for d in deltas for t in d.token_ids]
        lps = [lp for d in deltas if d.logprobs for lp in d.logprobs.logprobs]
        sampled[rid] = (ids, lps)
    fp8.close()

    dense = Engine(EngineConfig(**common))
    score = [GenerateRequest(request_id=f"s{i}", prompt_token_ids=p + sampled[f"s{i}"][0], params=SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=0)) for i, p in enumerate(prompts)]
    gaps, ratios = [], []
    for rid, deltas in dense.generate(score).items():
        plp = deltas[0].prompt_logprobs.logprobs  # starts at position 1
        n_prompt = args.prompt_len
        ids, lps = sampled[rid]
        dense_lps = plp[n_prompt - 1:n_prompt - 1 + len(ids)]
        for a, b in zip(lps, dense_lps):
            gaps.append(abs(a - b))
            ratios.append(2.718281828459045 ** (b - a))
    dense.close()
    gaps.sort()
    q = lambda f: gaps[min(len(gaps) - 1, int(f * len(gaps)))]  # noqa: E731
    print(f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs: {args.size} preset in {args.dtype}, {args.prompts} prompts x {args.prompt_len} "
          f"tokens, {args.tokens} sampled each (temperature 1), online FP8 (W8A8) vs unquantized")
    print(f"|logprob_fp8 - logprob_{args.dtype}| over {len(gaps)} sampled tokens: mean {statistics.mean(gaps):.4f}, "
          f"p50 {q(0.5):.4f}, p99 {q(0.99):.4f}, max {gaps[-1]:.4f}; mean importance ratio "
          f"{statistics.mean(ratios):.4f}")


if __name__ == "__main__":
    main()
