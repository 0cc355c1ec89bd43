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
the growth, sampled from /proc every second.  At the end it checks through the
broker's INFO that the workers are idle with every KV block free (no leak).
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


class MemoryWatch:
    """Per role: baseline (after warm-up), max and last RSS; a restarted process is reported."""

    def __init__(self, launcher_pid: Optional[int]):
        self.launcher_pid = launcher_pid
        self.baseline: dict[str, int] = {}
        self.maximum: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.pids: dict[str, int] = {}
        self.restarted: set[str] = set()

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

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample()
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass
        self.sample()

    def report(self) -> None:
        print(f"\n{'process':<16}{'pid':>8}{'RSS start':>12}{'RSS max':>12}{'RSS end':>12}{'max growth':>12}")
        for role in sorted(self.baseline):
            b, m, e = self.baseline[role], self.maximum[role], self.last[role]
            note = "  (restarted)" if role in self.restarted else ""
            print(f"{role:<16}{self.pids[role]:>8}{b / 1024:>10.1f}MB{m / 1024:>10.1f}MB{e / 1024:>10.1f}MB"
                  f"{(m - b) / 1024:>+10.1f}MB{note}")


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
    return p.parse_args(argv)


async def soak(url: str, args, launcher_pid: Optional[int]) -> tuple[Tally, MemoryWatch, float]:
    warm = Tally()
    await traffic(url, args.warmup, args.concurrency, args.vocab, args.seed + 1, warm)
    watch = MemoryWatch(launcher_pid)
    watch.sample()
    tally, stop = Tally(), asyncio.Event()
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
    watch.report()
    print(f"\nworkers idle with every KV block free afterwards: {'yes' if idle_problem is None else idle_problem}")
    return 0 if not tally.errors and idle_problem is None else 1


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
