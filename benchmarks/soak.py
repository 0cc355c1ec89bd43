"""Soak test: minutes of mixed traffic, then what broke and how much memory grew.

    python -m benchmarks.soak                          # starts `tokserve serve` (demo model, 2 workers), 2 min
    python -m benchmarks.soak --minutes 1 --concurrency 48
    python -m benchmarks.soak --base-url http://127.0.0.1:8000 --frontend tcp://127.0.0.1:5555

Traffic, closed loop at --concurrency: streamed and non-streamed requests with random
prompt and output lengths, greedy or seeded sampling, and two kinds of abort: the
client hangs up mid-stream, or it calls POST /inference/v1/abort_requests and expects
the stream to end with finish_reason "abort".  Every stream must end with [DONE].

Reports requests served per kind, errors by kind, and per process (broker, each
worker, gateway) the resident memory after warm-up, its maximum, its final value and
the growth, sampled from /proc every second.  Once a minute (--report-every) it prints
a row of every process's RSS, with each worker's split between glibc's main heap and
its other anonymous memory; at the end, whether each worker's RSS stayed within ±5 %
over the last two thirds of the run (the exit status is 1 if not).  At the end it also
checks through the broker's INFO that the workers are idle with every KV block free
(no leak).  TOKSERVE_MEMORY_REPORT_S=60 (common/memory_report.py) adds the workers'
allocator totals and, with TOKSERVE_TRACEMALLOC=1, their top Python growth sites.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import time
from typing import Optional

from benchmarks.serve import GENERATE, Stack, child_pids
from benchmarks.sse_client import HttpError, SseConnection

ABORT = "/inference/v1/abort_requests"
KINDS = ("stream", "non_stream", "hangup", "abort_endpoint")
WEIGHTS = (0.4, 0.3, 0.15, 0.15)


# ----------------------------------------------------------------------------- memory
def rss_kib(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def role_of(pid: int) -> Optional[str]:
    """'broker', 'worker[RANK]' or 'gateway[PID]' for a tokserve process, else None."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    if "common.cli" not in argv:
        return None
    cmd = argv[argv.index("common.cli") + 1] if argv.index("common.cli") + 1 < len(argv) else ""
    if cmd == "worker":
        rank = argv[argv.index("--rank") + 1] if "--rank" in argv else "0"
        return f"worker[{rank}]"
    if cmd == "gateway":
        return f"gateway[{pid}]"
    return "broker" if cmd == "broker" else None


def tokserve_processes(launcher_pid: Optional[int]) -> dict[str, int]:
    """role -> pid: the launcher's children, or every tokserve process on the machine."""
    pids = child_pids(launcher_pid) if launcher_pid else [int(p) for p in os.listdir("/proc") if p.isdigit()]
    out = {}
    for pid in pids:
        role = role_of(pid)
        if role is not None:
            out[role] = pid
    return out


def anon_rss_kib(pid: int) -> Optional[dict[str, int]]:
    """Resident KiB of the process's ``[heap]`` (glibc's main arena) and of its other
    anonymous mappings (thread arenas, mmapped chunks, torch/numpy buffers): which of
    the two grows says where to look."""
    heap = anon = 0
    try:
        with open(f"/proc/{pid}/smaps") as f:
            kind = None
            for line in f:
                if not line[0].isupper():  # a mapping's header line: "start-end perms offset dev inode [path]"
                    fields = line.split()
                    kind = "heap" if fields[-1] == "[heap]" else "anon" if len(fields) == 5 else None
                elif kind and line.startswith("Rss:"):
                    kib = int(line.split()[1])
                    if kind == "heap":
                        heap += kib
                    else:
                        anon += kib
    except (OSError, ValueError, IndexError):
        return None
    return {"heap": heap, "anon": anon}


FLAT_TOLERANCE = 0.05  # the soak's criterion: worker RSS within ±5 % ...
FLAT_WINDOW = 2 / 3  # ... over the last two thirds of the run


