"""Aggregate throughput of two cells behind vllm-router vs one cell, side by side in one run.

  python benchmarks/cells.py [--requests 256] [--concurrency 32] [--input-len 64] [--output-len 32]
                             [--policy round_robin] [--model DIR]

A cell is one broker + one worker + one gateway (tests/support/cells.py, each with its
own runtime directory).  The same closed-loop load (``--concurrency`` requests in flight,
``--requests`` in all, random prompts, greedy, ``ignore_eos``) goes to:

  1 cell, direct      the gateway itself
  1 cell, router      vllm-router in front of that one gateway (the router's own cost)
  2 cells, router     vllm-router over both gateways

and the output tokens/s of each are printed with their ratios to "1 cell, direct".  On
a machine with fewer cores than the cells need (this 2-core box: two workers, two
brokers, two gateways, the router and the load generator all share 2 cores) the ratio
measures routing and broker overhead under contention, not scale-out; on hosts with a
core budget per cell it is the scale-out figure.  Default model: the tests' tiny random
Llama (cheap steps: the front end's share of the cost is what shows); ``--model`` for a
real one.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from tests.support.cells import start_cell, start_vllm_router, vllm_router_binary  # noqa: E402
from tests.support.procs import ProcGroup  # noqa: E402

GENERATE = "/inference/v1/generate"


async def load(url: str, requests: int, concurrency: int, input_len: int, output_len: int, vocab: int,
               seed: int) -> tuple[float, int, int]:
    """(seconds, output tokens, failed requests) of a closed loop over ``url``."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(input_len)] for _ in range(requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    tokens = failed = 0

    async def client(http: httpx.AsyncClient):
        nonlocal tokens, failed
        while not queue.empty():
            prompt = queue.get_nowait()
            r = await http.post(GENERATE, json={"token_ids": prompt, "sampling_params": {
                "max_tokens": output_len, "temperature": 0, "ignore_eos": True}})
            if r.status_code != 200:
                failed += 1
                continue
            tokens += r.json()["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await http.post(GENERATE, json={"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}})  # warm-up
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        return time.perf_counter() - t0, tokens, failed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--policy", default="round_robin", help="vllm-router policy for the router runs")
    p.add_argument("--model", default=None, help="HF model folder (default: the tests' tiny random Llama)")
    p.add_argument("--worker-args", default="--max-num-seqs 64 --num-kv-blocks 2048 --threads 1 --max-model-len 1024")
    p.add_argument("--repeat", type=int, default=2, help="rounds over the three setups (best of each reported)")
    args = p.parse_args(argv)
    if vllm_router_binary() is None:
        print("vllm-router is not installed: pip install vllm-router", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="bench-cells-"))
    if args.model:
        model = Path(args.model)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    else:
        from tests.support.model_factory import VOCAB_SIZE, tiny_model_dir

        model, vocab = tiny_model_dir("llama", root / "models"), VOCAB_SIZE
    print(f"cells benchmark ({os.cpu_count()} CPUs shared by everything): {args.requests} requests, "
          f"concurrency {args.concurrency}, {args.input_len} in / {args.output_len} out, model {model.name}, "
          f"router policy {args.policy}")
    worker_args = tuple(args.worker_args.split())
    with ProcGroup(root / "logs") as procs:
        cells = [start_cell(procs, root / f"cell{i}", model, worker_args=worker_args, kv_events=False)
                 for i in range(2)]
        one = start_vllm_router(procs, [cells[0].url], args.policy)
        two = start_vllm_router(procs, [c.url for c in cells], args.policy)
        setups = [("1 cell, direct", cells[0].url), ("1 cell, router", one.url), ("2 cells, router", two.url)]
        best: dict[str, float] = {}
        for rnd in range(args.repeat):  # alternate the setups so background load hits them alike
            for name, url in setups:
                secs, tokens, failed = asyncio.run(load(url, args.requests, args.concurrency, args.input_len,
                                                        args.output_len, vocab, seed=rnd))
                rate = tokens / secs
                best[name] = max(best.get(name, 0.0), rate)
                print(f"  round {rnd}: {name:<16} {secs:7.2f} s  {rate:8.1f} output tok/s"
                      + (f"  ({failed} failed)" if failed else ""), flush=True)
    base = best["1 cell, direct"]
    print(f"\n{'setup':<18} {'output tok/s':>13} {'vs 1 cell direct':>17}")
    for name, _ in setups:
        print(f"{name:<18} {best[name]:>13.1f} {best[name] / base:>16.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
