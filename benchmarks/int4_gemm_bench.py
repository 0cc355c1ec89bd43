"""The CPU int4 GEMM (W4A16 weights kept packed: worker/engine/kernels/int4_gemm.cpp) beside
the native bf16 GEMM on the same shapes, one thread, alternating rounds.

    python -m benchmarks.int4_gemm_bench                   # 3 rounds
    python -m benchmarks.int4_gemm_bench --rounds 5 --rows 1 4 32
    python -m benchmarks.int4_gemm_bench --engine 8x1024 --rounds 3   # whole-model decode
    python -m benchmarks.int4_gemm_bench --engine 8x1024 --act-order   # GPTQ desc_act (g_idx)
    python -m benchmarks.int4_gemm_bench --engine moe --rounds 3       # a Qwen3-MoE, experts int4 too

Per (shape, rows): the best of 7 repeats of 10 calls each, every round printed, then the
medians and bf16 time / int4 time (> 1: int4 faster).  The weight bytes each streams per
call are printed too: int4 reads about a quarter of bf16's (scales and zeros included).

``--engine SIZE``: batch-1 decode through the engine (one thread), a GPTQ int4 checkpoint
(group 128, symmetric) of the bf16 preset ``SIZE`` (benchmarks/model_presets.py) kept int4
on CPU, against the same checkpoint's dequantized weights saved as a bf16 model (what
dequantize-at-load holds: ``(q - z) * s`` rounded to bf16, on the native bf16 GEMM).
Both engines live side by side and alternate round by round: each round decodes
``--tokens`` tokens after a 16-token prompt; tokens/s is over the decode steps only.
``--engine moe``: cpu_linear_bench's Qwen3-MoE (6 layers, hidden 512, 8 experts of 768, top-2)
instead of a dense preset: attention projections and every expert kept int4, the router dense.
``--act-order``: the GPTQ checkpoint with act-order (``desc_act``, ``g_idx``): kept int4 in
group order, each projection gathering its input into that order first.
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


def _int4_twins(size: str, group: int, act_order: bool = False) -> tuple[Path, Path]:
    """(GPTQ int4 checkpoint, its dequantized weights as a bf16 checkpoint) of a preset."""
    from safetensors.torch import load_file, save_file

    from benchmarks.model_presets import build_preset_model
    from tests.support import quantized_factory as qf

    src = _moe_model() if size == "moe" else build_preset_model(size, dtype="bfloat16")
    tag = f"gptq{group}" + ("-act" if act_order else "")
    q_dir, d_dir = src.parent / f"{src.name}-{tag}", src.parent / f"{src.name}-{tag}-dequantized"
    if not (q_dir / "config.json").is_file() or not (d_dir / "config.json").is_file():
        q_tmp = q_dir.with_name(q_dir.name + ".tmp")
        _, dense = qf.write_gptq(src, q_tmp, group=group, sym=True, act_order=act_order)
        state = load_file(str(src / "model.safetensors"))
        state.update({k: v.to(torch.bfloat16) for k, v in dense.items()})
        d_tmp = d_dir.with_name(d_dir.name + ".tmp")
        qf._copy_side_files(src, d_tmp)
        save_file(state, str(d_tmp / "model.safetensors"), metadata={"format": "pt"})
        os.replace(q_tmp, q_dir)
        os.replace(d_tmp, d_dir)
    return q_dir, d_dir


def _moe_model() -> Path:
    """cpu_linear_bench's random Qwen3-MoE checkpoint (cached beside the presets)."""
    from benchmarks.cpu_linear_bench import build_moe
    from benchmarks.model_presets import build_preset_model

    out = build_preset_model("8x512", dtype="bfloat16").parent / "bench-qwen3moe-6x512-e8"
    if not (out / "config.json").is_file():
        tmp = out.with_name(out.name + ".tmp")
        build_moe(tmp)
        os.replace(tmp, out)
    return out


