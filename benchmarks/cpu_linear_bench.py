"""CPU linears side by side: our native bf16 GEMM vs what bf16 ran on before it (torch's
linear, oneDNN where it packs bf16) vs fp32 with oneDNN, first per GEMM, then in the engine.

    python -m benchmarks.cpu_linear_bench                 # GEMMs + engine, 2 alternating rounds
    python -m benchmarks.cpu_linear_bench --skip-engine   # GEMMs only (a minute)

GEMMs: the 8-layer/512-hidden Llama's projection shapes ([1536, 512] qkv-like, [512, 1536]
down, [3072, 512] gate_up, [8192, 512] head) at 1, 4, 32 and 512 rows, one thread, medians
of torch.utils.benchmark; the weight bytes streamed per second at one row beside a plain
single-thread read of a buffer far larger than the caches (decode is bandwidth-bound).

Engine: the same model (random weights: the 8x512 Llama, or with ``--model moe`` a
Qwen3-MoE of 6 layers, hidden 512, 8 experts of 768, top-2) through ``Engine.generate`` in
each configuration,
alternating configurations every round, fresh prompts each round, every round printed,
then medians and ratios to the first configuration: batch-1 decode (1 x 128 in / 64 out,
time per output token), concurrent decode (32 x 128 / 128, output tok/s) and a
prefill-bound load (16 x 512 / 8, total tok/s).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.benchmark as tb

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_throughput import build_model, make_prompts  # noqa: E402
from common.protocol import GenerateRequest, SamplingParams  # noqa: E402
from worker.engine import Engine, EngineConfig  # noqa: E402
from worker.engine.models.cpu_gemm import (linear_scheme, native_supported, onednn_supported,  # noqa: E402
                                           resolve_cpu_linear)

CPU = torch.device("cpu")
SHAPES = [(1536, 512), (512, 1536), (3072, 512), (8192, 512)]
ROWS = [1, 4, 32, 512]


def _median_s(fn, *args) -> float:
    return tb.Timer("fn(*args)", globals={"fn": fn, "args": args}).blocked_autorange(min_run_time=0.4).median


def read_bandwidth_gbs() -> float:
    """One thread summing a 512 MB buffer: what a streaming read reaches on this core."""
    buf = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    buf.sum()
    best = min(_median_s(torch.sum, buf) for _ in range(2))
    return buf.numel() * 4 / best / 1e9


def gemm_table() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bw = read_bandwidth_gbs()
        print(f"single-thread streaming read: {bw:.1f} GB/s")
        configs = []
        if native_supported(CPU, torch.bfloat16):
            configs.append(("bf16 native", torch.bfloat16, linear_scheme("native")))
        if onednn_supported(CPU, torch.bfloat16):
            configs.append(("bf16 oneDNN", torch.bfloat16, linear_scheme("onednn")))
        configs.append(("bf16 torch", torch.bfloat16, None))
        if onednn_supported(CPU, torch.float32):
            configs.append(("fp32 oneDNN", torch.float32, linear_scheme("onednn")))
        print(f"{'weight':>12} {'rows':>5} " + " ".join(f"{name:>22}" for name, _, _ in configs))
        for n, k in SHAPES:
            w32 = torch.randn(n, k)
            packed = {name: (scheme.pack(w32.to(dt)) if scheme else w32.to(dt)) for name, dt, scheme in configs}
            for rows in ROWS:
                x32 = torch.randn(rows, k)
                cells = []
                for name, dt, scheme in configs:
                    fn = scheme.linear if scheme else F.linear
                    s = _median_s(fn, x32.to(dt), packed[name], None)
                    extra = f"{n * k * dt.itemsize / s / 1e9:5.1f} GB/s" if rows == 1 else \
                        f"{2 * rows * n * k / s / 1e9:5.1f} GF/s"
                    cells.append(f"{s * 1e6:8.0f} us {extra}")
                print(f"{f'[{n},{k}]':>12} {rows:>5} " + " ".join(f"{c:>22}" for c in cells))
    finally:
        torch.set_num_threads(threads)


# (name, requests, prompt tokens, output tokens, whether prompt tokens count in tok/s)
WORKLOADS = [("batch-1 decode", 1, 128, 64, False), ("decode conc 32", 32, 128, 128, False),
             ("prefill-bound", 16, 512, 8, True)]


def _engine(model_dir: Path, dtype: str, cpu_linear: str, threads: int) -> Engine:
    engine = Engine(EngineConfig(model=str(model_dir), tokens_only=True, dtype=dtype, max_num_seqs=32,
                                 max_num_batched_tokens=2048, enable_prefix_caching=False, max_model_len=1024,
                                 num_threads=threads, cpu_linear=cpu_linear))
    engine.generate([GenerateRequest(request_id="warm", prompt_token_ids=[5] * 16,
                                     params=SamplingParams(max_tokens=4))])
    return engine


def _run(engine: Engine, n: int, prompt_len: int, out_len: int, with_prompt: bool, seed: int) -> float:
    """The workload's figure: seconds per output token at batch 1, else tokens/s."""
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    prompts = make_prompts(n, prompt_len, 8192, seed)
    reqs = [GenerateRequest(request_id=f"{seed}-{i}", prompt_token_ids=p, params=params) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    engine.generate(reqs)
    elapsed = time.perf_counter() - t0
    if n == 1:
        return elapsed / out_len
    return n * (out_len + (prompt_len if with_prompt else 0)) / elapsed


def build_moe(out: Path) -> Path:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    config = transformers.Qwen3MoeConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, use_sliding_window=False)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(out)
    return out


