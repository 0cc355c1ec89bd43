"""GPU check for one H200 (or any CUDA GPU): correctness and speed of the CUDA engine in
one run of under 8 minutes, ending with ONE markdown table (also written to ``--out``).

**Not yet run on a GPU**: no device has been lent to this project so far; only
``--dry-run`` (CPU) has run.

Rows (in this order):

1. ``cuda tests``: ``pytest -m cuda -q`` in a subprocess over the test files that carry
   ``cuda`` marks (so files importing zmq/falcon are not even collected), capped at
   ``--tests-timeout`` s; passed / failed / skipped counts and the failed tests' names.
2. ``HF parity`` on a random ~1B Llama (TinyLlama-1.1B's shape), a random ~1B Qwen3
   (q/k norm, GQA) and a random ~1.1B Qwen3-MoE (32 experts, top-4; last, so the time
   budget skips it first), built here with transformers' config classes, HF's own init
   (std 0.02, seed 0) and saved as bf16 safetensors (nothing is downloaded).  One
   sequence = a 32-token prompt + HF bf16 greedy continuation (``--parity-tokens``):

   - ``logits``: whole-vocabulary log-probs of every position, our bf16 engine vs HF in
     fp32 on the same bf16 weights (the reference); HF's own bf16 run vs the same
     reference calibrates what bf16 rounding costs.  Pass: our max and mean abs errors
     are at most 2x HF bf16's (+ 0.02 / + 0.002).  ``rel`` = ||ours - ref|| / ||ref - row mean||.
   - ``top-1 (teacher-forced)``: our argmax at every position of that sequence vs the
     fp32 reference's.  A mismatch is a near-tie when the reference's margin between
     the two tokens is within the tie tolerance (2x HF bf16's max abs error, at least
     0.05); any other mismatch fails.
   - ``greedy``: our free-running greedy ids vs HF bf16 ``generate``; they may part at
     a near-tie (same test on the reference's margin, the prefixes being equal there).
3. ``CUDA graphs vs eager``: greedy ids of an ``enforce_eager=True`` engine and a
   graphed one on the same prompts at batch 1, 11 (padded to the 16 graph), 32 and 100
   (padded to 104) where ``max(--batches)`` allows; also says which attention backend
   ran and how many graphs were captured (none captured = FAIL).
4. ``throughput bs=B``: output tokens/s of the engine vs HF ``generate`` on the same B
   prompts (``--prompt-len`` in, ``--output-len`` out, ``min_new_tokens`` /
   ``ignore_eos`` so every sequence has the same length, greedy), prefill included on
   both sides, each side warmed up on other prompts first; and the ratio.
5. ``roofline bs=1``: decode tok/s x bytes read per decode step (every weight but the
   input embedding table, + the KV of the average context) / ``--peak-gbps`` (H200:
   4800 GB/s).
6. ``VL images/s conc 8`` (last, optional; ``--skip-vl``): image-input throughput of the
   engine vs HF ``generate`` on ``benchmarks.mm_throughput``'s tiny random Qwen2-VL (text
   256 x 4 layers, vision depth 4, built here), 80 requests of 1-4 images (112-224 px,
   distinct), 16 output tokens, concurrency 8 (HF: left-padded batches of 8), each side
   warmed up on 8 other requests; HF in bf16, the engine in its default CUDA dtype (bf16).
   Result ``R x HF`` and whether the multimodal issue's target (>= 3x HF images/s at
   concurrency 8) is met (reported, never a FAIL).  Engine-only (uint8 images resized
   outside the timing, no HTTP stack: the GPU box lacks falcon, and pyzmq unless carried).  ``skipped`` when
   Pillow is missing (the requests are built with PIL) or fewer than ~60 s of the
   deadline are left.

Degrades clearly: no CUDA device -> a message and exit code 2 (unless ``--dry-run``,
which runs the CPU-runnable parts: options, tiny fp32 models, HF parity on CPU,
throughput, the VL stage on 8 requests, table; the tests use it).  A stage that raises becomes a ``FAIL`` row with
the error and the run goes on; a watchdog ends the run at ``--deadline-s`` (default 470 s)
with the partial table (exit 3).  Exit 1 when any row failed, else 0.  Progress lines
go to stderr; the table is written to ``--out`` after every stage.

On the GPU box (Python 3.12, torch 2.11 CUDA, triton 3.6, transformers, numpy,
safetensors, tokenizers, pytest, httpx; no internet).  What it lacks and this needs:
**msgspec** (``common.protocol``, whose ``GenerateRequest``/``SamplingParams`` the
engine takes, imports it), **pyzmq** (``worker.engine.disagg.kv_transfer``, imported by the
engine core, imports ``zmq`` at the top) and, for the VL stage only, **Pillow** (its
image requests are built with PIL; the engine itself does not import it): put cp312
manylinux wheels of all three in ``.whl/``.  Without msgspec or pyzmq the engine does not
import: the run then says so in an ``engine import`` FAIL row and skips every engine stage
(the cuda tests still run); without Pillow the VL row says it was skipped.  falcon, uvicorn, httptools and supervisor are
needed only by the serving stack and its tests, not here.  No ``pip install -e .`` is needed (``PYTHONPATH=$PWD`` does it; an
editable install offline would need ``--no-build-isolation``).  From the repo root,
with ``.whl/`` (the wheels, git-ignored) carried (device ``run`` with
``carry=[".whl"]``, timeout_s=560)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && \\
    python3 -m benchmarks.gpu_check --out $OUT/gpu_check.md 2>&1 | tee $OUT/gpu_check.log

(``--out X`` also writes the pytest output to ``X.pytest.log``.)  Smoke run first if
time allows: ``python3 -m benchmarks.gpu_check --quick --skip-tests`` (4-layer models,
batches 1/32, ~1-2 minutes).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]

# ~1B presets, parameter counts checked by tests/integration/test_gpu_check.py without allocating.
PRESETS = {
    # TinyLlama-1.1B's shape: 1.12B parameters
    "llama": dict(arch="LlamaForCausalLM", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                  num_attention_heads=32, num_key_value_heads=8, vocab_size=32000),
    # q/k norm, GQA 16/8, head_dim 128: 0.94B parameters
    "qwen3": dict(arch="Qwen3ForCausalLM", hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=32000),
    # Qwen3-30B-A3B's expert shape (768-wide experts, norm_topk_prob) at 32 experts, top-4:
    # 1.11B parameters, ~0.23B active; the fused-MoE Triton kernel on every layer
    "qwen3_moe": dict(arch="Qwen3MoeForCausalLM", hidden_size=2048, intermediate_size=6144, num_hidden_layers=6,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=32000,
                      num_experts=32, num_experts_per_tok=4, moe_intermediate_size=768, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[]),
}
QUICK_LAYERS = 4  # --quick: the same layer shapes, fewer layers
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=320)
PARITY_PROMPT_LEN = 32
GRAPH_BATCHES = (1, 11, 32, 100)  # 11 and 100 replay padded graphs (16, 104)
GRAPH_TOKENS = 16
DEFAULT_DEADLINE_S = 470.0  # under the 8-minute target, table included
VL_CONC, VL_REQUESTS, VL_TOKENS = 8, 80, 16  # the VL stage; --dry-run: 8 requests, 4 tokens
VL_CHECK = f"VL images/s conc {VL_CONC}"


@dataclass
class Row:
    check: str
    model: str
    result: str  # "pass" / "FAIL" / "skipped" / a figure
    detail: str = ""


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama,qwen3,qwen3_moe",
                   help="comma-separated presets: " + ",".join(PRESETS))
    p.add_argument("--batches", default="1,32,128", help="throughput batch sizes (default 1,32,128)")
    p.add_argument("--prompt-len", type=int, default=128, help="throughput prompt length (default 128)")
    p.add_argument("--output-len", type=int, default=128, help="throughput output length (default 128)")
    p.add_argument("--parity-tokens", type=int, default=64, help="greedy tokens compared with HF (default 64)")
    p.add_argument("--device", default="cuda", help="cuda or cuda:N (default cuda)")
    p.add_argument("--attention-backend", default="auto",
                   help="passed to EngineConfig.attention_backend when the engine has it (default auto)")
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="peak HBM bandwidth in GB/s (H200: 4800)")
    p.add_argument("--skip-tests", action="store_true", help="skip the cuda-marked pytest run")
    p.add_argument("--skip-vl", action="store_true", help="skip the last stage (Qwen2-VL images/s vs HF)")
    p.add_argument("--tests-timeout", type=float, default=180.0, help="cap on the pytest run, s (default 180)")
    p.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S,
                   help="end the run with the partial table after this many seconds (default 470)")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: {QUICK_LAYERS}-layer models, batches <= 32, 64 in / 32 out")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny fp32 models: exercise the script itself (no GPU needed)")
    p.add_argument("--out", default=None, help="also write the table to this file (and pytest's output to "
                                               "FILE.pytest.log)")
    args = p.parse_args(argv)
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.model_list if m not in PRESETS]
    if unknown or not args.model_list:
        p.error(f"unknown model preset(s) {unknown}; known: {', '.join(PRESETS)}")
    try:
        args.batch_list = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        p.error(f"--batches must be comma-separated integers, got {args.batches!r}")
    if not args.batch_list or min(args.batch_list) < 1:
        p.error("--batches needs positive batch sizes")
    for name in ("prompt_len", "output_len", "parity_tokens"):
        if getattr(args, name) < 2:
            p.error(f"--{name.replace('_', '-')} must be at least 2")
    if args.peak_gbps <= 0:
        p.error("--peak-gbps must be positive")
    if args.quick or args.dry_run:
        args.batch_list = [b for b in args.batch_list if b <= 32][:2] or [1]
        args.output_len = min(args.output_len, 8 if args.dry_run else 32)
        args.prompt_len = min(args.prompt_len, 16 if args.dry_run else 64)
        args.parity_tokens = min(args.parity_tokens, 8 if args.dry_run else 32)
    args.size = "tiny" if args.dry_run else "quick" if args.quick else "full"
    return args


# --- models -------------------------------------------------------------------

def hf_config_dict(preset: str, size: Any = "full") -> dict:
    """The transformers config kwargs (plus ``arch``) of a preset at ``size``:
    full (~1B), quick (QUICK_LAYERS layers) or tiny (CPU dry run).  ``size=True``
    means tiny (older callers)."""
    size = "tiny" if size is True else "full" if size is False else size
    cfg = dict(PRESETS[preset])
    if size == "tiny":
        cfg.update(TINY)
        if "head_dim" in cfg:
            cfg["head_dim"] = TINY["hidden_size"] // TINY["num_attention_heads"]
        if "num_experts" in cfg:
            cfg.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    elif size == "quick":
        cfg["num_hidden_layers"] = QUICK_LAYERS
    cfg.update(max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
               eos_token_id=2, pad_token_id=0, initializer_range=0.02)
    return cfg


def param_count(cfg: dict) -> int:
    """Parameters of a Llama-family config, by arithmetic (no allocation)."""
    h, inter, layers, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    experts = cfg.get("num_experts", 0)
    mlp = experts * (3 * h * cfg["moe_intermediate_size"] + h) if experts else 3 * h * inter  # + the router
    per_layer = h * (q + 2 * kv) + q * h + mlp + 2 * h
    if cfg["arch"].startswith("Qwen3"):
        per_layer += 2 * d  # q_norm, k_norm
    embeddings = v * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return layers * per_layer + embeddings + h


def build_checkpoint(preset: str, out: Path, device: str, dtype, size: Any = "full", seed: int = 0) -> Path:
    """A random checkpoint saved as safetensors: HF's own init (normal, std
    ``initializer_range`` = 0.02; norms at 1), fixed seed, cast to ``dtype``."""
    import torch
    import transformers

    cfg = hf_config_dict(preset, size)
    arch = cfg.pop("arch")
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**cfg)
    config.architectures = [arch]
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    with torch.device(device):
        model = getattr(transformers, arch)(config).to(dtype)
    model.save_pretrained(out)
    del model
    gc.collect()
    _empty_cache()
    return out


def load_hf(path: Path, dtype, device: str):
    import torch
    import transformers

    kw = {"dtype": dtype} if _transformers_at_least(4, 56) else {"torch_dtype": dtype}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", **kw)
    return model.to(device=torch.device(device), dtype=dtype).eval()


def _transformers_at_least(major: int, minor: int) -> bool:
    import transformers

    m = re.match(r"(\d+)\.(\d+)", transformers.__version__)
    return bool(m) and (int(m.group(1)), int(m.group(2))) >= (major, minor)


# --- table --------------------------------------------------------------------

def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(rows: list[Row], header: str) -> str:
    lines = [header, "", "| check | model | result | detail |", "| --- | --- | --- | --- |"]
    lines += [f"| {_cell(r.check)} | {_cell(r.model)} | {_cell(r.result)} | {_cell(r.detail)} |" for r in rows]
    return "\n".join(lines)


# --- cuda tests -----------------------------------------------------------------

def cuda_test_files(tests_dir: Path = ROOT / "tests") -> list[str]:
    """Test files with a ``cuda`` mark, relative to the repo root."""
    files = []
    for f in sorted(Path(tests_dir).rglob("test_*.py")):
        if re.search(r"\bmark\.cuda\b", f.read_text(encoding="utf-8", errors="replace")):
            files.append(os.path.relpath(f, ROOT) if f.is_relative_to(ROOT) else str(f))
    return files


def parse_pytest_summary(text: str) -> dict[str, int]:
    """Counts of pytest's last summary line: passed, failed, skipped, error(s), ..."""
    counts: dict[str, int] = {}
    lines = [ln for ln in text.strip().splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?|"
                                                                 r"deselected|xfailed|xpassed)", ln)]
    if lines:
        for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", lines[-1]):
            counts["error" if k.startswith("error") else k] = int(n)
    return counts