class MemoryWatch:
    """Per role: baseline (after warm-up), max and last RSS, sampled every second; a
    restarted process is reported.  Once a minute a row of every role's RSS is printed
    (and kept for the final table and the flatness check)."""

    def __init__(self, launcher_pid: Optional[int], served=lambda: 0, period: float = 60.0):
        self.launcher_pid = launcher_pid
        self.served = served  # requests served so far, for the per-minute rows
        self.period = period
        self.baseline: dict[str, int] = {}
        self.maximum: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.pids: dict[str, int] = {}
        self.restarted: set[str] = set()
        self.rows: list[tuple[float, int, dict[str, int]]] = []  # (seconds, served, role -> RSS KiB)
        self.t0 = time.monotonic()

    def sample(self) -> None:
        for role, pid in tokserve_processes(self.launcher_pid).items():
            kib = rss_kib(pid)
            if kib is None:
                continue
            if role in self.pids and self.pids[role] != pid:
                self.restarted.add(role)
            self.pids[role] = pid
            self.baseline.setdefault(role, kib)
            self.maximum[role] = max(self.maximum.get(role, 0), kib)
            self.last[role] = kib

    def roles(self) -> list[str]:
        return sorted(self.baseline)

    def row(self) -> None:
        """Record (and print) one row of the over-time table: every role's RSS now, and
        each worker's heap / other-anonymous split."""
        seconds = time.monotonic() - self.t0
        self.rows.append((seconds, self.served(), dict(self.last)))
        if len(self.rows) == 1:
            print(f"{'min':>5}{'served':>9}" + "".join(f"{r:>16}" for r in self.roles()) + "   (RSS MB)")
        split = []
        for role in self.roles():
            parts = anon_rss_kib(self.pids[role]) if role.startswith("worker") else None
            if parts:
                split.append(f"{role} heap {parts['heap'] / 1024:.0f} anon {parts['anon'] / 1024:.0f}")
        print(f"{seconds / 60:>5.1f}{self.served():>9}"
              + "".join(f"{self.last.get(r, 0) / 1024:>16.1f}" for r in self.roles())
              + (f"   [{'; '.join(split)}]" if split else ""), flush=True)

    async def run(self, stop: asyncio.Event) -> None:
        self.sample()
        self.row()
        next_row = time.monotonic() + self.period
        while not stop.is_set():
            self.sample()
            if time.monotonic() >= next_row:
                self.row()
                next_row += self.period
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
        self.sample()
        self.row()

    def flatness(self, role: str) -> Optional[tuple[float, float]]:
        """(lowest, highest) deviation of ``role``'s RSS over the last FLAT_WINDOW of the
        run from its value where that window starts, as fractions; None without rows."""
        if not self.rows:
            return None
        start = self.rows[-1][0] * (1 - FLAT_WINDOW)
        # from the last row at or before the window's start (the reference) to the end
        first = max((i for i, (t, _, _) in enumerate(self.rows) if t <= start + 1e-6), default=0)
        window = [rss[role] for _, _, rss in self.rows[first:] if role in rss]
        if not window:
            return None
        ref = window[0]
        return min(window) / ref - 1, max(window) / ref - 1

    def report(self) -> bool:
        """Print the summary and the flatness verdict; True when every worker passed."""
        print(f"\n{'process':<16}{'pid':>8}{'RSS start':>12}{'RSS max':>12}{'RSS end':>12}{'max growth':>12}"
              f"{'last 2/3':>18}")
        ok = True
        for role in self.roles():
            b, m, e = self.baseline[role], self.maximum[role], self.last[role]
            note = "  (restarted)" if role in self.restarted else ""
            flat = self.flatness(role)
            span = f"{flat[0] * 100:+.1f}..{flat[1] * 100:+.1f} %" if flat else "-"
            print(f"{role:<16}{self.pids[role]:>8}{b / 1024:>10.1f}MB{m / 1024:>10.1f}MB{e / 1024:>10.1f}MB"
                  f"{(m - b) / 1024:>+10.1f}MB{span:>18}{note}")
            if role.startswith("worker"):
                ok = ok and flat is not None and -FLAT_TOLERANCE <= flat[0] and flat[1] <= FLAT_TOLERANCE
        print(f"worker RSS flat within ±{FLAT_TOLERANCE * 100:.0f} % over the last "
              f"{FLAT_WINDOW * 100:.0f} % of the run: {'PASS' if ok else 'FAIL'}")
        return ok


