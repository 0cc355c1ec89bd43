"""GPU check for one H200 (or any CUDA GPU): correctness and speed of the CUDA engine
in one run of under 8 minutes, ending with one markdown table.

Rows:
1. ``cuda tests``: the ``cuda``-marked pytest tests (Triton kernels on the GPU, CUDA
   engine vs HF, graphs vs eager, device placement, memory sizing).
2. ``HF parity (bf16)``: a random ~1B Llama and Qwen3 built here with transformers;
   prompt log-probabilities of our engine vs HF's (max abs difference) and greedy
   agreement (tokens equal before the first divergence: bf16 ties may differ late).
3. ``CUDA graphs``: greedy ids with graphs equal eager decode's.
4. ``throughput bs=B``: output tokens/s of the engine vs HF ``generate`` on the same
   B prompts (equal lengths, ``ignore_eos``), and the ratio.
5. ``roofline bs=1``: decode tokens/s x bytes read per token (weights + KV) / peak HBM
   bandwidth (``--peak-gbps``, H200: 4800).

On the GPU box (Python 3.12, torch, triton, transformers, numpy, safetensors preinstalled;
pyzmq/msgspec/falcon/uvicorn/httptools/supervisor carried as wheels in ``.whl/``:
``common.protocol`` needs msgspec, the tests import zmq), from the repo root:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && \\
    python3 -m benchmarks.gpu_check --out $OUT/gpu_check.md

``--dry-run`` runs the CPU-runnable parts (tiny models in fp32, no GPU rows) so the
script itself is tested in CI; without a GPU and without it the script exits with 2.
"""
from __future__ import annotations

import argparse
import gc
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]

# ~1B presets (TinyLlama-1.1B's shape; a Qwen3 of the same size), parameter counts checked by
# tests/test_gpu_check.py without allocating
PRESETS = {
    "llama": dict(arch="LlamaForCausalLM", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                  num_attention_heads=32, num_key_value_heads=8, vocab_size=32000),
    "qwen3": dict(arch="Qwen3ForCausalLM", hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=32000),
}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=320)


@dataclass
class Row:
    check: str
    model: str
    result: str  # "pass" / "FAIL" / a figure
    detail: str = ""


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama,qwen3", help="comma-separated presets: " + ",".join(PRESETS))
    p.add_argument("--batches", default="1,32,128", help="throughput batch sizes")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--device", default="cuda")
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="peak HBM bandwidth, GB/s (H200: 4800)")
    p.add_argument("--skip-tests", action="store_true", help="skip the cuda-marked pytest run")
    p.add_argument("--quick", action="store_true", help="smaller batches and outputs (a smoke run)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny models, fp32: exercise the script itself")
    p.add_argument("--out", default=None, help="also write the table to this file")
    args = p.parse_args(argv)
    args.model_list = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.model_list if m not in PRESETS]
    if unknown:
        p.error(f"unknown model preset(s) {unknown}; known: {', '.join(PRESETS)}")
    try:
        args.batch_list = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        p.error(f"--batches must be comma-separated integers, got {args.batches!r}")
    if not args.batch_list or min(args.batch_list) < 1:
        p.error("--batches needs positive batch sizes")
    if args.quick or args.dry_run:
        args.batch_list = [b for b in args.batch_list if b <= 32][:2] or [1]
        args.output_len = min(args.output_len, 32 if args.quick else 8)
        args.prompt_len = min(args.prompt_len, 64 if args.quick else 16)
    return args


def hf_config_dict(preset: str, tiny: bool = False) -> dict:
    cfg = dict(PRESETS[preset])
    if tiny:
        cfg.update(TINY)
        if "head_dim" in cfg:
            cfg["head_dim"] = TINY["hidden_size"] // TINY["num_attention_heads"]
    cfg.update(max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
               eos_token_id=2, initializer_range=0.02)
    return cfg


def param_count(cfg: dict) -> int:
    """Parameters of a Llama-family config, by arithmetic (no allocation)."""
    h, inter, layers, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    if cfg["arch"].startswith("Qwen3"):
        per_layer += 2 * d  # q_norm, k_norm
    embeddings = v * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return layers * per_layer + embeddings + h