def run_cuda_tests(timeout: float = 180.0, files: Optional[list[str]] = None, cwd: Path = ROOT,
                   log_path: Optional[Path] = None, marker: str = "cuda") -> Row:
    files = cuda_test_files() if files is None else files
    if not files:
        return Row("cuda tests", "-", "FAIL", "no test file has a cuda mark")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-m", marker, "-p", "no:cacheprovider", *files]
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output = _text(e.stdout) + _text(e.stderr)
        rc = None
    took = time.perf_counter() - started
    if log_path is not None:
        Path(log_path).write_text(" ".join(cmd) + "\n\n" + output, encoding="utf-8")
    if rc is None:
        done = len(re.findall(r"(PASSED|FAILED|^[.FEsx]+)", output, flags=re.M))
        return Row("cuda tests", "-", "FAIL", f"timed out after {timeout:.0f} s ({len(files)} files; "
                                              f"output so far: {output.strip()[-150:]!r}, {done} progress lines)")
    counts = parse_pytest_summary(output)
    failed = sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.M)))
    ok = rc == 0 and counts.get("passed", 0) > 0
    order = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "deselected")
    detail = ", ".join(f"{counts[k]} {k}" for k in order if k in counts) or output.strip()[-200:]
    detail += f" in {took:.0f} s ({len(files)} files)"
    if failed:
        names = ", ".join(f.split("::", 1)[-1] for f in failed)
        detail += f"; failed: {names[:300]}"
    if not counts.get("passed"):
        detail += "; none passed (is the GPU visible to pytest?)"
    if rc not in (0, 1) and not failed:
        detail += f"; pytest exit {rc}"
    return Row("cuda tests", "-", "pass" if ok else "FAIL", detail)


