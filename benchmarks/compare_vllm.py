"""Side-by-side serving benchmark: this project's stack against vLLM's CPU build.

Starts ``vllm serve MODEL --enable-scale-out`` and ``tokserve serve --model MODEL`` on
loopback ports (same model folder, same torch thread count, same KV cache size, same
max_num_seqs / max_num_batched_tokens), runs the same streaming workloads against both
``POST /inference/v1/generate`` endpoints (random-token prompts, fixed output length
with ignore_eos, a closed loop per concurrency level), and prints one table with
throughput, TTFT and ITL percentiles and the ratio ours / vLLM.  Cells run
back-to-back, alternating which server goes first, so background load hits both alike.
It also sends the same greedy requests to both and reports how often the token ids agree.

    python -m benchmarks.compare_vllm                            # small model, full sweep
    python -m benchmarks.compare_vllm --model-size 125m          # the ~125M model
    python -m benchmarks.compare_vllm --concurrency 1,32 --input-lens 128 --num-prompts 32

Skipped (exit 0, with a message) when vLLM is not installed: ``--vllm-bin`` (default
/tmp/vllmcpu/bin/vllm, else ``vllm`` on PATH).  Both servers are shut down on exit,
Ctrl-C and SIGTERM included.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional

import msgspec

from benchmarks.model_presets import SIZES, build_preset_model
from benchmarks.serve import GENERATE, free_port, model_vocab, random_prompts, request_body, run_http, summarize, \
    warmup_http
from benchmarks.sse_client import SseConnection

DEFAULT_VLLM_BIN = "/tmp/vllmcpu/bin/vllm"


def find_vllm(explicit: Optional[str]) -> Optional[str]:
    for cand in (explicit, DEFAULT_VLLM_BIN, shutil.which("vllm")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


# ----------------------------------------------------------------------------- servers
class ManagedServer:
    """One server process in its own session (so Ctrl-C reaches only us and we stop it
    in order), output to a log file, readiness by polling ``/health``."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int, log_dir: str,
                 cwd: Optional[str] = None):
        self.name, self.argv, self.env, self.cwd = name, argv, env, cwd
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(self.argv, env=dict(os.environ, **self.env), cwd=self.cwd, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        finally:
            log.close()

    def cpu_seconds(self) -> float:
        """CPU time (user + system) used so far by the live processes of the server's
        session, read from /proc (0.0 where there is no /proc).  Shows whether both
        servers really ran on the same amount of CPU, threads of helpers included."""
        if self.proc is None or not os.path.isdir("/proc"):
            return 0.0
        ticks = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == self.proc.pid:  # session id: ours are session leaders
                ticks += int(fields[11]) + int(fields[12])  # utime, stime
        return ticks / os.sysconf("SC_CLK_TCK")

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-lines:]).decode("utf-8", "replace")
        except OSError:
            return ""

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}; log tail:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not healthy in time; log tail:\n{self.log_tail()}")

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the leader (it stops its own children), then SIGKILL any straggler."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the session id is the leader's pid
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()


def thread_env(threads: int) -> dict[str, str]:
    """Same OMP/MKL threads for a server; 0 leaves the server to choose (its defaults)."""
    if not threads:
        return {}
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def threads_label(threads: int) -> str:
    return f"{threads} thread(s) per engine" if threads else "each server's default threads"


def dtype_flag(dtype: Optional[str]) -> list[str]:
    """``--dtype X``, or nothing for ``auto``: both servers' default, so ``auto`` starts
    each the way a user who passes no flag does."""
    return [] if dtype in (None, "", "auto") else ["--dtype", dtype]


def vllm_server(args, model_dir: str, log_dir: str, *, name: str = "vllm", dtype: Optional[str] = None,
                port: int = 0) -> ManagedServer:
    """``dtype`` None: ``args.dtype``."""
    port = port or args.vllm_port or free_port()
    argv = [args.vllm_bin, "serve", model_dir, "--enable-scale-out", "--port", str(port), "--host", "127.0.0.1",
            "--max-model-len", str(args.max_model_len), *dtype_flag(args.dtype if dtype is None else dtype),
            "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--seed", "0",
            "--disable-log-stats", "--uvicorn-log-level", "warning", *args.vllm_args.split()]
    env = dict(thread_env(args.threads), VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gb))
    # No pinning by default (our worker is not pinned either, and the box is shared);
    # with --threads 0 vLLM keeps its own default (auto: pin, reserve a core for the front end).
    bind = args.vllm_bind or ("auto" if not args.threads else "nobind")
    env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    return ManagedServer(name, argv, env, port, log_dir)