def build_checkpoint(preset: str, out: Path, device: str, dtype, tiny: bool) -> Path:
    """A random checkpoint saved as safetensors (HF's own init, fixed seed)."""
    import torch
    import transformers

    cfg = hf_config_dict(preset, tiny)
    arch = cfg.pop("arch")
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**cfg)
    config.architectures = [arch]
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, arch)(config).to(dtype)
    model.save_pretrained(out)
    del model
    return out


def table(rows: list[Row], header: str) -> str:
    lines = [header, "", "| check | model | result | detail |", "| --- | --- | --- | --- |"]
    lines += [f"| {r.check} | {r.model} | {r.result} | {r.detail} |" for r in rows]
    return "\n".join(lines)


def run_cuda_tests(timeout: float = 300) -> Row:
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider"],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Row("cuda tests", "-", "FAIL", f"timed out after {timeout:.0f} s")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", proc.stdout)}
    ok = proc.returncode == 0 and counts.get("passed", 0) > 0
    detail = ", ".join(f"{n} {k}" for k, n in counts.items()) or proc.stdout.strip()[-200:]
    return Row("cuda tests", "-", "pass" if ok else "FAIL", detail)


class EngineRunner:
    """Our engine on one checkpoint, with the request helpers the checks share."""

    def __init__(self, model_dir: Path, device: str, dtype: str, max_num_seqs: int, eager: bool,
                 max_model_len: int):
        from worker.engine import Engine, EngineConfig

        self.engine = Engine(EngineConfig(model=str(model_dir), device=device, dtype=dtype, tokens_only=True,
                                          enforce_eager=eager, max_num_seqs=max_num_seqs,
                                          max_model_len=max_model_len, max_num_batched_tokens=8192))

    def generate(self, prompts: list[list[int]], max_tokens: int, **params) -> list[list[int]]:
        from common.protocol import GenerateRequest, SamplingParams

        reqs = [GenerateRequest(request_id=str(i), prompt_token_ids=p,
                                params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                                      **params)) for i, p in enumerate(prompts)]
        res = self.engine.generate(reqs)
        return [res[str(i)][0] for i in range(len(prompts))]

    def close(self) -> None:
        self.engine.close()
        del self.engine
        gc.collect()
        _empty_cache()


def _empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    _sync()
    start = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - start


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def hf_parity(hf, ours: EngineRunner, name: str, vocab: int, device: str, out_len: int) -> list[Row]:
    import torch

    prompt = prompts_for(1, 48, vocab, seed=1)[0]
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt], device=device)).logits[0].float()
        ref = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].cpu()
        hf_ids = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=out_len, min_new_tokens=out_len,
                             do_sample=False)[0, len(prompt):].tolist()
    delta = ours.generate([prompt], out_len, prompt_logprobs=0)[0]
    ours_lp = torch.tensor(delta.prompt_logprobs.logprobs)  # positions 1..L-1, as ``ref``
    diff = float((ours_lp - ref).abs().max())
    agree = next((i for i, (a, b) in enumerate(zip(delta.token_ids, hf_ids)) if a != b), len(hf_ids))
    tol = 0.1 if "bfloat16" in str(hf.dtype) else 1e-3
    return [Row("HF parity: prompt logprobs", name, "pass" if diff < tol else "FAIL", f"max abs diff {diff:.4f}"),
            Row("HF parity: greedy", name, f"{agree}/{len(hf_ids)}", "tokens equal before the first divergence")]


def throughput(hf, ours: EngineRunner, name: str, vocab: int, device: str, batches: list[int], p_len: int,
               out_len: int) -> list[Row]:
    import torch

    rows = []
    for b in batches:
        prompts = prompts_for(b, p_len, vocab, seed=100 + b)
        ours.generate(prompts[:1], 2)  # warm-up
        _, t_ours = timed(lambda: ours.generate(prompts, out_len))
        ids = torch.tensor(prompts, device=device)
        with torch.inference_mode():
            _, t_hf = timed(lambda: hf.generate(ids, max_new_tokens=out_len, min_new_tokens=out_len,
                                                do_sample=False, attention_mask=torch.ones_like(ids)))
        ours_tps, hf_tps = b * out_len / t_ours, b * out_len / t_hf
        rows.append(Row(f"throughput bs={b}", name, f"{ours_tps / hf_tps:.2f}x HF",
                        f"engine {ours_tps:.0f} tok/s, HF generate {hf_tps:.0f} tok/s ({p_len} in / {out_len} out)"))
    return rows


