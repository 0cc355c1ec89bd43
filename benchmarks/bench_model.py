"""Model forward micro-benchmarks on a random ~125M Llama (GPT-2-small sized), side
by side in one run.

    python benchmarks/bench_model.py [--batch 32] [--context 512] [--steps 10] [--dtype float32]
    python -m benchmarks.bench_model --kv-fp8 [--batch 32] [--context 512] [--steps 16] [--rounds 5]

Rows (time per step; ratio to the first row of each group):
- attention (one layer, decode of ``batch`` sequences): our batched paged SDPA vs a
  per-sequence loop (gather blocks, repeat KV heads, SDPA per sequence);
- attention with the compiled kernel (worker/engine/kernels) when it builds, and
  prefill attention (4 fresh 512-token prompts; 4 chunks after cached context):
  SDPA per sequence vs the compiled prefill kernel;
- full model: decode step of ``batch`` sequences, a mixed step (one 256-token
  prefill chunk with context + ``batch-1`` decodes), a 512-token prefill; with
  torch's ops, then with the engine's CPU defaults (oneDNN linears, native kernels);
- build_attention_metadata for the decode batch.

``--kv-fp8`` runs only the FP8 KV-cache comparison (issue 43): decode of ``batch``
sequences from ``context`` tokens on, one thread, the 8x512 preset's shape
(benchmarks/model_presets.py) in bf16 with the engine's CPU linears, in three
configurations: the native kernels over an FP8 (e4m3) cache, torch SDPA over the same
FP8 cache (the CPU path before the kernels read FP8), the native kernels over a bf16
cache.  Rounds alternate the configurations; each times ``steps`` consecutive decode
steps (every row one token longer per step, as in the engine, so SDPA's decode K/V
mirror appends instead of re-gathering), one layer's attention alone and the whole
model step (forward + logits), each the median of its steps in thread CPU time.  Every
round printed, then medians and ratios.
"""
from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F

from worker.engine.attention.backends.cpu_native import CpuNativeBackend
from worker.engine.attention.backends.torch_sdpa import TorchSDPABackend
from worker.engine.attention.metadata import build_attention_metadata
from worker.engine.models.config import ModelConfig
from worker.engine.kernels import load_cpu_kernels
from worker.engine.models import LlamaForCausalLM, kv_cache_shape
from worker.engine.models.cpu_gemm import onednn_supported

BLOCK = 16


def _time(fn, steps: int) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps


def random_model(dtype: torch.dtype) -> LlamaForCausalLM:
    cfg = ModelConfig.from_dicts(".", {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 768, "intermediate_size": 2048,
        "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 32000,
        "max_position_embeddings": 4096})
    model = LlamaForCausalLM(cfg, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model


def naive_decode_attention(q, kv_layer, tables, seq_lens, group, scale):
    """Reference: one SDPA per sequence over its gathered, head-repeated keys."""
    out = []
    for i, (table, n) in enumerate(zip(tables, seq_lens)):
        kv = kv_layer[:, table].reshape(2, -1, kv_layer.shape[-2], kv_layer.shape[-1])[:, :n]
        k = kv[0].transpose(0, 1).repeat_interleave(group, 0)
        v = kv[1].transpose(0, 1).repeat_interleave(group, 0)
        out.append(F.scaled_dot_product_attention(q[i][:, None], k, v, scale=scale)[:, 0])
    return torch.stack(out).flatten(1)


def kv_fp8_comparison(batch: int, context: int, steps: int, rounds: int) -> None:
    import statistics

    from benchmarks.model_presets import SIZES
    from worker.engine.models.cpu_gemm import linear_scheme, resolve_cpu_linear

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dtype, cpu = torch.bfloat16, torch.device("cpu")
    kernels = load_cpu_kernels()
    assert kernels is not None, "the comparison needs the compiled kernels"
    cfg = ModelConfig.from_dicts(".", {"architectures": ["LlamaForCausalLM"], **SIZES["8x512"]})
    model = LlamaForCausalLM(cfg, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    linears = resolve_cpu_linear("auto", cpu, dtype)
    if linear_scheme(linears) is not None:
        model.pack_linears(linear_scheme(linears))
    per_seq = -(-(context + steps + 1) // BLOCK)
    blocks = list(range(batch * per_seq))
    random.Random(0).shuffle(blocks)
    tables = [blocks[i * per_seq:(i + 1) * per_seq] for i in range(batch)]
    start = [context - (i * 7) % 64 for i in range(batch)]  # uneven lengths, as a real batch
    dense = torch.randn(kv_cache_shape(cfg, len(blocks), BLOCK), dtype=dtype) * 0.5
    fp8 = dense.to(torch.float8_e4m3fn)
    configs = {  # name: (backend, cache)
        "native / FP8": (CpuNativeBackend(kernels, kv_fp8=True), fp8),
        "SDPA / FP8": (TorchSDPABackend(), fp8),
        "native / bf16": (CpuNativeBackend(kernels), dense),
    }
    q = torch.randn(batch, cfg.num_attention_heads, cfg.head_dim, dtype=dtype)
    k = torch.randn(batch, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype) * 0.5
    ids = torch.randint(0, cfg.vocab_size, (batch,))
    layer = model.layers[0].attn

    def decode_run(cache, fn) -> float:
        """Median ms per step of ``steps`` consecutive decode steps (after one untimed step),
        in this thread's CPU time: on a shared 2-core box wall time also counts the time other
        processes hold the core, which swamped the differences measured here."""
        metas = [build_attention_metadata([1] * batch, [n + s for n in start], tables, BLOCK)
                 for s in range(steps + 1)]
        fn(metas[0], cache)
        per_step = []
        for a in metas[1:]:
            t0 = time.thread_time()
            fn(a, cache)
            per_step.append(time.thread_time() - t0)
        return statistics.median(per_step) * 1e3

    def attention(a, cache):
        layer(q, k, k, cache[:, 0], a)

    def model_step(a, cache):
        model.compute_logits(model(ids, a.positions, a, cache))

    print(f"model: 8x512 preset ({cfg.num_hidden_layers}L h{cfg.hidden_size} {cfg.num_attention_heads}q/"
          f"{cfg.num_key_value_heads}kv heads, head_dim {cfg.head_dim}) bf16, {linears} linears, 1 thread; "
          f"decode of {batch} sequences from {min(start)}-{max(start)} tokens, {steps} steps per timing, "
          f"{rounds} rounds alternating; KV cache {dense.element_size()} / {fp8.element_size()} bytes per value")
    times: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds):
        for name, (backend, cache) in configs.items():
            model.use_attention_backend(backend)  # fresh impls: no state carried between configurations
            with torch.no_grad():
                attn_ms = decode_run(cache, attention)
                step_ms = decode_run(cache, model_step)
            times.setdefault((name, "attn"), []).append(attn_ms)
            times.setdefault((name, "step"), []).append(step_ms)
            print(f"round {r + 1}  {name:14s}  attention (one layer) {attn_ms:7.3f} ms   "
                  f"model step {step_ms:7.2f} ms ({batch / step_ms * 1e3:6.0f} tok/s)")
    base = list(configs)[0]
    print(f"\nmedians of {rounds} rounds, thread CPU ms per step (ratio: time / {base}'s):")
    print("| configuration | attention, one layer | ratio | decode step | ratio | tok/s |")
    print("|---|---|---|---|---|---|")
    for name in configs:
        a, st = (statistics.median(times[(name, kind)]) for kind in ("attn", "step"))
        a0, s0 = (statistics.median(times[(base, kind)]) for kind in ("attn", "step"))
        print(f"| {name} | {a:.3f} ms | {a / a0:.2f}x | {st:.2f} ms | {st / s0:.2f}x | {batch / st * 1e3:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--kv-fp8", action="store_true", help="only the FP8 KV-cache comparison (bf16, 8x512, 1 thread)")
    ap.add_argument("--rounds", type=int, default=5, help="--kv-fp8: alternating rounds")
    args = ap.parse_args()
    if args.kv_fp8:
        kv_fp8_comparison(args.batch, args.context, args.steps, args.rounds)
        return
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = random_model(dtype)
    cfg, b, ctx = model.config, args.batch, args.context
    per_seq = -(-(ctx + 300) // BLOCK)
    blocks = list(range(b * per_seq + per_seq))
    random.Random(0).shuffle(blocks)
    tables = [blocks[i * per_seq:(i + 1) * per_seq] for i in range(b)]
    kv = torch.randn(kv_cache_shape(cfg, len(blocks), BLOCK), dtype=dtype) * 0.5
    print(f"model: 125M-class Llama ({cfg.num_hidden_layers}L h{cfg.hidden_size} {cfg.num_attention_heads}q/"
          f"{cfg.num_key_value_heads}kv heads) {args.dtype}, {torch.get_num_threads()} threads; "
          f"batch {b}, context {ctx}")

    # Attention alone, one layer.
    lens = [ctx - (i * 7) % 64 for i in range(b)]
    attn = build_attention_metadata([1] * b, [n - 1 for n in lens], tables, BLOCK)
    layer = model.layers[0].attn
    q = torch.randn(b, cfg.num_attention_heads, cfg.head_dim, dtype=dtype)
    k = torch.randn(b, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
    ours = _time(lambda: layer(q, k, k, kv[:, 0], attn), args.steps * 5)
    naive = _time(lambda: naive_decode_attention(q, kv[:, 0], tables, lens, layer.impl.group, layer.impl.scale),
                  args.steps * 5)
    got = layer(q, k, k, kv[:, 0], attn)
    ref = naive_decode_attention(q, kv[:, 0], tables, lens, layer.impl.group, layer.impl.scale)
    assert torch.allclose(got, ref, atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    print("\nattention, one layer, decode:")
    print(f"  batched paged SDPA      {ours * 1e3:8.3f} ms   1.00x")
    print(f"  per-sequence loop       {naive * 1e3:8.3f} ms   {naive / ours:.2f}x slower")
    kernels = load_cpu_kernels() if dtype == torch.float32 else None
    if kernels is not None:
        layer.set_backend(CpuNativeBackend(kernels))
        native = _time(lambda: layer(q, k, k, kv[:, 0], attn), args.steps * 5)
        assert torch.allclose(layer(q, k, k, kv[:, 0], attn), ref, atol=1e-5)
        layer.set_backend(TorchSDPABackend())
        print(f"  native paged kernel     {native * 1e3:8.3f} ms   {ours / native:.2f}x faster")

        # Prefill: 4 fresh 512-token prompts, then 4 chunks of 256 after 256 cached tokens.
        for label, q_len, c_len in (("4 x 512 fresh prompts", 512, 0), ("4 x 256 after 256 cached", 256, 256)):
            pa = build_attention_metadata([q_len] * 4, [c_len] * 4, tables[:4], BLOCK)
            qp = torch.randn(4 * q_len, cfg.num_attention_heads, cfg.head_dim, dtype=dtype)
            kp = torch.randn(4 * q_len, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
            sdpa = _time(lambda: layer(qp, kp, kp, kv[:, 0], pa), args.steps)
            expected = layer(qp, kp, kp, kv[:, 0], pa)
            layer.set_backend(CpuNativeBackend(kernels))
            pa.plan = None  # the per-step plan differs with the kernels
            fast = _time(lambda: layer(qp, kp, kp, kv[:, 0], pa), args.steps)
            assert torch.allclose(layer(qp, kp, kp, kv[:, 0], pa), expected, atol=1e-4)
            layer.set_backend(TorchSDPABackend())
            pa.plan = None
            print(f"\nattention, one layer, prefill {label}:")
            print(f"  SDPA per sequence       {sdpa * 1e3:8.3f} ms   1.00x")
            print(f"  native prefill kernel   {fast * 1e3:8.3f} ms   {sdpa / fast:.2f}x faster")

    def step(q_lens, c_lens, tabs):
        a = build_attention_metadata(q_lens, c_lens, tabs, BLOCK)
        ids = torch.randint(0, cfg.vocab_size, (sum(q_lens),))
        h = model(ids, a.positions, a, kv)
        return model.compute_logits(h[a.query_start_loc[1:].long() - 1])

    def steps(label):
        decode = _time(lambda: step([1] * b, lens, tables), args.steps)
        mixed = _time(lambda: step([256] + [1] * (b - 1), [ctx - 256] + lens[1:], tables), args.steps)
        prefill = _time(lambda: step([512], [0], tables[:1]), max(2, args.steps // 2))
        print(f"\nfull model step (forward + logits of last tokens), {label}:")
        print(f"  decode {b} seqs          {decode * 1e3:8.2f} ms   1.00x   ({b / decode:7.0f} tok/s)")
        print(f"  mixed 256 + {b - 1} decodes  {mixed * 1e3:8.2f} ms   {mixed / decode:.2f}x   "
              f"({(256 + b - 1) / mixed:7.0f} tok/s)")
        print(f"  prefill 512 tokens      {prefill * 1e3:8.2f} ms   {prefill / decode:.2f}x   "
              f"({512 / prefill:7.0f} tok/s)")
        return decode

    decode = steps("torch ops (MKL linears, SDPA)")
    build = _time(lambda: build_attention_metadata([1] * b, lens, tables, BLOCK), 200)
    if dtype == torch.float32 and onednn_supported(torch.device("cpu"), dtype):
        model.pack_linears()  # the engine's CPU defaults, same weights
        if kernels is not None:
            model.use_attention_backend(CpuNativeBackend(kernels))
        steps("engine CPU defaults (oneDNN linears" + (", native kernels)" if kernels is not None else ")"))
    print(f"\nbuild_attention_metadata, {b} decodes: {build * 1e6:.0f} us "
          f"({build / decode * 100:.2f}% of a decode step)")


if __name__ == "__main__":
    main()