def tokserve_server(args, model_dir: str, log_dir: str, *, name: str = "tokserve", dtype: Optional[str] = None,
                    pythonpath: Optional[str] = None, port: int = 0, extra_worker_args: str = "") -> ManagedServer:
    """``dtype`` None: ``args.dtype``; ``pythonpath``: run the stack from that source tree
    (another branch's engine) instead of the one this benchmark imports; ``extra_worker_args``:
    after ``args.worker_args``."""
    port = port or args.port or free_port()
    threads = ["--threads", str(args.threads)] if args.threads else []
    worker_args = " ".join([*threads, *dtype_flag(args.dtype if dtype is None else dtype),
                            "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
                            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                            "--kv-cache-memory-gb", str(args.kv_cache_gb), args.worker_args,
                            extra_worker_args]).strip()
    argv = [sys.executable, "-m", "common.cli", "serve", "--model", model_dir, "--port", str(port),
            "--host", "127.0.0.1", "--log-level", "warning",
            "--frontend", f"ipc://{log_dir}/{name}-frontend", "--backend", f"ipc://{log_dir}/{name}-backend",
            "--worker-args", worker_args]
    env = thread_env(args.threads)
    if pythonpath:
        # ``python -m`` puts the working directory first on sys.path, ahead of PYTHONPATH:
        # start there too, or the tree we run from would win.
        env["PYTHONPATH"] = pythonpath
    return ManagedServer(name, argv, env, port, log_dir, cwd=pythonpath)


# ----------------------------------------------------------------------------- workloads
def level_sizes(args) -> list[tuple[int, int, int]]:
    """(input_len, concurrency, num_prompts) of every cell."""
    lens = [int(x) for x in args.input_lens.split(",") if x.strip()]
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    return [(n, c, args.num_prompts or max(8, 2 * c)) for n in lens for c in levels]


async def measure_cell(server: ManagedServer, bodies: list[bytes], conc: int) -> dict:
    cpu0 = server.cpu_seconds()
    row = summarize(await run_http(server.url, bodies, conc, server.name))
    # CPU cores the server kept busy on average during the cell (all its processes).
    row["cpu_cores"] = (server.cpu_seconds() - cpu0) / row["duration_s"]
    return row