def roofline(ours: EngineRunner, name: str, vocab: int, p_len: int, out_len: int, peak_gbps: float,
             weight_bytes: int, kv_bytes_per_token: int) -> Row:
    prompt = prompts_for(1, p_len, vocab, seed=7)
    ours.generate(prompt, 2)
    _, t_prefill = timed(lambda: ours.generate(prompt, 1))
    _, t_total = timed(lambda: ours.generate(prompt, out_len))
    decode_tps = (out_len - 1) / max(t_total - t_prefill, 1e-9)
    per_token = weight_bytes + kv_bytes_per_token * (p_len + out_len / 2)
    pct = decode_tps * per_token / (peak_gbps * 1e9) * 100
    return Row("roofline bs=1", name, f"{pct:.1f}% of {peak_gbps:.0f} GB/s",
               f"decode {decode_tps:.0f} tok/s, {per_token / 1e9:.2f} GB read per token")


def check_model(preset: str, args: argparse.Namespace, workdir: Path) -> list[Row]:
    import torch

    device = "cpu" if args.dry_run else args.device
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    dtype_name = "float32" if args.dry_run else "bfloat16"
    path = build_checkpoint(preset, workdir / preset, device, dtype, tiny=args.dry_run)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    vocab = hf.config.vocab_size
    name = f"{preset} ({param_count(hf_config_dict(preset, args.dry_run)) / 1e9:.2f}B, {dtype_name})"
    max_seqs = max(args.batch_list)
    max_len = args.prompt_len + args.output_len + 64
    rows: list[Row] = []
    ours = EngineRunner(path, device, dtype_name, max_seqs, eager=False, max_model_len=max_len)
    try:
        rows += hf_parity(hf, ours, name, vocab, device, min(args.output_len, 32))
        if device != "cpu":
            prompts = prompts_for(11, 40, vocab, seed=3)  # 11 rows: a padded graph batch
            with_graphs = [d.token_ids for d in ours.generate(prompts, 16)]
            ours.close()
            ours = EngineRunner(path, device, dtype_name, max_seqs, eager=True, max_model_len=max_len)
            eager = [d.token_ids for d in ours.generate(prompts, 16)]
            ours.close()
            ours = EngineRunner(path, device, dtype_name, max_seqs, eager=False, max_model_len=max_len)
            same = sum(a == b for a, b in zip(with_graphs, eager))
            rows.append(Row("CUDA graphs vs eager", name, "pass" if same == len(prompts) else "FAIL",
                            f"{same}/{len(prompts)} identical greedy outputs"))
        else:
            rows.append(Row("CUDA graphs vs eager", name, "skipped", "CPU dry run"))
        rows += throughput(hf, ours, name, vocab, device, args.batch_list, args.prompt_len, args.output_len)
        mc = ours.engine.model_config
        weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
        kv_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * dtype.itemsize
        rows.append(roofline(ours, name, vocab, args.prompt_len, args.output_len, args.peak_gbps, weight_bytes,
                             kv_per_token))
    finally:
        ours.close()
        del hf
        gc.collect()
        _empty_cache()
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check needs a CUDA GPU (use --dry-run to exercise the script on CPU)", file=sys.stderr)
        return 2
    started = time.perf_counter()
    rows: list[Row] = []
    if not args.skip_tests and not args.dry_run:
        rows.append(run_cuda_tests())
    with tempfile.TemporaryDirectory(prefix="tokserve-gpu-check-") as tmp:
        for preset in args.model_list:
            rows += check_model(preset, args, Path(tmp))
    machine = "CPU dry run" if args.dry_run else torch.cuda.get_device_name()
    header = (f"GPU check on {machine}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
              f"{time.perf_counter() - started:.0f} s")
    out = table(rows, header)
    print(out)
    if args.out:
        Path(args.out).write_text(out + "\n", encoding="utf-8")
    return 1 if any(r.result == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