def _weight_bytes(model) -> tuple[int, int]:
    """(projection and expert weight bytes, every resident weight's bytes: those, the packed
    LM head, embeddings, norms, routers)."""
    from worker.engine.quantization.kept import weight_bytes

    proj = sum(weight_bytes(getattr(layer, name)) for layer in model.layers for name in layer._LINEAR_WEIGHTS)
    for layer in model.layers:  # MoE expert stacks: one packed weight per expert once packed
        moe = getattr(layer, "moe", None)
        if moe is not None:
            for stack in (moe.w13, moe.w2):
                if not isinstance(stack, torch.nn.Parameter):  # a Parameter is counted with the rest
                    proj += sum(weight_bytes(w) for w in stack) if isinstance(stack, list) else weight_bytes(stack)
    rest = sum(p.numel() * p.element_size() for p in model.parameters())
    head = model._lm_head_packed
    return proj, proj + rest + (weight_bytes(head) if head is not None else 0)


def _decode_tps(engine, tag: str, tokens: int) -> float:
    from common.protocol import GenerateRequest, SamplingParams

    prompt = list(range(3, 19))
    engine.add_request(GenerateRequest(request_id=tag, prompt_token_ids=prompt, params=SamplingParams(
        temperature=0.0, max_tokens=tokens, ignore_eos=True)))
    stamps = []
    while engine.has_unfinished():
        for delta in engine.step():
            stamps.extend([time.perf_counter()] * len(delta.token_ids))
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])  # decode steps after the prefill's token


def engine_main(size: str, rounds: int, tokens: int, group: int, act_order: bool = False) -> None:
    from worker.engine import Engine, EngineConfig

    q_dir, d_dir = _int4_twins(size, group, act_order)
    kw = dict(max_model_len=512, max_num_seqs=1, max_num_batched_tokens=64, num_threads=1, dtype="bfloat16")
    kept, dense = Engine(EngineConfig(model=str(q_dir), **kw)), Engine(EngineConfig(model=str(d_dir), **kw))
    print(f"{datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, 1 thread, preset {size}, GPTQ int4 group {group}{' act-order' if act_order else ''}, "
          f"{tokens} tokens a round")
    print(f"  kept:  {kept.runner.model.packing.name}\n  dense: {dense.runner.model.packing.name}")
    results = []
    for r in range(rounds):
        tk = _decode_tps(kept, f"k{r}", tokens)
        td = _decode_tps(dense, f"d{r}", tokens)
        results.append((tk, td))
        print(f"  round {r}: int4 kept {tk:7.1f} tok/s  bf16 dequantized {td:7.1f} tok/s  ratio {tk / td:.2f}x  "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)
    mk, md = statistics.median(t for t, _ in results), statistics.median(t for _, t in results)
    (pk, ak), (pd, ad) = _weight_bytes(kept.runner.model), _weight_bytes(dense.runner.model)
    mr = statistics.median(k / d for k, d in results)
    print(f"\nmedian batch-1 decode: int4 kept {mk:.1f} tok/s, bf16 dequantized {md:.1f} tok/s, ratio {mk / md:.2f}x "
          f"(median of the rounds' ratios {mr:.2f}x)")
    print(f"resident weights: projections {pk / 1e6:.1f} MB vs {pd / 1e6:.1f} MB ({pk / pd:.3f}x); "
          f"all weights {ak / 1e6:.1f} MB vs {ad / 1e6:.1f} MB ({ak / ad:.3f}x)")
    kept.close()
    dense.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 32])
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--engine", metavar="SIZE", help="whole-model batch-1 decode on this preset instead")
    ap.add_argument("--tokens", type=int, default=64, help="--engine: tokens decoded per round")
    ap.add_argument("--act-order", action="store_true", help="--engine: a GPTQ checkpoint with act-order (g_idx)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.engine:
        engine_main(args.engine, args.rounds, args.tokens, args.group, args.act_order)
        return
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