async def greedy_token_ids(server: ManagedServer, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    conn = SseConnection(server.url)
    out = []
    try:
        for p in prompts:
            body = msgspec.json.encode({"token_ids": p, "sampling_params": {
                "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "detokenize": False}})
            status, data = await conn.post_json(GENERATE, body)
            if status != 200:
                raise RuntimeError(f"{server.name}: HTTP {status}: {data[:300]!r}")
            out.append(list(msgspec.json.decode(data)["choices"][0]["token_ids"]))
    finally:
        await conn.close()
    return out


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[float, float]:
    """(fraction of requests with identical ids, mean fraction of tokens before the first divergence)."""
    exact = sum(a == b for a, b in zip(ours, theirs)) / len(ours)
    prefix = []
    for a, b in zip(ours, theirs):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(len(a), len(b), 1))
    return exact, sum(prefix) / len(prefix)


# ----------------------------------------------------------------------------- reporting
def _ratio(a: float, b: float) -> str:
    return f"{a / b:5.2f}" if b and a == a and b == b else "  n/a"


METRICS = [("out_tok_per_s", "tok/s", "{:7.1f}"), ("ttft_p50_ms", "TTFT p50", "{:7.1f}"),
           ("ttft_p99_ms", "TTFT p99", "{:7.1f}"), ("itl_p50_ms", "ITL p50", "{:7.2f}"),
           ("itl_p99_ms", "ITL p99", "{:7.2f}"), ("tpot_p50_ms", "TPOT p50", "{:7.2f}"),
           ("cpu_cores", "CPU cores", "{:7.2f}")]


def format_table(cells: list[tuple[dict, dict]]) -> str:
    group = 7 + 1 + 7 + 1 + 5
    head1 = " in   conc reqs  " + "  ".join(h.center(group) for _, h, _ in METRICS) + "  fail"
    head2 = "                 " + "  ".join(f"{'ours':>7} {'vLLM':>7} {'x':>5}" for _ in METRICS) + "  o/v"
    lines = [head1, head2]
    for ours, theirs in cells:
        parts = [f"{f.format(ours[k])} {f.format(theirs[k])} {_ratio(ours[k], theirs[k])}" for k, _, f in METRICS]
        lines.append(f"{ours['input_len']:4d} {ours['concurrency']:5d} {ours['requests']:4d}  " + "  ".join(parts)
                     + f"  {ours['failed']}/{theirs['failed']}")
    lines.append("x = ours / vLLM (throughput: higher is better for us; latencies: lower is better for us); ms.\n"
                 "ITL is measured between SSE chunks as they arrive: a server that flushes several chunks at once "
                 "shows ITL p50 near 0; TPOT = (e2e - TTFT) / (tokens - 1) per request is immune to that.\n"
                 "CPU cores = CPU time of all the server's processes during the cell / its duration.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare_vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-bin", default=None, help=f"vllm executable (default {DEFAULT_VLLM_BIN}, else PATH)")
    p.add_argument("--model", default=None, help="model folder (default: a bench model, see --model-size)")
    p.add_argument("--model-size", default="small", choices=sorted(SIZES), help="bench model preset")
    p.add_argument("--concurrency", default="1,8,32,64", help="comma-separated levels")
    p.add_argument("--input-lens", default="128,512", help="comma-separated prompt lengths")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=0, help="per cell (default: max(8, 2 x concurrency))")
    p.add_argument("--threads", type=int, default=1,
                   help="torch/OMP threads of each engine (default 1: vLLM's own CPU default keeps a core "
                        "for its front end on a 2-core box); 0: each server's own default (vLLM: auto "
                        "binding with a reserved core; ours: torch's default, one thread per physical core)")
    p.add_argument("--dtype", default="float32",
                   help="both servers (vLLM's CPU 'auto' would pick bf16 while our CPU default is fp32)")
    p.add_argument("--max-model-len", type=int, default=0, help="default: longest prompt + output, rounded up")
    p.add_argument("--max-num-seqs", type=int, default=128, help="both servers (vLLM's CPU default)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="both servers (vLLM's CPU default)")
    p.add_argument("--kv-cache-gb", type=int, default=1, help="KV cache GiB of both servers (vLLM takes whole GiB)")
    p.add_argument("--agreement-requests", type=int, default=16, help="greedy requests compared (0: skip)")
    p.add_argument("--agreement-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1,
                   help="measure each cell this many times (fresh prompts, alternating order); medians shown")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=0, help="our gateway port (default: a free one)")
    p.add_argument("--vllm-port", type=int, default=0, help="vLLM port (default: a free one)")
    p.add_argument("--vllm-bind", default="",
                   help="VLLM_CPU_OMP_THREADS_BIND (default nobind, or vLLM's auto with --threads 0; 'auto' pins)")
    p.add_argument("--vllm-args", default="", help="extra arguments for vllm serve")
    p.add_argument("--worker-args", default="", help="extra arguments for our workers")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds each server gets to start")
    p.add_argument("--json", default=None, help="also write every measured row to this file")
    args = p.parse_args(argv)
    cells = level_sizes(args)
    if not cells or args.output_len < 1 or args.threads < 0 or args.rounds < 1:
        p.error("need at least one input length and concurrency level, output_len >= 1, threads >= 0, rounds >= 1")
    if not args.max_model_len:
        need = max(n for n, _, _ in cells) + args.output_len
        args.max_model_len = -(-need // 256) * 256
    return args


def median_row(rows: list[dict]) -> dict:
    """Per-metric median over rounds (numbers only; the first round's labels)."""
    out = dict(rows[0])
    for k, v in rows[0].items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            vals = sorted(r[k] for r in rows)
            if isinstance(v, int):  # counts (requests, failures) stay integers: low median
                out[k] = vals[(len(vals) - 1) // 2]
            else:
                out[k] = vals[len(vals) // 2] if len(vals) % 2 else (vals[len(vals) // 2 - 1] + vals[len(vals) // 2]) / 2
    out["rounds"] = len(rows)
    return out


async def run_sweep(ours: ManagedServer, vllm: ManagedServer, args, vocab: int) -> list[tuple[dict, dict]]:
    cells = []
    for i, (input_len, conc, num) in enumerate(level_sizes(args)):
        rounds: dict[str, list[dict]] = {ours.name: [], vllm.name: []}
        for r in range(args.rounds):
            # Fresh prompts each round (no prefix-cache hits), the same for both servers.
            prompts = random_prompts(num, input_len, vocab, args.seed + 1000 * input_len + conc + 100_000 * r)
            bodies = [request_body(p, args.output_len, True, None) for p in prompts]
            for server in ((ours, vllm) if (i + r) % 2 == 0 else (vllm, ours)):
                row = await measure_cell(server, bodies, conc)
                row["input_len"] = input_len
                rounds[server.name].append(row)
            o, v = rounds[ours.name][-1], rounds[vllm.name][-1]
            print(f"  in={input_len} conc={conc} round {r + 1}: {o['out_tok_per_s']:.1f} vs {v['out_tok_per_s']:.1f} "
                  f"tok/s, TTFT p50 {o['ttft_p50_ms']:.1f} vs {v['ttft_p50_ms']:.1f} ms", flush=True)
        cells.append((median_row(rounds[ours.name]), median_row(rounds[vllm.name])))
    return cells


async def run_all(ours: ManagedServer, vllm: ManagedServer, args, vocab: int) -> tuple[list, Optional[tuple]]:
    warm = [request_body(p, 4, True, None) for p in random_prompts(4, 16, vocab, args.seed + 999)]
    for server in (ours, vllm):
        await warmup_http(server.url, warm, None)
    agree = None
    if args.agreement_requests:
        prompts = random_prompts(args.agreement_requests, min(int(args.input_lens.split(",")[0]), 128), vocab,
                                 args.seed + 7)
        a = await greedy_token_ids(ours, prompts, args.agreement_tokens)
        b = await greedy_token_ids(vllm, prompts, args.agreement_tokens)
        agree = agreement(a, b)
        print(f"greedy agreement over {len(prompts)} requests x {args.agreement_tokens} tokens: "
              f"{100 * agree[0]:.1f} % identical, {100 * agree[1]:.1f} % of tokens before first divergence",
              flush=True)
    return await run_sweep(ours, vllm, args, vocab), agree


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    args.vllm_bin = find_vllm(args.vllm_bin)
    if args.vllm_bin is None:
        print("compare_vllm: skipped, vLLM is not installed (no --vllm-bin, no /tmp/vllmcpu/bin/vllm, "
              "no vllm on PATH); see /work/shared/VLLM_CPU.md", file=sys.stderr)
        return 0
    model_dir = args.model or str(build_preset_model(args.model_size))
    vocab = model_vocab(model_dir, 256)
    log_dir = tempfile.mkdtemp(prefix="compare-vllm-")
    servers = [tokserve_server(args, model_dir, log_dir), vllm_server(args, model_dir, log_dir)]

    def on_sigterm(*_):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_sigterm)
    print(f"model {model_dir} | {threads_label(args.threads)} | max_model_len {args.max_model_len} | "
          f"logs in {log_dir}", flush=True)
    try:
        for s in servers:  # start both at once: vLLM's warm-up compile is the long pole
            s.start()
        deadline = time.monotonic() + args.ready_timeout
        for s in servers:
            s.wait_ready(deadline)
        print("both servers healthy; measuring (cells alternate which server goes first)", flush=True)
        cells, agree = asyncio.run(run_all(servers[0], servers[1], args, vocab))
    except KeyboardInterrupt:
        print("\ninterrupted; stopping servers", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # don't interrupt our own cleanup
        for s in servers:
            s.stop()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    print()
    print(f"model {Path(model_dir).name}, {args.output_len} output tokens (ignore_eos, streaming), "
          f"{threads_label(args.threads)}, {os.cpu_count()} CPUs, median of {args.rounds} round(s) per cell")
    print(format_table(cells))
    if agree is not None:
        print(f"greedy token-id agreement: {100 * agree[0]:.1f} % of requests identical, "
              f"{100 * agree[1]:.1f} % of tokens before first divergence")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model_dir, "threads": args.threads, "agreement": agree,
                       "cells": [{"ours": o, "vllm": v} for o, v in cells]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