def _text(x: Any) -> str:
    if x is None:
        return ""
    return x.decode(errors="replace") if isinstance(x, bytes) else str(x)


# --- engine -------------------------------------------------------------------

def engine_kwargs(model_dir: Path, device: str, dtype: str, *, max_num_seqs: int, eager: bool,
                  max_model_len: int, kv_bytes: Optional[int] = None, attention_backend: str = "auto") -> dict:
    """EngineConfig kwargs, passing the newer knobs only where the dataclass has them."""
    from worker.engine import EngineConfig

    have = {f.name for f in dataclasses.fields(EngineConfig)}
    kw: dict[str, Any] = dict(model=str(model_dir), device=device, dtype=dtype, tokens_only=True,
                              enforce_eager=eager, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                              max_num_batched_tokens=8192, enable_prefix_caching=False,
                              max_logprobs=-1)  # -1: whole-vocabulary prompt log-probs for the parity check
    if device.startswith("cuda") and kv_bytes is not None:
        # A KV cache sized for the run (not 90% of the GPU): HF's generate needs room beside it.
        if "kv_cache_memory_bytes" in have:
            kw["kv_cache_memory_bytes"] = int(kv_bytes)
        elif "kv_cache_memory_gb" in have:
            kw["kv_cache_memory_gb"] = kv_bytes / 2 ** 30
        elif "gpu_memory_utilization" in have:
            kw["gpu_memory_utilization"] = 0.5
    if attention_backend != "auto" and "attention_backend" in have:
        kw["attention_backend"] = attention_backend
    return {k: v for k, v in kw.items() if k in have}


