"""Serving benchmark in the manner of ``vllm bench serve``.

Random-token prompts, a fixed output length (``ignore_eos``), a closed loop at each
concurrency level; prints TTFT / TPOT / ITL p50 and p99 and throughput.

    python -m benchmarks.serve                               # full stack vs in-process engine, demo model
    python -m benchmarks.serve --base-url http://host:8000   # any compatible server (vLLM included)
    python -m benchmarks.serve --shared-prefix 512           # TTFT with vs without prefix-cache reuse
    python -m benchmarks.serve --api chat --repeat 3         # OpenAI facade vs raw generate, same stack

Without --base-url the benchmark starts ``tokserve serve`` itself and an in-process
``Engine`` (same model, same engine settings), runs each level on both, alternating, and
prints the full-stack / in-process throughput ratio side by side.

``--api chat`` instead runs one workload three ways against the same server in the same
run: raw ``/inference/v1/generate`` (token ids), ``/v1/completions`` with the same
token-id prompts, and ``/v1/chat/completions`` with one user message of random text
whose rendered prompt is about as many tokens; all streaming, greedy, ``ignore_eos``,
``max_tokens = min_tokens = --output-len``, a fresh ``cache_salt`` per request (no
prefix-cache reuse across APIs or repeats).  Runs alternate which API goes first and
the facade / generate ratios of tok/s and TTFT are printed (reported, never asserted).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Optional

import msgspec

from benchmarks.sse_client import SseConnection

GENERATE = "/inference/v1/generate"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
API_PATHS = {"generate": GENERATE, "completions": COMPLETIONS, "chat": CHAT}


@dataclass
class Result:
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: Optional[str] = None
    start: float = 0.0  # perf_counter when the request was sent
    token_times: list[float] = field(default_factory=list)  # perf_counter of each output token's arrival
    prompt_tokens: int = 0  # as the server's usage reports it (facades); 0 when unknown
    first_chunk: Optional[float] = None  # facades: time to the first output chunk, with or without text

    @property
    def tpot(self) -> Optional[float]:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass
class LevelStats:
    label: str
    concurrency: int
    duration: float
    results: list[Result]
    cpu_s: Optional[float] = None  # CPU seconds spent serving (all processes involved)

    @property
    def ok(self) -> list[Result]:
        return [r for r in self.results if r.error is None]

    @property
    def output_throughput(self) -> float:
        return sum(r.output_tokens for r in self.ok) / self.duration

    @property
    def request_throughput(self) -> float:
        return len(self.ok) / self.duration


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(s: LevelStats) -> dict:
    ok = s.ok
    ttft = [r.ttft * 1e3 for r in ok]
    tpot = [r.tpot * 1e3 for r in ok if r.tpot is not None]
    itl = [x * 1e3 for r in ok for x in r.itls]
    return dict(
        label=s.label, concurrency=s.concurrency, requests=len(ok), failed=len(s.results) - len(ok),
        duration_s=s.duration, req_per_s=s.request_throughput, out_tok_per_s=s.output_throughput,
        ttft_p50_ms=percentile(ttft, 50), ttft_p90_ms=percentile(ttft, 90), ttft_p99_ms=percentile(ttft, 99),
        tpot_p50_ms=percentile(tpot, 50), tpot_p99_ms=percentile(tpot, 99),
        itl_p50_ms=percentile(itl, 50), itl_p99_ms=percentile(itl, 99),
        cpu_ms_per_tok=(1e3 * s.cpu_s / max(1, sum(r.output_tokens for r in ok))) if s.cpu_s is not None
        else float("nan"),
        prompt_tokens_mean=(sum(r.prompt_tokens for r in ok) / len(ok)) if ok else float("nan"),
        first_chunk_p50_ms=percentile([(r.ttft if r.first_chunk is None else r.first_chunk) * 1e3 for r in ok], 50),
    )


# ----------------------------------------------------------------------------- workload
def random_prompts(num: int, input_len: int, vocab: int, seed: int, prefix_len: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(vocab) for _ in range(input_len)] for _ in range(num)]


def request_body(prompt: list[int], output_len: int, stream: bool, model: Optional[str],
                 cache_salt: Optional[str] = None) -> bytes:
    body = {"token_ids": prompt, "stream": stream,
            "sampling_params": {"max_tokens": output_len, "min_tokens": output_len, "ignore_eos": True,
                                "temperature": 0.0, "detokenize": False}}
    if model:
        body["model"] = model
    if cache_salt:
        body["cache_salt"] = cache_salt
    return msgspec.json.encode(body)


def facade_sampling(output_len: int, model: Optional[str], cache_salt: Optional[str]) -> dict:
    """The OpenAI-request fields that make the same sampling as ``request_body``'s."""
    body = {"max_tokens": output_len, "min_tokens": output_len, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if cache_salt:
        body["cache_salt"] = cache_salt
    return body


def completion_body(prompt: list[int], output_len: int, model: Optional[str],
                    cache_salt: Optional[str] = None) -> bytes:
    """``/v1/completions`` with a token-id prompt: exactly ``request_body``'s tokens."""
    return msgspec.json.encode({"prompt": prompt, **facade_sampling(output_len, model, cache_salt)})


def chat_body(text: str, output_len: int, model: Optional[str], cache_salt: Optional[str] = None) -> bytes:
    """``/v1/chat/completions`` with one user message."""
    return msgspec.json.encode({"messages": [{"role": "user", "content": text}],
                                **facade_sampling(output_len, model, cache_salt)})


def random_texts(num: int, chars: int, seed: int) -> list[str]:
    """Lower-case words of 2-9 letters, ``chars`` characters each (no leading/trailing space)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    out = []
    for _ in range(num):
        text: list[str] = []
        while len(text) < chars:
            if text:
                text.append(" ")
            text.extend(rng.choice(letters) for _ in range(rng.randint(2, 9)))
        text = text[:chars]
        if text and text[-1] == " ":
            text[-1] = rng.choice(letters)
        out.append("".join(text))
    return out


async def chat_text_chars(url: str, input_len: int, model: Optional[str], headers) -> int:
    """Characters of user text whose rendered chat prompt is about ``input_len`` tokens, found
    with ``/tokenize`` (the template's overhead, then tokens per character); ``input_len`` when
    the server has no /tokenize."""
    conn = SseConnection(url, headers)

    async def count(text: str) -> Optional[int]:
        body = {"messages": [{"role": "user", "content": text}], "add_generation_prompt": True}
        if model:
            body["model"] = model
        status, data = await conn.post_json("/tokenize", msgspec.json.encode(body))
        return msgspec.json.decode(data)["count"] if status == 200 else None

    try:
        probe = max(16, input_len)
        overhead, full = await count(""), await count(random_texts(1, probe, 12345)[0])
    except (OSError, ValueError, KeyError, msgspec.DecodeError):
        return input_len
    finally:
        await conn.close()
    if overhead is None or full is None or full <= overhead:
        return input_len
    return max(1, round((input_len - overhead) * probe / (full - overhead)))


# ----------------------------------------------------------------------------- HTTP runner
def _carries_output(choices: list, chat: bool) -> bool:
    """A facade chunk with generated text: chat content / reasoning / tool calls in the
    delta (the role chunk carries none), completion ``text``."""
    for c in choices:
        if chat:
            d = c.get("delta") or {}
            if d.get("content") or d.get("reasoning") or d.get("reasoning_content") or d.get("tool_calls"):
                return True
        elif c.get("text"):
            return True
    return False


async def facade_one(conn: SseConnection, body: bytes, path: str) -> Result:
    """One streamed OpenAI request: TTFT and ITLs from the chunks carrying text, output
    tokens from the final usage chunk (``stream_options.include_usage``)."""
    res = Result()
    start = res.start = time.perf_counter()
    last = None
    chat = path == CHAT
    usage = None
    chunks = 0
    first_choice = None  # the first output chunk (chat: after the role chunk), text or not
    try:
        async for t, payload in conn.post_sse(path, body):
            chunk = msgspec.json.decode(payload)
            if "error" in chunk:
                res.error = str(chunk["error"])
                continue
            if chunk.get("usage"):
                usage = chunk["usage"]
            choices = chunk.get("choices")
            if not choices:
                continue
            if first_choice is None and not (chat and any("role" in (c.get("delta") or {}) for c in choices)):
                first_choice = t
            if not _carries_output(choices, chat):
                continue
            if last is None:
                res.ttft = t - start
            else:
                res.itls.append(t - last)
            last = t
            chunks += 1
            res.token_times.append(t)
    except Exception as exc:  # a failed request is counted, not fatal
        res.error = f"{type(exc).__name__}: {exc}"
        await conn.close()
    res.e2e = time.perf_counter() - start
    if usage:
        res.output_tokens = int(usage.get("completion_tokens") or 0)
        res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    else:
        res.output_tokens = chunks
    if first_choice is not None:
        res.first_chunk = first_choice - start
        if last is None:  # all output held back (e.g. partial UTF-8): no text chunk
            res.ttft = res.e2e
    return res


async def http_one(conn: SseConnection, body: bytes, path: str = GENERATE) -> Result:
    if path != GENERATE:
        return await facade_one(conn, body, path)
    res = Result()
    start = res.start = time.perf_counter()
    last = None
    try:
        async for t, payload in conn.post_sse(GENERATE, body):
            chunk = msgspec.json.decode(payload)
            if "error" in chunk:
                res.error = str(chunk["error"])
                continue
            n = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
            if not n:
                continue
            if last is None:
                res.ttft = t - start
            else:
                res.itls.append(t - last)
            last = t
            res.output_tokens += n
            res.token_times.extend([t] * n)
    except Exception as exc:  # a failed request is counted, not fatal
        res.error = f"{type(exc).__name__}: {exc}"
        await conn.close()
    res.e2e = time.perf_counter() - start
    return res


async def run_http(base_url: str, bodies: list[bytes], concurrency: int, label: str,
                   headers: Optional[dict[str, str]] = None, path: str = GENERATE) -> LevelStats:
    queue = list(reversed(bodies))
    results: list[Result] = []

    async def worker() -> None:
        conn = SseConnection(base_url, headers)
        try:
            while queue:
                results.append(await http_one(conn, queue.pop(), path))
        finally:
            await conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return LevelStats(label, concurrency, time.perf_counter() - start, results)


async def warmup_http(base_url: str, bodies: list[bytes], headers: Optional[dict[str, str]],
                      path: str = GENERATE) -> None:
    await run_http(base_url, bodies, min(len(bodies), 4), "warmup", headers, path)


# ----------------------------------------------------------------------------- in-process runner
def run_inprocess(engine, prompts: list[list[int]], output_len: int, concurrency: int, label: str) -> LevelStats:
    """Closed loop on the engine itself: keep ``concurrency`` requests in, step, collect."""
    from common.protocol import GenerateRequest, SamplingParams

    todo = list(reversed(prompts))
    live: dict[str, tuple[float, Result, list[float]]] = {}
    results: list[Result] = []

    def admit() -> None:
        while todo and len(live) < concurrency:
            rid = uuid.uuid4().hex
            params = SamplingParams(max_tokens=output_len, min_tokens=output_len, ignore_eos=True, temperature=0.0,
                                    detokenize=False)
            engine.add_request(GenerateRequest(request_id=rid, prompt_token_ids=todo.pop(), params=params,
                                               arrival_time=time.time()))
            live[rid] = (time.perf_counter(), Result(), [])

    start, cpu0 = time.perf_counter(), time.process_time()
    admit()
    while live:
        deltas = engine.step()
        now = time.perf_counter()
        for d in deltas:
            t0, res, last = live[d.request_id]
            if d.token_ids:
                if not last:
                    res.ttft = now - t0
                else:
                    res.itls.append(now - last[0])
                last[:] = [now]
                res.output_tokens += len(d.token_ids)
            if d.finish_reason is not None:
                res.e2e = now - t0
                results.append(res)
                del live[d.request_id]
        admit()
    return LevelStats(label, concurrency, time.perf_counter() - start, results, time.process_time() - cpu0)


# ----------------------------------------------------------------------------- stack management
def process_cpu_s(pid: int) -> float:
    """utime + stime of a process (Linux /proc); 0 when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def child_pids(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


async def run_http_measured(stack: "Stack", bodies: list[bytes], concurrency: int, headers,
                            path: str = GENERATE, label: str = "http") -> LevelStats:
    """run_http plus the CPU the stack's processes and this client spent on it: a ratio that
    background load on a shared machine disturbs far less than wall-clock throughput."""
    pids = child_pids(stack.proc.pid)
    before = sum(process_cpu_s(p) for p in pids) + time.process_time()
    stats = await run_http(stack.url, bodies, concurrency, label, headers, path)
    stats.cpu_s = sum(process_cpu_s(p) for p in pids) + time.process_time() - before
    return stats


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tokserve serve exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError("stack did not become healthy")


class Stack:
    """``tokserve serve`` in a subprocess on private endpoints."""

    def __init__(self, model: str, workers: int, worker_args: str, device: str):
        self.tmp = tempfile.mkdtemp(prefix="tokserve-bench-")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, "-m", "common.cli", "serve", "--model", model, "--workers", str(workers),
                     "--port", str(self.port), "--device", device, "--log-level", "warning",
                     "--frontend", f"ipc://{self.tmp}/frontend", "--backend", f"ipc://{self.tmp}/backend",
                     "--worker-args", worker_args]
        self.proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "Stack":
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL)
        wait_healthy(self.url, 300, self.proc)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# ----------------------------------------------------------------------------- reporting
COLUMNS = [  # (key, header, width, format)
    ("label", "label", 12, "{}"), ("concurrency", "conc", 5, "{}"), ("requests", "reqs", 5, "{}"),
    ("failed", "fail", 4, "{}"), ("req_per_s", "req/s", 8, "{:.2f}"), ("out_tok_per_s", "out tok/s", 9, "{:.1f}"),
    ("ttft_p50_ms", "TTFT p50", 9, "{:.1f}"), ("ttft_p99_ms", "TTFT p99", 9, "{:.1f}"),
    ("tpot_p50_ms", "TPOT p50", 9, "{:.2f}"), ("tpot_p99_ms", "TPOT p99", 9, "{:.2f}"),
    ("itl_p50_ms", "ITL p50", 8, "{:.2f}"), ("itl_p99_ms", "ITL p99", 8, "{:.2f}"),
    ("cpu_ms_per_tok", "CPU/tok", 8, "{:.2f}"),
]


def print_table(rows: list[dict]) -> None:
    print("  ".join(h.ljust(w) if k == "label" else h.rjust(w) for k, h, w, _ in COLUMNS))
    for row in rows:
        print("  ".join(f.format(row[k]).ljust(w) if k == "label" else f.format(row[k]).rjust(w)
                        for k, _, w, f in COLUMNS))
    print("(times in ms)")


def model_vocab(model_dir: Optional[str], default: int) -> int:
    if model_dir and os.path.isfile(os.path.join(model_dir, "config.json")):
        with open(os.path.join(model_dir, "config.json")) as f:
            return int(json.load(f).get("vocab_size", default))
    return default


# ----------------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="benchmark this server instead of starting tokserve")
    p.add_argument("--api", choices=("generate", "chat"), default="generate",
                   help="generate: raw /inference/v1/generate (vs the in-process engine without --base-url); "
                        "chat: the same workload through /inference/v1/generate, /v1/completions (token-id "
                        "prompts) and /v1/chat/completions (text), side by side on one server")
    p.add_argument("--model", default=None, help="model folder (default: the demo model)")
    p.add_argument("--served-model-name", default=None, help="'model' field sent with --base-url")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    p.add_argument("--num-prompts", type=int, default=0, help="per level (default: 4 x concurrency, >= 8)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=256, help="token ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the engine, same on both sides (CPU: leave cores for the rest)")
    p.add_argument("--worker-args", default="", help="extra worker flags for the started stack")
    p.add_argument("--no-inprocess", action="store_true", help="skip the in-process engine comparison")
    p.add_argument("--repeat", type=int, default=1, help="runs per level and side; the median is reported")
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="also run a shared-prefix workload with a prefix of this many tokens")
    p.add_argument("--prefix-concurrency", type=int, default=2, help="concurrency of the shared-prefix workload")
    return p.parse_args(argv)


def level_counts(args) -> list[tuple[int, int]]:
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    return [(c, args.num_prompts or max(8, 4 * c)) for c in levels]


def median_run(runs: list[LevelStats]) -> dict:
    """Of repeated runs, the one with the median output throughput (noise from other load)."""
    runs = sorted(runs, key=lambda r: r.output_throughput)
    return summarize(runs[len(runs) // 2])


def level_bodies(args, vocab: int, conc: int, num: int) -> tuple[list[list[int]], list[bytes]]:
    prompts = random_prompts(num, args.input_len, vocab, args.seed + conc)
    return prompts, [request_body(p, args.output_len, True, args.served_model_name) for p in prompts]


async def warmup_stack(url: str, args, vocab: int, headers) -> None:
    warm = [request_body(p, 4, True, args.served_model_name)
            for p in random_prompts(4, args.input_len, vocab, args.seed + 999)]
    await warmup_http(url, warm, headers)


def bench_http(url: str, args, vocab: int, headers) -> list[dict]:
    asyncio.run(warmup_stack(url, args, vocab, headers))
    rows = []
    for conc, num in level_counts(args):
        _, bodies = level_bodies(args, vocab, conc, num)
        rows.append(median_run([asyncio.run(run_http(url, bodies, conc, "http", headers))
                                for _ in range(args.repeat)]))
    return rows


def bench_side_by_side(stack: "Stack", engine, args, vocab: int, headers) -> tuple[list[dict], list[dict]]:
    """Full stack and in-process engine on the same workload, level by level, runs alternating
    so that both see the same background load."""
    asyncio.run(warmup_stack(stack.url, args, vocab, headers))
    run_inprocess(engine, random_prompts(4, args.input_len, vocab, args.seed + 999), 4, 4, "warmup")
    http_rows, local_rows = [], []
    for conc, num in level_counts(args):
        prompts, bodies = level_bodies(args, vocab, conc, num)
        http_runs, local_runs = [], []
        for _ in range(args.repeat):
            http_runs.append(asyncio.run(run_http_measured(stack, bodies, conc, headers)))
            local_runs.append(run_inprocess(engine, prompts, args.output_len, conc, "in-process"))
        http_rows.append(median_run(http_runs))
        local_rows.append(median_run(local_runs))
    return http_rows, local_rows


# ----------------------------------------------------------------------------- --api chat
APIS = ("generate", "completions", "chat")


def api_bodies(args, api: str, prompts: list[list[int]], texts: list[str], output_len: int) -> list[bytes]:
    """One run's request bodies for ``api``; a fresh cache_salt per request so that no API
    (nor a repeat) reuses another's prefill."""
    model = args.served_model_name
    if api == "generate":
        return [request_body(p, output_len, True, model, cache_salt=uuid.uuid4().hex) for p in prompts]
    if api == "completions":
        return [completion_body(p, output_len, model, uuid.uuid4().hex) for p in prompts]
    return [chat_body(t, output_len, model, uuid.uuid4().hex) for t in texts]


def bench_apis(url: str, args, vocab: int, headers, stack: Optional["Stack"] = None) -> dict[str, list[dict]]:
    """The same workload through generate and the two OpenAI facades, level by level; each
    repeat is a cell whose first API rotates, so that all three see the same background load."""
    chars = asyncio.run(chat_text_chars(url, args.input_len, args.served_model_name, headers))
    warm_prompts = random_prompts(4, args.input_len, vocab, args.seed + 999)
    warm_texts = random_texts(4, chars, args.seed + 999)
    for api in APIS:
        stats = asyncio.run(run_http(url, api_bodies(args, api, warm_prompts, warm_texts, 4), 4, "warmup", headers,
                                     API_PATHS[api]))
        failed = [r.error for r in stats.results if r.error]
        if failed:
            raise RuntimeError(f"{API_PATHS[api]} failed during warm-up: {failed[0]}")
    rows: dict[str, list[dict]] = {api: [] for api in APIS}
    cell = 0
    for conc, num in level_counts(args):
        prompts = random_prompts(num, args.input_len, vocab, args.seed + conc)
        texts = random_texts(num, chars, args.seed + conc)
        runs: dict[str, list[LevelStats]] = {api: [] for api in APIS}
        for _ in range(args.repeat):
            k = cell % len(APIS)
            for api in APIS[k:] + APIS[:k]:
                bodies = api_bodies(args, api, prompts, texts, args.output_len)
                if stack is not None:
                    stats = asyncio.run(run_http_measured(stack, bodies, conc, headers, API_PATHS[api], api))
                else:
                    stats = asyncio.run(run_http(url, bodies, conc, api, headers, API_PATHS[api]))
                if api != "chat":  # token-id prompts: the client knows their length
                    for r in stats.results:
                        r.prompt_tokens = r.prompt_tokens or args.input_len
                runs[api].append(stats)
            cell += 1
        for api in APIS:
            rows[api].append(median_run(runs[api]))
            off = sorted({r.output_tokens for s in runs[api] for r in s.ok} - {args.output_len})
            if off:  # the server's usage disagrees with max_tokens = min_tokens: a different workload
                print(f"warning: {api} at concurrency {conc}: requests produced {off} output tokens, "
                      f"not {args.output_len}", file=sys.stderr)
    return rows


API_COLUMNS = [  # (key, header, width, format)
    ("concurrency", "conc", 4, "{}"), ("label", "api", 11, "{}"), ("requests", "reqs", 4, "{}"),
    ("failed", "fail", 4, "{}"), ("prompt_tokens_mean", "prompt tok", 10, "{:.1f}"),
    ("out_tok_per_s", "out tok/s", 9, "{:.1f}"), ("ttft_p50_ms", "TTFT p50", 8, "{:.1f}"),
    ("ttft_p90_ms", "TTFT p90", 8, "{:.1f}"), ("first_chunk_p50_ms", "1st chunk p50", 13, "{:.1f}"),
    ("itl_p50_ms", "ITL p50", 7, "{:.2f}"),
    ("cpu_ms_per_tok", "CPU/tok", 7, "{:.2f}"),
]


def print_api_table(rows: dict[str, list[dict]]) -> None:
    """Per level: each API's row, then the facade / generate ratios (tok/s: higher is better,
    target >= 0.95x; TTFT: lower is better)."""
    def cells(row: dict) -> str:
        return "  ".join(f.format(row[k]).ljust(w) if k == "label" else f.format(row[k]).rjust(w)
                         for k, _, w, f in API_COLUMNS)

    print("  ".join(h.ljust(w) if k == "label" else h.rjust(w) for k, h, w, _ in API_COLUMNS)
          + "   tok/s ratio  TTFT p50 / p90 ratio")
    for i, gen in enumerate(rows["generate"]):
        for api in APIS:
            row = rows[api][i]
            line = cells(row)
            if api != "generate":
                line += (f"   {row['out_tok_per_s'] / gen['out_tok_per_s']:10.3f}x"
                         f"  {row['ttft_p50_ms'] / gen['ttft_p50_ms']:7.3f}x"
                         f" / {row['ttft_p90_ms'] / gen['ttft_p90_ms']:.3f}x")
            print(line)
    print("(times in ms; ratios are facade / generate on the same server in the same run.  Facade TTFT: the first "
          "chunk with text (chat: content/reasoning); 1st chunk: the first output chunk, empty text included "
          "(completions: the first token; chat: the first chunk after the role chunk).  CPU/tok: CPU of the "
          "stack's processes and this client per output token)")


async def bench_shared_prefix(url: str, args, vocab: int, headers) -> list[dict]:
    """TTFT of prompts sharing a prefix, with cache reuse and with reuse defeated by unique cache_salts."""
    conc = args.prefix_concurrency  # low: TTFT then measures prefill, not queueing
    num = max(8, 4 * conc)
    prompts = random_prompts(num, args.input_len, vocab, args.seed + 7, prefix_len=args.shared_prefix)
    rows = []
    for label, salt in (("prefix-cache", None), ("no-reuse", "unique")):
        bodies = [request_body(p, args.output_len, True, args.served_model_name,
                               cache_salt=(uuid.uuid4().hex if salt else None)) for p in prompts]
        if salt is None:  # seed the cache with the shared prefix once
            await run_http(url, bodies[:1], 1, "seed", headers)
        rows.append(summarize(await run_http(url, bodies, conc, label, headers)))
    return rows


def make_engine(model_dir: str, args):
    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine

    return Engine(EngineConfig(model=model_dir, device=args.device, max_num_seqs=args.max_num_seqs,
                               num_threads=args.threads))


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    if args.base_url:
        vocab = model_vocab(args.model, args.vocab_size)
        if args.api == "chat":
            print_api_table(bench_apis(args.base_url, args, vocab, headers))
            return 0
        rows = bench_http(args.base_url, args, vocab, headers)
        if args.shared_prefix:
            rows += asyncio.run(bench_shared_prefix(args.base_url, args, vocab, headers))
        print_table(rows)
        return 0

    if args.model:
        model_dir = args.model
    else:
        from worker.engine.loading.demo_model import build_demo_model

        model_dir = str(build_demo_model())
    vocab = min(model_vocab(model_dir, args.vocab_size), args.vocab_size)
    worker_args = f"--max-num-seqs {args.max_num_seqs} --threads {args.threads} {args.worker_args}".strip()
    with Stack(model_dir, args.workers, worker_args, args.device) as stack:
        if args.api == "chat":
            print_api_table(bench_apis(stack.url, args, vocab, headers, stack))
            return 0
        if args.no_inprocess:
            print_table(bench_http(stack.url, args, vocab, headers))
        else:
            http_rows, local_rows = bench_side_by_side(stack, make_engine(model_dir, args), args, vocab, headers)
            print_table([r for pair in zip(http_rows, local_rows) for r in pair])
            print("\nfull stack / in-process output throughput:")
            for h, l in zip(http_rows, local_rows):
                print(f"  concurrency {h['concurrency']:>3}: {h['out_tok_per_s']:8.1f} / {l['out_tok_per_s']:8.1f}"
                      f" tok/s = {100 * h['out_tok_per_s'] / l['out_tok_per_s']:5.1f} %;  CPU per token"
                      f" {h['cpu_ms_per_tok']:.2f} / {l['cpu_ms_per_tok']:.2f} ms"
                      f" = {100 * l['cpu_ms_per_tok'] / h['cpu_ms_per_tok']:5.1f} % efficiency")
        prefix_rows = asyncio.run(bench_shared_prefix(stack.url, args, vocab, headers)) if args.shared_prefix else []
    if prefix_rows:
        print("\nshared prefix of", args.shared_prefix, "tokens:")
        print_table(prefix_rows)
        a, b = prefix_rows
        print(f"  TTFT p50 with prefix cache {a['ttft_p50_ms']:.1f} ms vs without {b['ttft_p50_ms']:.1f} ms "
              f"({b['ttft_p50_ms'] / a['ttft_p50_ms']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