# ----------------------------------------------------------------------------- traffic
class Tally:
    def __init__(self):
        self.served = collections.Counter()
        self.errors = collections.Counter()
        self.tokens = 0
        self.aborted = 0  # abort-endpoint streams that ended with finish_reason "abort"

    def error(self, kind: str, detail: str) -> None:
        self.errors[f"{kind}: {detail}"] += 1


def random_body(rng: random.Random, vocab: int, stream: bool, long: bool = False) -> dict:
    params = {"max_tokens": rng.randint(64, 256) if long else rng.randint(1, 48), "ignore_eos": True}
    if rng.random() < 0.5:
        params["temperature"] = 0
    else:
        params.update(temperature=rng.uniform(0.5, 1.2), top_p=rng.uniform(0.5, 1.0), seed=rng.randrange(1 << 30))
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 96))]
    return {"token_ids": prompt, "sampling_params": params, "stream": stream}


def _check_chunk(payload: bytes) -> dict:
    chunk = json.loads(payload)
    if "error" in chunk:
        raise HttpError(chunk["error"].get("code", 0), payload)
    return chunk


async def one_request(url: str, kind: str, rng: random.Random, vocab: int, tally: Tally, seq: int) -> None:
    rid = f"soak-{seq}"
    conn = SseConnection(url, headers={"X-Request-Id": rid})
    try:
        if kind == "non_stream":
            body = random_body(rng, vocab, stream=False)
            status, data = await conn.post_json(GENERATE, json.dumps(body).encode())
            if status != 200:
                raise HttpError(status, data)
            choice = json.loads(data)["choices"][0]
            if len(choice["token_ids"]) != body["sampling_params"]["max_tokens"]:
                tally.error(kind, "wrong token count")
                return
            tally.tokens += len(choice["token_ids"])
        elif kind == "stream":
            body = random_body(rng, vocab, stream=True)
            got = 0
            async for _, payload in conn.post_sse(GENERATE, json.dumps(body).encode()):
                got += len(_check_chunk(payload)["choices"][0]["token_ids"])
            if got != body["sampling_params"]["max_tokens"]:
                tally.error(kind, f"lost chunks ({got} of {body['sampling_params']['max_tokens']} tokens)")
                return
            tally.tokens += got
        elif kind == "hangup":
            body = random_body(rng, vocab, stream=True, long=True)
            leave_after = rng.randint(1, 8)
            seen = 0
            async for _, payload in conn.post_sse(GENERATE, json.dumps(body).encode()):
                _check_chunk(payload)
                seen += 1
                if seen >= leave_after:
                    break
        else:  # abort_endpoint
            body = random_body(rng, vocab, stream=True, long=True)
            reason, aborted = None, False
            async for _, payload in conn.post_sse(GENERATE, json.dumps(body).encode()):
                chunk = _check_chunk(payload)
                if chunk["choices"]:
                    reason = chunk["choices"][0]["finish_reason"] or reason
                if not aborted:
                    aborted = True
                    control = SseConnection(url)
                    try:
                        status, data = await control.post_json(ABORT, json.dumps({"request_ids": [rid]}).encode())
                    finally:
                        await control.close()
                    if status != 200:
                        raise HttpError(status, data)
            if reason not in ("abort", "length"):  # "length": it finished before the abort landed
                tally.error(kind, f"stream ended with finish_reason {reason!r}")
                return
            tally.aborted += reason == "abort"
        tally.served[kind] += 1
    except HttpError as exc:
        tally.error(kind, f"HTTP {exc.status}")
    except (ConnectionError, OSError, asyncio.IncompleteReadError) as exc:
        tally.error(kind, type(exc).__name__)
    except asyncio.TimeoutError:
        tally.error(kind, "timeout")
    finally:
        await conn.close()