class EngineRunner:
    """Our engine on one checkpoint, with the request helpers the checks share."""

    def __init__(self, **engine_kw):
        from worker.engine import Engine, EngineConfig

        self.engine = Engine(EngineConfig(**engine_kw))

    def generate(self, prompts: list[list[int]], max_tokens: int, **params) -> list[Any]:
        from common.protocol import GenerateRequest, SamplingParams

        params = {"temperature": 0.0, "ignore_eos": True, **params}
        reqs = [GenerateRequest(request_id=str(i), prompt_token_ids=list(p),
                                params=SamplingParams(max_tokens=max_tokens, **params))
                for i, p in enumerate(prompts)]
        res = self.engine.generate(reqs)
        return [res[str(i)][0] for i in range(len(prompts))]

    def describe(self) -> str:
        e = self.engine
        backend = getattr(getattr(e, "attention_backend", None), "name", "?")
        graphs = getattr(getattr(e, "runner", None), "_graphs", None)
        blocks = getattr(getattr(e, "block_manager", None), "num_blocks", "?")
        n_graphs = "?" if graphs is None else len(graphs)
        return f"attention {backend}, {n_graphs} CUDA graphs, {blocks} KV blocks"

    def num_graphs(self) -> Optional[int]:
        graphs = getattr(getattr(self.engine, "runner", None), "_graphs", None)
        return None if graphs is None else len(graphs)

    def close(self) -> None:
        try:
            self.engine.close()
        finally:
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


def hf_generate(hf, prompts: list[list[int]], n: int, device: str) -> list[list[int]]:
    """HF greedy ``generate``, exactly ``n`` new tokens per (equal-length) prompt."""
    import torch

    ids = torch.tensor(prompts, device=device)
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def hf_logprobs(hf, seq: list[int], device: str):
    """[L-1, V] float32 on CPU: row i scores token i+1."""
    import torch

    with torch.inference_mode():
        logits = hf(torch.tensor([seq], device=device)).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).cpu()


def dense_logprobs(tl, vocab: int):
    """A whole-vocabulary ``TokenLogprobs`` (prompt_logprobs=-1) as a dense [rows, V] tensor."""
    import torch

    ids = torch.tensor(tl.top_ids, dtype=torch.long)
    lps = torch.tensor(tl.top_logprobs, dtype=torch.float32)
    out = torch.full((ids.shape[0], vocab), float("-inf"))
    return out.scatter_(1, ids, lps)


@dataclass
class Parity:
    """What the HF parity check learnt, for the rows and the graphs check."""

    rows: list[Row]
    tie_tol: float


def _errors(x, ref) -> tuple[float, float, float]:
    import torch

    d = (x - ref).abs()
    centred = ref - ref.mean(-1, keepdim=True)
    rel = float(torch.linalg.vector_norm(x - ref) / torch.linalg.vector_norm(centred).clamp_min(1e-12))
    return float(d.max()), float(d.mean()), rel


