"""Where a batch-1 bf16 decode step goes on CPU (issue 40's roofline), one thread, the
8x512 bf16 preset vs_vllm_cpu serves (benchmarks/model_presets.py), in one process:

    python -m benchmarks.batch1_breakdown [--rounds 5] [--tokens 64]

Per round, alternating: the engine's decode steps (``Engine.step`` wall time, median over
``--tokens`` steps after a 128-token prompt: what a client's ITL is at batch 1), the 33
projection GEMMs and the LM head of one step alone on the model's packed weights (every
weight read once per pass, 42 MB > this CPU's L2 + L3 share, so from memory: the
bandwidth part of the step), and one layer's decode attention at the step's context.
Then the roofline: weight bytes per step / step time and / GEMM time against a
one-thread read and copy of a 256 MB buffer, and what is left of the step after its
GEMMs and attention (host work: planning, Python per layer, KV writes, sampling).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.model_presets import build_preset_model  # noqa: E402
from benchmarks.vs_vllm_cpu import memory_bandwidth  # noqa: E402
from common.protocol import GenerateRequest, SamplingParams  # noqa: E402
from worker.engine import Engine, EngineConfig  # noqa: E402

PROMPT = 128


def _step_times(engine: Engine, tag: str, tokens: int) -> list[float]:
    engine.add_request(GenerateRequest(request_id=tag, prompt_token_ids=list(range(3, 3 + PROMPT)),
                                       params=SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)))
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times[1:]  # decode steps (the first one is the prompt's)


def _weights(model) -> list[tuple[object, int]]:
    """(packed weight, input width) of every projection and the LM head, in step order."""
    out = []
    for layer in model.layers:
        for name in layer._LINEAR_WEIGHTS:
            out.append((getattr(layer, name), int(getattr(layer, name).shape[1])))
    head = model._lm_head_packed
    out.append((head, int(head.shape[1])))
    return out


def _gemm_pass(model, repeats: int = 30) -> float:
    """Median seconds of one pass over every projection and the head at one row."""
    linear = model.packing.linear
    weights = _weights(model)
    xs = {k: torch.randn(1, k, dtype=torch.bfloat16) for _, k in weights}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for w, k in weights:
            linear(xs[k], w, None)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _attention(engine: Engine, context: int, repeats: int = 300) -> float:
    """Median seconds of one layer's decode attention kernel for one sequence at
    ``context`` tokens, over a cache in the engine's layout."""
    from worker.engine.kernels import load_cpu_kernels
    from worker.engine.models import kv_cache_shape

    kernels = load_cpu_kernels()
    if kernels is None:
        return float("nan")
    cfg = engine.runner.model.config
    block = engine.config.block_size
    blocks = -(-context // block)
    kv = torch.randn(kv_cache_shape(cfg, blocks, block), dtype=torch.bfloat16)[:, 0]  # one layer's K and V
    q = torch.randn(1, cfg.num_attention_heads, cfg.head_dim, dtype=torch.bfloat16)
    tables = torch.arange(blocks, dtype=torch.int32).reshape(1, blocks)
    lens = torch.tensor([context], dtype=torch.int32)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        kernels.paged_decode_attention(q, kv[0], kv[1], tables, lens, cfg.head_dim ** -0.5)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    src = build_preset_model("8x512", dtype="bfloat16")
    engine = Engine(EngineConfig(model=str(src), max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=256,
                                 num_threads=1))
    model = engine.runner.model
    weight_bytes = sum(int(w.shape[0]) * k * 2 for w, k in _weights(model))
    layers = len(model.layers)
    print(f"preset 8x512 bf16, linears {model.packing.name}, 1 thread, {weight_bytes / 1e6:.1f} MB of weights "
          f"per step (projections + head), {layers} layers, prompt {PROMPT}, {args.tokens} tokens a round")
    _step_times(engine, "warm", 8)
    rows = []
    for r in range(args.rounds):
        bw = memory_bandwidth()
        step = statistics.median(_step_times(engine, f"r{r}", args.tokens))
        gemm = _gemm_pass(model)
        attn = _attention(engine, PROMPT + args.tokens // 2) * layers
        rows.append((step, gemm, attn, bw["read_gb_s"], bw["copy_gb_s"]))
        print(f"round {r}: step {step * 1e3:.2f} ms = GEMMs {gemm * 1e3:.2f} + attention {attn * 1e3:.2f} "
              f"+ the rest {(step - gemm - attn) * 1e3:.2f} ms; 1-thread read {bw['read_gb_s']:.1f} GB/s, "
              f"copy {bw['copy_gb_s']:.1f} GB/s", flush=True)
    step, gemm, attn, read, copy = (statistics.median(c) for c in zip(*rows))
    print(f"\nmedians: step (ITL at batch 1) {step * 1e3:.2f} ms, GEMMs {gemm * 1e3:.2f} ms, attention "
          f"{attn * 1e3:.2f} ms, the rest {(step - gemm - attn) * 1e3:.2f} ms")
    print(f"roofline: {weight_bytes / 1e6:.1f} MB / step {step * 1e3:.2f} ms = {weight_bytes / step / 1e9:.1f} GB/s = "
          f"{weight_bytes / step / 1e9 / copy * 100:.0f} % of copy ({copy:.1f} GB/s), "
          f"{weight_bytes / step / 1e9 / read * 100:.0f} % of read ({read:.1f} GB/s); the GEMMs alone "
          f"{weight_bytes / gemm / 1e9:.1f} GB/s = {weight_bytes / gemm / 1e9 / read * 100:.0f} % of read")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
