"""Speculative decoding (n-gram drafts; a draft model) vs plain decoding, same run.

Two workloads on the random ~125M Llama of engine_throughput.py, greedy, EOS ignored:
(a) repetitive: each prompt is S + G + S, where G is the plain engine's own greedy
    continuation of S, so the continuation after the second S tends to quote G
    (what code edits and RL rollouts that quote their prompt look like);
(b) random prompts.
For each workload and concurrency (requests in flight at once), output tok/s and the
mean inter-token latency per request (time between a request's first and last token
over its tokens after the first), with and without speculation; rounds alternate
and the best of each is kept.  Outputs are checked identical.  The draft model is
the target's first ``--draft-layers`` layers with its embedding, final norm and head
(self-speculation by early exit: no trained small model can be downloaded here).

    python -m benchmarks.spec_decode                            # concurrency 1 and 8, k = 4
    python -m benchmarks.spec_decode --concurrency 1 --k 6 --output-len 128
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_throughput import LLAMA_125M, build_model, make_prompts  # noqa: E402
from common.protocol import GenerateRequest, SamplingParams  # noqa: E402
from worker.engine import Engine, EngineConfig  # noqa: E402


def make_engine(model_dir: Path, args, spec) -> Engine:
    """``spec``: None (plain), "ngram", or a draft model's folder."""
    if spec == "ngram":
        cfg = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
               "prompt_lookup_max": args.lookup_max}
    elif spec is not None:
        cfg = {"method": "draft_model", "model": str(spec), "num_speculative_tokens": args.k}
    else:
        cfg = None
    return Engine(EngineConfig(model=str(model_dir), tokens_only=True, max_num_seqs=max(args.concurrency),
                               max_num_batched_tokens=2048, enable_prefix_caching=False,
                               max_model_len=3 * args.prompt_len + 2 * args.output_len + 16,
                               num_threads=args.threads, speculative_config=cfg))


def early_exit_draft(model_dir: Path, out: Path, layers: int) -> Path:
    """The target's first ``layers`` layers with its embedding, norm and head."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(cfg))
    (out / "generation_config.json").write_text((model_dir / "generation_config.json").read_text())
    weights = load_file(str(model_dir / "model.safetensors"))
    keep = {k: v for k, v in weights.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def run(engine: Engine, prompts, output_len: int) -> tuple[float, float, list[list[int]]]:
    """(output tok/s, mean ITL in ms, outputs) of the prompts, all submitted at once."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(prompts))]
    first: dict = {}
    last: dict = {}
    tokens: dict = {rid: [] for rid in ids}
    t0 = time.perf_counter()
    for rid, p in zip(ids, prompts):
        engine.add_request(GenerateRequest(request_id=rid, prompt_token_ids=p, params=params))
    while engine.has_unfinished():
        deltas = engine.step()
        now = time.perf_counter()
        for d in deltas:
            if d.token_ids:
                first.setdefault(d.request_id, now)
                last[d.request_id] = now
                tokens[d.request_id].extend(d.token_ids)
    elapsed = time.perf_counter() - t0
    itl = [(last[r] - first[r]) / (len(tokens[r]) - 1) for r in ids if len(tokens[r]) > 1]
    total = sum(len(t) for t in tokens.values())
    return total / elapsed, 1e3 * sum(itl) / len(itl), [tokens[r] for r in ids]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=64, help="length of S (and of G) in workload (a)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=2, help="layers of the early-exit draft model (0: none)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="tokserve-spec-bench-") as tmp:
        (Path(tmp) / "target").mkdir()
        model_dir = build_model(Path(tmp) / "target")
        engines = {"plain": make_engine(model_dir, args, None), "ngram": make_engine(model_dir, args, "ngram")}
        if args.draft_layers:
            draft = early_exit_draft(model_dir, Path(tmp) / "draft", args.draft_layers)
            engines[f"draft{args.draft_layers}L"] = make_engine(model_dir, args, draft)
        plain = engines["plain"]
        print(f"~125M Llama, greedy, {args.output_len} output tokens; ngram k={args.k}, lookup "
              f"{args.lookup_min}..{args.lookup_max}; torch threads {torch.get_num_threads()} (pid {os.getpid()})")
        vocab = LLAMA_125M["vocab_size"]
        rows = []
        for c in args.concurrency:
            seeds = make_prompts(c, args.prompt_len, vocab, seed=c)
            _, _, conts = run(plain, seeds, args.prompt_len)
            workloads = {"repetitive": [s + g + s for s, g in zip(seeds, conts)],
                         "random": make_prompts(c, 3 * args.prompt_len, vocab, seed=100 + c)}
            for name, prompts in workloads.items():
                best = {label: (0.0, 0.0) for label in engines}
                outputs = {}
                for _ in range(args.repeat):
                    for label, engine in engines.items():
                        tps, itl, outputs[label] = run(engine, prompts, args.output_len)
                        if tps > best[label][0]:
                            best[label] = (tps, itl)
                tp, ip = best["plain"]
                for label in list(engines)[1:]:
                    ts, is_ = best[label]
                    rows.append(dict(workload=name, concurrency=c, proposer=label, plain_tps=round(tp, 1),
                                     spec_tps=round(ts, 1), speedup=round(ts / tp, 2), plain_itl_ms=round(ip, 2),
                                     spec_itl_ms=round(is_, 2), identical=outputs[label] == outputs["plain"]))
                    print(json.dumps(rows[-1]), flush=True)
        print()
        print("| workload | concurrency | proposer | plain tok/s | spec tok/s | speedup | plain ITL ms | spec ITL ms "
              "| identical |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['workload']} | {r['concurrency']} | {r['proposer']} | {r['plain_tps']} | {r['spec_tps']} | "
                  f"{r['speedup']}x | {r['plain_itl_ms']} | {r['spec_itl_ms']} | {r['identical']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