def hf_parity(path: Path, hf_low, ours: EngineRunner, name: str, vocab: int, device: str, n_tokens: int,
              low_precision: bool) -> Parity:
    """Logits, teacher-forced top-1 and free-running greedy vs HF (see the module doc)."""
    import torch

    prompt = prompts_for(1, PARITY_PROMPT_LEN, vocab, seed=1)[0]
    hf_ids = hf_generate(hf_low, [prompt], n_tokens, device)[0]
    seq = prompt + hf_ids
    low = hf_logprobs(hf_low, seq, device)
    if low_precision:  # the reference: HF in fp32 on the same (bf16-rounded) weights
        hf32 = load_hf(path, torch.float32, device)
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            ref = hf_logprobs(hf32, seq, device)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
            del hf32
            gc.collect()
            _empty_cache()
    else:
        ref = low
    delta = ours.generate([seq], 1, prompt_logprobs=-1)[0]
    mine = dense_logprobs(delta.prompt_logprobs, vocab)
    if mine.shape != ref.shape:
        raise RuntimeError(f"engine returned {tuple(mine.shape)} prompt log-probs, expected {tuple(ref.shape)}")

    o_max, o_mean, o_rel = _errors(mine, ref)
    h_max, h_mean, h_rel = _errors(low, ref)
    slack_max, slack_mean = (0.02, 0.002) if low_precision else (1e-3, 1e-4)
    logits_ok = o_max <= 2 * h_max + slack_max and o_mean <= 2 * h_mean + slack_mean
    rows_n = ref.shape[0]
    detail = (f"vs HF fp32, {rows_n} positions x {vocab} log-probs: ours max {o_max:.4f} mean {o_mean:.5f} "
              f"rel {o_rel:.2%}")
    if low_precision:
        detail += f"; HF bf16 max {h_max:.4f} mean {h_mean:.5f} rel {h_rel:.2%} (limit 2x HF bf16's + slack)"
    rows = [Row("HF parity: logits", name, "pass" if logits_ok else "FAIL", detail)]

    tie_tol = max(0.05, 2 * h_max) if low_precision else 1e-3
    ref_top, my_top, low_top = ref.argmax(-1), mine.argmax(-1), low.argmax(-1)
    idx = torch.arange(rows_n)
    margins = ref[idx, ref_top] - ref[idx, my_top]
    miss = my_top != ref_top
    ties = int((miss & (margins <= tie_tol)).sum())
    real = int((miss & (margins > tie_tol)).sum())
    agree = rows_n - int(miss.sum())
    detail = (f"{agree}/{rows_n} positions = fp32 argmax ({agree / rows_n:.1%}); {ties} near-ties, {real} beyond "
              f"the tie tolerance {tie_tol:.3f}")
    if real:
        detail += f" (largest fp32 margin {float(margins[miss].max()):.3f})"
    if low_precision:
        detail += f"; HF bf16 itself: {int((low_top == ref_top).sum())}/{rows_n}"
    rows.append(Row("HF parity: top-1 (teacher-forced)", name, "pass" if real == 0 else "FAIL", detail))

    # min_tokens bans EOS as HF's min_new_tokens does (ignore_eos alone would let ours pick it)
    free = ours.generate([prompt], n_tokens, ignore_eos=False, min_tokens=n_tokens)[0].token_ids
    k = next((i for i, (a, b) in enumerate(zip(free, hf_ids)) if a != b), None)
    if k is None and len(free) == len(hf_ids):
        rows.append(Row("HF parity: greedy", name, "pass", f"{n_tokens}/{n_tokens} tokens equal HF generate"))
    elif k is None:
        rows.append(Row("HF parity: greedy", name, "FAIL", f"{len(free)} tokens, HF {len(hf_ids)}"))
    else:
        r = PARITY_PROMPT_LEN - 1 + k  # the row predicting token k, same context on both sides
        margin = float(ref[r, hf_ids[k]] - ref[r, free[k]])
        near = abs(margin) <= tie_tol
        rows.append(Row("HF parity: greedy", name, "pass" if near else "FAIL",
                        f"{k}/{n_tokens} tokens equal, then {'a near-tie' if near else 'NOT a near-tie'}: "
                        f"fp32 margin {margin:.4f} (tie tolerance {tie_tol:.3f})"))
    return Parity(rows, tie_tol)


def graphs_vs_eager(eager: list[Any], graphed: list[Any], tie_tol: float) -> tuple[int, int, int]:
    """(identical, near-tie divergences, real divergences) between two runs whose
    deltas carry ``logprobs`` (top 2): a divergence is a near-tie when eager's top-2
    margin at the first differing token is within ``tie_tol``."""
    same = ties = real = 0
    for e, g in zip(eager, graphed):
        if e.token_ids == g.token_ids:
            same += 1
            continue
        k = next((i for i, (a, b) in enumerate(zip(e.token_ids, g.token_ids)) if a != b), None)
        if k is None or e.logprobs is None or len(e.logprobs.top_logprobs[k]) < 2:
            real += 1
            continue
        top = e.logprobs.top_logprobs[k]
        if top[0] - top[1] <= tie_tol:
            ties += 1
        else:
            real += 1
    return same, ties, real


def graph_batches(max_seqs: int) -> list[int]:
    return [b for b in GRAPH_BATCHES if b <= max_seqs] or [1]


def run_graph_prompts(ours: EngineRunner, vocab: int, batches: list[int]) -> dict[int, list[Any]]:
    out = {}
    for b in batches:
        prompts = prompts_for(b, 24 + b % 7, vocab, seed=300 + b)
        out[b] = ours.generate(prompts, GRAPH_TOKENS, logprobs=2)
    return out


def graphs_row(name: str, eager: dict[int, list[Any]], graphed: dict[int, list[Any]], tie_tol: float,
               described: str, n_graphs: Optional[int]) -> Row:
    total = sum(len(v) for v in eager.values())
    same = ties = real = 0
    for b in eager:
        s, t, r = graphs_vs_eager(eager[b], graphed[b], tie_tol)
        same, ties, real = same + s, ties + t, real + r
    batches = "/".join(str(b) for b in eager)
    detail = (f"batches {batches}: {same}/{total} identical greedy outputs ({GRAPH_TOKENS} tokens)"
              f"{f', {ties} parted at a near-tie' if ties else ''}{f', {real} parted beyond it' if real else ''}; "
              f"{described}")
    if n_graphs == 0:
        return Row("CUDA graphs vs eager", name, "FAIL", "no CUDA graph captured: " + detail)
    result = "pass" if real == 0 and ties == 0 else f"pass ({ties} near-ties)" if real == 0 else "FAIL"
    return Row("CUDA graphs vs eager", name, result, detail)