def engine_table(rounds: int, threads: int, model: str = "llama") -> None:
    configs = []
    if native_supported(CPU, torch.bfloat16):
        configs.append(("bf16 native", "bfloat16", "native"))
    before = resolve_cpu_linear("onednn" if onednn_supported(CPU, torch.bfloat16) else "torch", CPU, torch.bfloat16)
    configs.append((f"bf16 {before}", "bfloat16", before))
    configs.append(("fp32 " + resolve_cpu_linear("auto", CPU, torch.float32), "float32", "auto"))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp), shape="8x512") if model == "llama" else build_moe(Path(tmp))
        engines = {name: _engine(model_dir, dtype, linear, threads) for name, dtype, linear in configs}
        results: dict[tuple[str, str], list[float]] = {}
        for r in range(rounds):
            order = configs if r % 2 == 0 else configs[::-1]
            for wl, n, p, o, with_prompt in WORKLOADS:
                for name, _, _ in order:
                    v = _run(engines[name], n, p, o, with_prompt, seed=1000 * r + n)
                    results.setdefault((wl, name), []).append(v)
                    shown = f"{v * 1e3:.2f} ms/token" if n == 1 else f"{v:.0f} tok/s"
                    print(f"round {r + 1} {wl:>15} {name:>12}: {shown}", flush=True)
        print(f"\nmedians over {rounds} rounds, {threads} thread(s); ratio = first column's speed / this one's")
        print(f"{'workload':>15} " + " ".join(f"{name:>24}" for name, _, _ in configs))
        for wl, n, _, _, _ in WORKLOADS:
            base = statistics.median(results[(wl, configs[0][0])])
            cells = []
            for name, _, _ in configs:
                v = statistics.median(results[(wl, name)])
                ratio = v / base if n == 1 else base / v
                cells.append((f"{v * 1e3:.2f} ms/tok" if n == 1 else f"{v:.0f} tok/s") + f" (x{ratio:.2f})")
            print(f"{wl:>15} " + " ".join(f"{c:>24}" for c in cells))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="engine compute threads (the GEMM table uses 1)")
    p.add_argument("--skip-gemm", action="store_true")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--model", default="llama", choices=["llama", "moe"], help="the engine table's model")
    args = p.parse_args(argv)
    if not args.skip_gemm:
        gemm_table()
    if not args.skip_engine:
        engine_table(args.rounds, args.threads, args.model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
