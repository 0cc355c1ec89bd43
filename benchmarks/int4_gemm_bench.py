"""The CPU int4 GEMM (W4A16 weights kept packed: worker/engine/kernels/int4_gemm.cpp) beside
the native bf16 GEMM on the same shapes, one thread, alternating rounds.

    python -m benchmarks.int4_gemm_bench                   # 3 rounds
    python -m benchmarks.int4_gemm_bench --rounds 5 --rows 1 4 32

Per (shape, rows): the best of 7 repeats of 10 calls each, every round printed, then the
medians and bf16 time / int4 time (> 1: int4 faster).  The weight bytes each streams per
call are printed too: int4 reads about a quarter of bf16's (scales and zeros included).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.engine.kernels import load_cpu_kernels  # noqa: E402
from worker.engine.quantization.int4_cpu import pack_int4  # noqa: E402

SHAPES = [(1536, 512), (512, 1536), (4096, 4096), (11008, 4096)]


def best_ms(fn, calls: int = 10, repeats: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32])
    ap.add_argument("--group", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    k = load_cpu_kernels()
    if k is None or not hasattr(k, "int4_linear"):
        sys.exit("compiled CPU kernels unavailable (tokserve build-kernels)")
    print(f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, int4 {k.int4_gemm_isa()}, "
          f"bf16 {k.native_bf16_gemm_isa()}, 1 thread, group {args.group}")
    cases = []
    for n, kk in SHAPES:
        g = torch.Generator().manual_seed(0)
        q = torch.randint(0, 16, (n, kk), generator=g)
        s = torch.rand(n, kk // args.group, generator=g) * 0.01
        w4 = pack_int4(q, s, torch.full_like(s, 8.0), args.group)
        wb = k.pack_bf16_weight(torch.randn(n, kk, generator=g).to(torch.bfloat16))
        for rows in args.rows:
            x = torch.randn(rows, kk, generator=g).to(torch.bfloat16)
            cases.append(((n, kk), rows, w4, wb, x))
    results: dict = {}
    for r in range(args.rounds):
        for shape, rows, w4, wb, x in cases:
            t4 = best_ms(lambda: k.int4_linear(x, w4.packed, w4.scales, w4.zeros, w4.group, shape[0], None))
            tb = best_ms(lambda: k.bf16_linear(x, wb))
            results.setdefault((shape, rows), []).append((t4, tb))
            print(f"  round {r} [{shape[0]}x{shape[1]}] rows {rows:3d}: int4 {t4:8.3f} ms  bf16 {tb:8.3f} ms  "
                  f"(load {os.getloadavg()[0]:.1f})")
    print("\nmedians (MB read per call: int4 / bf16)")
    print(f"{'shape':>12} {'rows':>5} {'int4 ms':>9} {'bf16 ms':>9} {'bf16/int4':>9} {'MB':>13}")
    for (shape, rows, w4, *_rest) in cases:
        t4 = statistics.median(t for t, _ in results[(shape, rows)])
        tb = statistics.median(t for _, t in results[(shape, rows)])
        mb = f"{w4.nbytes() / 1e6:.1f} / {shape[0] * shape[1] * 2 / 1e6:.1f}"
        print(f"{shape[0]:>6}x{shape[1]:<5} {rows:>5} {t4:>9.3f} {tb:>9.3f} {tb / t4:>8.2f}x {mb:>13}")


if __name__ == "__main__":
    main()