def throughput(hf, ours: EngineRunner, name: str, vocab: int, device: str, batches: list[int], p_len: int,
               out_len: int, note: str = "") -> list[Row]:
    rows = []
    for b in batches:
        prompts = prompts_for(b, p_len, vocab, seed=100 + b)
        warm = prompts_for(b, p_len, vocab, seed=200 + b)
        ours.generate(warm, 2)  # warm-up on other prompts: no cache hit either way
        hf_generate(hf, warm, 2, device)
        _, t_ours = timed(lambda: ours.generate(prompts, out_len))
        _, t_hf = timed(lambda: hf_generate(hf, prompts, out_len, device))
        ours_tps, hf_tps = b * out_len / t_ours, b * out_len / t_hf
        rows.append(Row(f"throughput bs={b}", name, f"{ours_tps / hf_tps:.2f}x HF",
                        f"engine {ours_tps:.0f} tok/s ({t_ours:.2f} s), HF generate {hf_tps:.0f} tok/s "
                        f"({t_hf:.2f} s); {p_len} in / {out_len} out, prefill included{note}"))
    return rows


def decode_bytes_per_token(hf, kv_bytes_per_token: int, context: float) -> tuple[int, float]:
    """Bytes one batch-1 decode step reads: every weight but the input embedding
    table (one row of it; tied weights are read as the LM head), of the experts only
    the top-k routed ones, plus the KV of ``context`` tokens."""
    tied = bool(getattr(hf.config, "tie_word_embeddings", False))
    experts = getattr(hf.config, "num_experts", 0) or 0
    routed = experts and hf.config.num_experts_per_tok / experts
    weights = sum(p.numel() * p.element_size() * (routed if experts and ".mlp.experts." in n else 1)
                  for n, p in hf.named_parameters() if tied or "embed_tokens" not in n)
    return int(weights), int(weights) + kv_bytes_per_token * context


def roofline(ours: EngineRunner, name: str, vocab: int, p_len: int, out_len: int, peak_gbps: float, hf,
             kv_bytes_per_token: int, note: str = "") -> Row:
    a, b, c = prompts_for(3, p_len, vocab, seed=7)  # distinct prompts: equal prefill work, no cache hits
    ours.generate([a], 2)
    _, t_prefill = timed(lambda: ours.generate([b], 1))
    _, t_total = timed(lambda: ours.generate([c], out_len))
    step = max(t_total - t_prefill, 1e-9) / (out_len - 1)
    weights, per_token = decode_bytes_per_token(hf, kv_bytes_per_token, p_len + out_len / 2)
    gbps = per_token / step / 1e9
    return Row("roofline bs=1", name, f"{gbps / peak_gbps:.1%} of {peak_gbps:.0f} GB/s",
               f"decode {1 / step:.0f} tok/s ({step * 1e3:.2f} ms/step) x {per_token / 1e9:.3f} GB/step "
               f"(weights {weights / 1e9:.3f} GB + KV of {p_len + out_len // 2} tokens) = {gbps:.0f} GB/s{note}")


def vl_throughput(args: argparse.Namespace, workdir: Path, progress: "Progress") -> Row:
    """Images/s of the in-process engine vs HF ``generate`` on mm_throughput's tiny
    random Qwen2-VL at concurrency VL_CONC (see the module doc)."""
    import torch

    from benchmarks import mm_throughput as mm

    dry = args.dry_run
    device = "cpu" if dry else args.device
    num, tokens, n_warm = (VL_CONC, 4, 2) if dry else (VL_REQUESTS, VL_TOKENS, VL_CONC)
    progress.log(f"{VL_CHECK}: building the tiny random Qwen2-VL and {num} + {n_warm} requests")
    model_dir = mm.build_model(str(workdir / "qwen2-vl-tiny"))
    reqs = mm.make_requests(model_dir, num, seed=10, repeat_images=False)
    warm = mm.make_requests(model_dir, n_warm, seed=1, repeat_images=False)
    threads = torch.get_num_threads()  # neither side changes the process's thread count
    bench_args = argparse.Namespace(device=device, engine_threads=threads, hf_threads=threads, max_tokens=tokens)
    progress.log(f"{VL_CHECK}: engine")
    eng = mm.bench_engine(model_dir, [(VL_CONC, reqs)], warm, bench_args)[VL_CONC]
    gc.collect()
    _empty_cache()
    progress.log(f"{VL_CHECK}: HF generate")
    hf = mm.bench_hf(model_dir, [(VL_CONC, reqs)], warm, bench_args)[VL_CONC]
    gc.collect()
    _empty_cache()
    ratio = eng["images_s"] / hf["images_s"]
    images = sum(len(r.pngs) for r in reqs)
    sizes = f"{mm.SIZES[0][0]}x{mm.SIZES[0][1]}..{mm.SIZES[-1][0]}x{mm.SIZES[-1][1]}"
    dtype = "fp32" if dry else "bf16"
    met = "met" if ratio >= 3 else "NOT met"
    note = " (CPU dry run: not a GPU figure)" if dry else ""
    return Row(VL_CHECK, f"qwen2-vl tiny random (text 256x4, vision depth 4, {dtype})",
               f"{ratio:.2f}x HF (target >= 3x: {met})",
               f"engine {eng['images_s']:.1f} images/s ({eng['duration']:.2f} s), HF generate "
               f"{hf['images_s']:.1f} images/s ({hf['duration']:.2f} s); {num} requests, {images} images "
               f"(1-4 per request, {sizes}, distinct), {tokens} tokens out, concurrency {VL_CONC} (HF: left-padded "
               f"batches of {VL_CONC}), warmed up on {n_warm} other requests; engine-only: no HTTP stack "
               f"(the GPU box lacks falcon; pyzmq too unless carried), images resized outside the timing{note}")