async def traffic(url: str, seconds: float, concurrency: int, vocab: int, seed: int, tally: Tally) -> None:
    deadline = time.monotonic() + seconds
    counter = iter(range(1 << 62))

    async def loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < deadline:
            kind = rng.choices(KINDS, WEIGHTS)[0]
            seq = next(counter)
            try:
                await asyncio.wait_for(one_request(url, kind, rng, vocab, tally, seq), 120)
            except asyncio.TimeoutError:
                tally.error(kind, "hung (no end after 120 s)")

    await asyncio.gather(*(loop(i) for i in range(concurrency)))


def cluster_idle(frontend: Optional[str], timeout: float = 15.0) -> Optional[str]:
    """None when every worker is idle with all KV blocks free, else what is wrong."""
    if not frontend:
        return "skipped (no --frontend)"
    from common.client import Client, RequestError

    with Client(frontend) as client:
        deadline = time.monotonic() + timeout
        while True:
            try:
                info = client.info()
                bad = [f"rank {w.rank}: running {w.load.running}, waiting {w.load.waiting}, "
                       f"free {w.load.free_kv_blocks}/{w.load.total_kv_blocks}" for w in info.workers
                       if w.load.running or w.load.waiting or w.load.free_kv_blocks != w.load.total_kv_blocks]
                if not bad and info.workers:
                    return None
                problem = "; ".join(bad) or "no worker registered"
            except RequestError as exc:
                problem = str(exc)
            if time.monotonic() > deadline:
                return problem
            time.sleep(0.5)


# ----------------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--base-url", default=None, help="soak a running server instead of starting one")
    p.add_argument("--frontend", default=None, help="its broker frontend, for the final idle/KV check")
    p.add_argument("--model", default=None, help="model folder (default: the demo model)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--worker-args", default="--max-num-seqs 64 --num-kv-blocks 1024 --threads 1")
    p.add_argument("--vocab", type=int, default=256, help="prompt ids are drawn below this")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of traffic before the RSS baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-every", type=float, default=60.0, metavar="SECONDS",
                   help="print a row of every process's RSS this often (default: a minute)")
    return p.parse_args(argv)


async def soak(url: str, args, launcher_pid: Optional[int]) -> tuple[Tally, MemoryWatch, float]:
    warm = Tally()
    await traffic(url, args.warmup, args.concurrency, args.vocab, args.seed + 1, warm)
    tally, stop = Tally(), asyncio.Event()
    watch = MemoryWatch(launcher_pid, served=lambda: sum(tally.served.values()), period=args.report_every)
    sampler = asyncio.create_task(watch.run(stop))
    t0 = time.monotonic()
    await traffic(url, args.minutes * 60, args.concurrency, args.vocab, args.seed, tally)
    elapsed = time.monotonic() - t0
    stop.set()
    await sampler
    return tally, watch, elapsed


def report(tally: Tally, watch: MemoryWatch, elapsed: float, idle_problem: Optional[str]) -> int:
    total = sum(tally.served.values())
    print(f"\nsoak: {elapsed:.0f} s, {total} requests served ({total / elapsed:.1f}/s), "
          f"{tally.tokens} tokens checked")
    for kind in KINDS:
        print(f"  {kind:<16}{tally.served[kind]:>8}")
    print(f"  (abort endpoint honoured before the last token: {tally.aborted} of {tally.served['abort_endpoint']})")
    print(f"errors: {sum(tally.errors.values())}")
    for what, count in tally.errors.most_common():
        print(f"  {what:<50}{count:>6}")
    flat = watch.report()
    print(f"\nworkers idle with every KV block free afterwards: {'yes' if idle_problem is None else idle_problem}")
    return 0 if not tally.errors and idle_problem is None and flat else 1


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.base_url:
        tally, watch, elapsed = asyncio.run(soak(args.base_url, args, None))
        return report(tally, watch, elapsed, cluster_idle(args.frontend))
    model = args.model
    if model is None:
        from worker.engine.loading.demo_model import build_demo_model

        model = str(build_demo_model())
    with Stack(model, args.workers, args.worker_args, "cpu") as stack:
        frontend = f"ipc://{stack.tmp}/frontend"
        tally, watch, elapsed = asyncio.run(soak(stack.url, args, stack.proc.pid))
        return report(tally, watch, elapsed, cluster_idle(frontend))


if __name__ == "__main__":
    raise SystemExit(main())
