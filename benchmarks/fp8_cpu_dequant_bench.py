"""Why FP8 checkpoints load dequantized on CPU (docs/quantization.md): a CPU without FP8
dot products would have to turn a kept FP8 weight back into floats at every call.  This
times torch's way of doing that (``q.float() * scale`` then the GEMM) beside the GEMM on
the weight dequantized once at load, one thread, the best of 5 repeats of 10 calls.

    python -m benchmarks.fp8_cpu_dequant_bench
"""
from __future__ import annotations

import datetime
import os
import platform

import torch
import torch.nn.functional as F

from benchmarks.int4_gemm_bench import best_ms

SHAPES = [(4096, 4096), (11008, 4096)]


def main() -> None:
    torch.set_num_threads(1)
    print(f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, 1 thread, torch {torch.__version__}")
    print("| weight | rows | dequantized at load (fp32 GEMM) | FP8 kept, dequantized per call | ratio |")
    print("|---|---|---|---|---|")
    for n, k in SHAPES:
        w = torch.randn(n, k) * 0.02
        scale = w.abs().amax(1) / 448
        q = (w / scale[:, None]).to(torch.float8_e4m3fn)
        dense = q.float() * scale[:, None]
        for m in (1, 32):
            x = torch.randn(m, k)
            at_load = best_ms(lambda: F.linear(x, dense), repeats=5)
            per_call = best_ms(lambda: F.linear(x, q.float() * scale[:, None]), repeats=5)
            print(f"| {n} x {k} | {m} | {at_load:.2f} ms | {per_call:.2f} ms | {per_call / at_load:.1f}x |")


if __name__ == "__main__":
    main()