# --- driver -------------------------------------------------------------------

class Progress:
    """Rows so far, progress lines on stderr, the table rewritten to --out after each stage."""

    def __init__(self, args: argparse.Namespace, machine: str, torch_version: str):
        self.args = args
        self.started = time.perf_counter()
        self.rows: list[Row] = []
        self.test_row: Optional[Row] = None
        self.machine, self.torch_version = machine, torch_version
        self.stage = "start"
        # Reentrant: the watchdog holds it from its own write to the exit, so no stage's
        # write can truncate the table file in between.
        self.lock = threading.RLock()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def remaining(self) -> float:
        return self.args.deadline_s - self.elapsed()

    def log(self, msg: str) -> None:
        self.stage = msg
        print(f"[gpu_check {self.elapsed():5.0f} s] {msg}", file=sys.stderr, flush=True)

    def add(self, rows: list[Row]) -> None:
        with self.lock:
            self.rows += rows
        for r in rows:
            self.log(f"{r.check} | {r.model} | {r.result} | {r.detail}")
        self.write()

    def render(self, note: str = "") -> str:
        head = (f"GPU check on {self.machine}, torch {self.torch_version}, "
                f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {self.elapsed():.0f} s"
                f"{', --quick' if self.args.quick else ''}{note}")
        rows = ([self.test_row] if self.test_row else []) + self.rows
        return table(rows, head)

    def write(self, note: str = "") -> str:
        with self.lock:
            text = self.render(note)
            if self.args.out:
                Path(self.args.out).write_text(text + "\n", encoding="utf-8")
        return text


def check_model(preset: str, args: argparse.Namespace, workdir: Path, progress: Progress) -> None:
    import torch

    dry = args.dry_run
    device = "cpu" if dry else args.device
    dtype = torch.float32 if dry else torch.bfloat16
    dtype_name = "float32" if dry else "bfloat16"
    cfg = hf_config_dict(preset, args.size)
    name = (f"{preset} ({param_count(cfg) / 1e9:.2f}B, {cfg['num_hidden_layers']} layers, "
            f"{'fp32' if dry else 'bf16'})")
    max_seqs = max(max(args.batch_list), max(graph_batches(max(args.batch_list))))
    max_len = max(args.prompt_len + args.output_len, PARITY_PROMPT_LEN + args.parity_tokens) + 16
    note = " (CPU dry run: not a GPU figure)" if dry else ""

    progress.log(f"{preset}: building the random checkpoint ({param_count(cfg) / 1e9:.2f}B)")
    path = build_checkpoint(preset, workdir / preset, device, dtype, args.size)
    progress.log(f"{preset}: loading HF ({dtype_name})")
    hf = load_hf(path, dtype, device)
    vocab = hf.config.vocab_size
    from worker.engine.models.config import ModelConfig
    from worker.engine.models import kv_bytes_per_block

    mc = ModelConfig.from_dir(str(path))
    kv_per_token = kv_bytes_per_block(mc, 16, dtype) // 16
    kv_bytes = int(1.25 * max_seqs * (max_len + 32) * kv_per_token) + (64 << 20)

    def engine(eager: bool) -> EngineRunner:
        return EngineRunner(**engine_kwargs(path, device, dtype_name, max_num_seqs=max_seqs, eager=eager,
                                            max_model_len=max_len, kv_bytes=kv_bytes,
                                            attention_backend=args.attention_backend))

    ours: Optional[EngineRunner] = None
    tie_tol = 0.05 if not dry else 1e-3
    eager_out: dict[int, list[Any]] = {}
    try:
        if not dry:
            try:
                progress.log(f"{preset}: eager engine, graph-check prompts")
                ours = engine(eager=True)
                eager_out = run_graph_prompts(ours, vocab, graph_batches(max_seqs))
            except Exception as e:
                progress.add([_failed("CUDA graphs vs eager", name, e)])
            finally:
                if ours is not None:
                    ours.close()
                ours = None
        progress.log(f"{preset}: engine{'' if dry else ' with CUDA graphs'}")
        try:
            ours = engine(eager=dry)
        except Exception as e:
            progress.add([_failed("engine start", name, e)])
            return
        described = ours.describe()
        progress.log(f"{preset}: {described}; HF parity")
        try:
            parity = hf_parity(path, hf, ours, name, vocab, device, args.parity_tokens, low_precision=not dry)
            tie_tol = parity.tie_tol
            progress.add(parity.rows)
        except Exception as e:
            progress.add([_failed("HF parity", name, e)])
        if dry:
            progress.add([Row("CUDA graphs vs eager", name, "skipped", "CPU dry run: no CUDA graphs")])
        elif eager_out:
            try:
                graphed = run_graph_prompts(ours, vocab, list(eager_out))
                progress.add([graphs_row(name, eager_out, graphed, tie_tol, described, ours.num_graphs())])
            except Exception as e:
                progress.add([_failed("CUDA graphs vs eager", name, e)])
        for b in args.batch_list:
            progress.log(f"{preset}: throughput bs={b}")
            try:
                progress.add(throughput(hf, ours, name, vocab, device, [b], args.prompt_len, args.output_len,
                                        note))
            except Exception as e:
                progress.add([_failed(f"throughput bs={b}", name, e)])
        progress.log(f"{preset}: roofline")
        try:
            progress.add([roofline(ours, name, vocab, args.prompt_len, args.output_len, args.peak_gbps, hf,
                                   kv_per_token, note)])
        except Exception as e:
            progress.add([_failed("roofline bs=1", name, e)])
    finally:
        if ours is not None:
            ours.close()
        del hf
        gc.collect()
        _empty_cache()


def _failed(check: str, model: str, e: BaseException) -> Row:
    traceback.print_exception(e, file=sys.stderr)
    msg = f"{type(e).__name__}: {e}".replace("\n", " ")
    return Row(check, model, "FAIL", msg[:300])


def _start_watchdog(progress: Progress) -> threading.Timer:
    def fire() -> None:
        progress.lock.acquire()  # held until the exit: the partial table is the file's last word
        text = progress.write(f", TIMED OUT at --deadline-s {progress.args.deadline_s:.0f} during: "
                              f"{progress.stage}")
        print(text, flush=True)
        print(f"gpu_check: deadline of {progress.args.deadline_s:.0f} s reached; partial table above",
              file=sys.stderr, flush=True)
        os._exit(3)

    timer = threading.Timer(max(progress.args.deadline_s - progress.elapsed(), 0.0), fire)
    timer.daemon = True
    timer.start()
    return timer


# Rough cost of one model's checks (build, two engines with graph capture, parity,
# throughput), to skip a model cleanly rather than be cut off by the watchdog.
_MODEL_ESTIMATE_S = {"full": 90.0, "quick": 40.0, "tiny": 2.0}
# The VL stage: tiny model build, ~90 PNG requests, an engine with graph capture, HF bf16.
_VL_ESTIMATE_S = {"full": 60.0, "quick": 60.0, "tiny": 10.0}


def _engine_import_error() -> Optional[str]:
    """Why ``worker.engine``'s Engine does not import here (a missing wheel), or None."""
    try:
        from worker.engine import Engine  # noqa: F401
    except ImportError as e:
        return (f"{type(e).__name__}: {e}; every engine stage skipped (put msgspec and pyzmq "
                f"wheels in .whl/, see the module doc)")
    return None


def _have_pillow() -> bool:
    try:
        import PIL  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: Optional[list[str]] = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    import torch

    if not args.dry_run:
        try:
            dev = torch.device(args.device)
        except RuntimeError as e:
            print(f"gpu_check: bad --device {args.device!r}: {e}", file=sys.stderr)
            return 2
        if dev.type != "cuda":
            print(f"gpu_check needs a CUDA device (--device {args.device}); use --dry-run to exercise the "
                  "script on CPU", file=sys.stderr)
            return 2
        if not torch.cuda.is_available():
            print("gpu_check needs a CUDA GPU: torch.cuda.is_available() is False here "
                  f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); use --dry-run to exercise the "
                  "script on CPU", file=sys.stderr)
            return 2
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            print(f"gpu_check: --device {args.device} but only {torch.cuda.device_count()} CUDA device(s)",
                  file=sys.stderr)
            return 2
        if dev.index is not None:
            torch.cuda.set_device(dev)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()

    machine = "CPU dry run (no GPU figures)" if args.dry_run else torch.cuda.get_device_name(torch.device(args.device))
    progress = Progress(args, machine, torch.__version__)
    progress.started = started
    watchdog = _start_watchdog(progress)
    try:
        if args.skip_tests:
            pass
        else:
            budget = min(args.tests_timeout, max(progress.remaining() - 30, 10))
            progress.log(f"cuda tests (cap {budget:.0f} s)")
            log_path = Path(f"{args.out}.pytest.log") if args.out else None
            progress.test_row = run_cuda_tests(timeout=budget, log_path=log_path)
            progress.add([])
            progress.log(f"cuda tests: {progress.test_row.result}, {progress.test_row.detail}")
        engine_error = _engine_import_error()
        if engine_error:
            progress.add([Row("engine import", "-", "FAIL", engine_error)])
        with tempfile.TemporaryDirectory(prefix="tokserve-gpu-check-") as tmp:
            for preset in args.model_list:
                if engine_error:
                    continue
                if progress.remaining() < _MODEL_ESTIMATE_S[args.size]:
                    progress.add([Row("all checks", preset, "skipped",
                                      f"time budget: {progress.remaining():.0f} s left of --deadline-s "
                                      f"{args.deadline_s:.0f}")])
                    continue
                check_model(preset, args, Path(tmp), progress)
            if args.skip_vl or engine_error:
                pass
            elif progress.remaining() < _VL_ESTIMATE_S[args.size]:
                progress.add([Row(VL_CHECK, "qwen2-vl tiny random", "skipped",
                                  f"time budget: {progress.remaining():.0f} s left of --deadline-s "
                                  f"{args.deadline_s:.0f} (needs ~{_VL_ESTIMATE_S[args.size]:.0f} s)")])
            elif not _have_pillow():
                progress.add([Row(VL_CHECK, "qwen2-vl tiny random", "skipped",
                                  "Pillow is not installed (the image requests are built with PIL): "
                                  "add a Pillow wheel to .whl/ to run this stage")])
            else:
                try:
                    progress.add([vl_throughput(args, Path(tmp), progress)])
                except Exception as e:
                    progress.add([_failed(VL_CHECK, "qwen2-vl tiny random", e)])
    finally:
        watchdog.cancel()
    text = progress.write()
    print(text, flush=True)
    rows = ([progress.test_row] if progress.test_row else []) + progress.rows
    return 1 if any(r.result == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
