"""Routing across workers: cache-aware vs session vs least-loaded on multi-turn conversations.

One run, one workload, one seed: for each policy a fresh ``tokserve serve --routing P
--workers N`` stack (demo model by default, private ipc endpoints, stopped before the
next starts) serves the same conversations, ``--rounds`` times, each round under a
fresh ``cache_salt`` (a cold cache); the whole sequence of stacks is run ``--repeat``
times, its order rotating, and everything a configuration measured is pooled.

Every conversation starts with the same system prompt (``--system-len`` random tokens)
plus its own user message (``--user-len``); each turn appends the model's reply
(``--output-len`` tokens, greedy, ``ignore_eos``) and a new user message, and sends the
whole history again.  Turns of different conversations interleave with
``--max-concurrency`` requests in flight (a conversation's next turn waits for its
previous one).  No session ids are sent, except to the ``session`` policy (which has
nothing to stick to without them) or with ``--session-ids`` (then to every policy).

Per policy it reports the prefix hit rate (sum of ``usage.prompt_tokens_details.
cached_tokens`` / sum of prompt tokens), the ideal hit rate of one infinite cache on
the same requests (computed from the workload: for each request, its leading full
16-token blocks that some earlier-sent request had computed -- prompt plus output but
the last token -- capped as the engine caps a hit, at the prompt's last token), TTFT
p50/p99 (first SSE chunk with tokens), output tok/s, and the spread of requests over
workers (max / min of the per-worker ``tokserve:worker_requests_received`` deltas from
the gateway's /metrics), plus the broker's ``prefix_routed`` count.  A 1-worker stack
on the same workload is the measured single-cache reference (``--no-single`` skips it).
Then the issue's ratios: cache-aware hit rate / ideal (target >= 0.9), cache-aware TTFT
p50 / least-loaded TTFT p50 (target <= 0.6), cache-aware spread (target <= 1.5).
Reported, never asserted.

    python -m benchmarks.routing                                  # 24 conversations x 5 turns, 2 workers (~4 min)
    python -m benchmarks.routing --conversations 32 --turns 6 --rounds 1 --repeat 1
    python -m benchmarks.routing --policies cache-aware,least-loaded --no-single --json out.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shutil
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Optional

import msgspec

from benchmarks.serve import GENERATE, Stack, percentile
from benchmarks.sse_client import SseConnection

POLICIES = ("cache-aware", "session", "least-loaded")
WARMUP_PER_RANK = 2
BLOCK = 16  # the workers' KV block size (ModelInfo.kv_block_size; --block-size default)


# ----------------------------------------------------------------------------- workload
@dataclass
class Workload:
    system: list[int]
    users: list[list[list[int]]]  # [conversation][turn] -> the new user message's tokens

    @property
    def conversations(self) -> int:
        return len(self.users)

    @property
    def turns(self) -> int:
        return len(self.users[0]) if self.users else 0


def make_workload(conversations: int, turns: int, system_len: int, user_len: int, vocab: int,
                  seed: int) -> Workload:
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(system_len)]
    users = [[[rng.randrange(vocab) for _ in range(user_len)] for _ in range(turns)] for _ in range(conversations)]
    return Workload(system, users)


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    start: float = 0.0  # perf_counter when sent
    end: float = 0.0
    ttft: Optional[float] = None  # seconds to the first chunk carrying tokens
    prompt_tokens: int = 0  # from the usage chunk
    cached_tokens: int = 0
    error: Optional[str] = None


def _block_keys(tokens: list[int], bs: int) -> list[int]:
    """Chained keys of the full blocks of ``tokens`` (a key names the whole prefix)."""
    keys, parent = [], 0
    for i in range(len(tokens) // bs):
        parent = hash((parent, tuple(tokens[i * bs:(i + 1) * bs])))
        keys.append(parent)
    return keys


def ideal_cached(turns: list[Turn], bs: int = BLOCK) -> list[int]:
    """Cached tokens of each request (same order) under one infinite prefix cache that
    holds every block any earlier-sent request computed (its prompt and output but the
    last token, whose KV is never computed); a hit stops before the prompt's last token,
    as the engine's lookup does.  Timing is ignored: an upper bound for any routing."""
    order = sorted(range(len(turns)), key=lambda i: turns[i].start)
    cache: set[int] = set()
    out = [0] * len(turns)
    for i in order:
        t = turns[i]
        n = 0
        for key in _block_keys(t.prompt, bs)[:(len(t.prompt) - 1) // bs]:
            if key not in cache:
                break
            n += 1
        out[i] = n * bs
        cache.update(_block_keys(t.prompt + t.output[:-1], bs))
    return out


# ----------------------------------------------------------------------------- client
def turn_body(prompt: list[int], output_len: int, cache_salt: Optional[str]) -> bytes:
    body = {"token_ids": prompt, "stream": True, "stream_options": {"include_usage": True},
            "sampling_params": {"max_tokens": output_len, "min_tokens": output_len, "ignore_eos": True,
                                "temperature": 0.0, "detokenize": False}}
    if cache_salt:
        body["cache_salt"] = cache_salt
    return msgspec.json.encode(body)


async def send_turn(conn: SseConnection, turn: Turn, body: bytes, headers: Optional[dict[str, str]] = None) -> None:
    # Requests on one connection run one after another, so per-request headers can
    # ride on the connection's extra header lines.
    conn.extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    turn.start = time.perf_counter()
    try:
        async for t, payload in conn.post_sse(GENERATE, body):
            chunk = msgspec.json.decode(payload)
            if "error" in chunk:
                turn.error = str(chunk["error"])
                continue
            for c in chunk.get("choices") or ():
                ids = c.get("token_ids") or []
                if ids and turn.ttft is None:
                    turn.ttft = t - turn.start
                turn.output.extend(ids)
            usage = chunk.get("usage")
            if usage:
                turn.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                turn.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    except Exception as exc:  # counted, not fatal
        turn.error = f"{type(exc).__name__}: {exc}"
        await conn.close()
    turn.end = time.perf_counter()


async def run_conversations(url: str, wl: Workload, output_len: int, max_concurrency: int,
                            session_ids: bool, cache_salt: Optional[str]) -> tuple[list[Turn], float]:
    """All conversations, turns interleaved, ``max_concurrency`` requests in flight; the
    semaphore's FIFO order makes a finished turn's successor queue behind the others."""
    sem = asyncio.Semaphore(max_concurrency)
    conns: asyncio.Queue = asyncio.Queue()
    for _ in range(max_concurrency):
        conns.put_nowait(SseConnection(url))
    turns: list[Turn] = []
    sid_base = uuid.uuid4().hex[:8]

    async def conversation(c: int) -> None:
        history = wl.system + wl.users[c][0]
        sid = f"conv-{sid_base}-{c}" if session_ids else None
        for k in range(wl.turns):
            if k:
                history = history + turns_of[c][-1].output + wl.users[c][k]
            turn = Turn(c, k, history)
            turns_of[c].append(turn)
            turns.append(turn)
            async with sem:
                conn = await conns.get()
                try:
                    await send_turn(conn, turn, turn_body(history, output_len, cache_salt),
                                    {"X-Session-ID": sid} if sid else None)
                finally:
                    conns.put_nowait(conn)
            if turn.error:
                return  # the history is broken; the conversation ends here

    turns_of: list[list[Turn]] = [[] for _ in range(wl.conversations)]
    t0 = time.perf_counter()
    await asyncio.gather(*(conversation(c) for c in range(wl.conversations)))
    duration = time.perf_counter() - t0
    while not conns.empty():
        await conns.get_nowait().close()
    return turns, duration


async def warm_up(url: str, workers: int, output_len: int) -> None:
    """WARMUP_PER_RANK requests pinned to every rank (own cache salt: nothing of the workload's cached)."""
    rng = random.Random(12345)
    for rank in range(workers):
        conn = SseConnection(url)
        try:
            for _ in range(WARMUP_PER_RANK):
                turn = Turn(-1, 0, [rng.randrange(256) for _ in range(64)])
                await send_turn(conn, turn, turn_body(turn.prompt, output_len, uuid.uuid4().hex),
                                {"X-data-parallel-rank": str(rank)})
                if turn.error:
                    raise RuntimeError(f"warm-up request on rank {rank} failed: {turn.error}")
        finally:
            await conn.close()


# ----------------------------------------------------------------------------- stack metrics
_METRIC = re.compile(r'^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)')


def parse_metrics(text: str) -> dict[tuple[str, str], float]:
    """(name, labels) -> value of a Prometheus text exposition (``_total`` kept as written)."""
    out = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m and not line.startswith("#"):
            try:
                out[(m.group(1), m.group(2) or "")] = float(m.group(3))
            except ValueError:
                pass
    return out


def scrape(url: str) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        return parse_metrics(r.read().decode())


def per_worker_received(metrics: dict[tuple[str, str], float]) -> dict[int, float]:
    out = {}
    for (name, labels), v in metrics.items():
        if name in ("tokserve:worker_requests_received", "tokserve:worker_requests_received_total"):
            m = re.search(r'engine="(\d+)"', labels)
            if m:
                out[int(m.group(1))] = v
    return out


def metric(metrics: dict[tuple[str, str], float], name: str) -> float:
    return metrics.get((name + "_total", ""), metrics.get((name, ""), 0.0))


def wait_live_workers(url: str, n: int, timeout: float = 120.0) -> None:
    """/health answers with one worker; the runs need all of them registered."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if metric(scrape(url), "tokserve:broker_live_workers") >= n:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{n} workers did not register within {timeout:.0f} s")


def scrape_settled(url: str, received: int, timeout: float = 8.0) -> dict[tuple[str, str], float]:
    """/metrics once the workers' ``num_received`` add up to ``received`` (workers report it
    with their load, the gateway caches the broker's view for a second), or at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape(url)
        if sum(per_worker_received(metrics).values()) >= received or time.monotonic() > deadline:
            return metrics
        time.sleep(0.5)


# ----------------------------------------------------------------------------- stats
def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def policy_row(label: str, turns: list[Turn], ideal: list[int], duration: float,
               counts: Optional[dict[int, int]], prefix_routed: Optional[float]) -> dict:
    ok = [t for t in turns if t.error is None]
    ideal_ok = [c for t, c in zip(turns, ideal) if t.error is None]
    prompt = sum(t.prompt_tokens or len(t.prompt) for t in ok)
    ttft = [t.ttft * 1e3 for t in ok if t.ttft is not None]
    values = list(counts.values()) if counts else []
    spread = (max(values) / min(values) if min(values) else float("inf")) if values else float("nan")
    return dict(
        label=label, requests=len(ok), failed=len(turns) - len(ok), prompt_tokens=prompt,
        cached_tokens=sum(t.cached_tokens for t in ok), ideal_cached_tokens=sum(ideal_ok),
        hit_rate=sum(t.cached_tokens for t in ok) / prompt if prompt else float("nan"),
        ideal_hit_rate=sum(ideal_ok) / prompt if prompt else float("nan"),
        ttft_p50_ms=percentile(ttft, 50), ttft_p99_ms=percentile(ttft, 99),
        out_tok_per_s=sum(len(t.output) for t in ok) / duration if duration else float("nan"),
        duration_s=duration, per_worker=counts or {}, spread=spread,
        prefix_routed=prefix_routed,
    )


def print_table(rows: list[dict]) -> None:
    head = (f"{'policy':<16}{'reqs':>5}{'fail':>5}{'hit rate':>9}{'ideal':>8}{'hit/ideal':>10}"
            f"{'TTFT p50':>10}{'TTFT p99':>10}{'out tok/s':>10}{'per worker':>16}{'spread':>8}{'prefix-routed':>14}")
    print(head)
    for r in rows:
        per = "/".join(str(r["per_worker"][k]) for k in sorted(r["per_worker"])) or "n/a"
        routed = "n/a" if r["prefix_routed"] is None else f"{r['prefix_routed']:.0f}"
        print(f"{r['label']:<16}{r['requests']:>5}{r['failed']:>5}{100 * r['hit_rate']:>8.1f}%"
              f"{100 * r['ideal_hit_rate']:>7.1f}%{ratio(r['hit_rate'], r['ideal_hit_rate']):>10.3f}"
              f"{r['ttft_p50_ms']:>10.1f}{r['ttft_p99_ms']:>10.1f}{r['out_tok_per_s']:>10.1f}{per:>16}"
              f"{r['spread']:>8.2f}{routed:>14}")
    print("(hit rate: cached / prompt tokens; ideal: one infinite cache on the same requests, computed from the "
          "workload; TTFT in ms; per worker: requests each worker received; spread: max / min of those)")


def target_lines(rows: dict[str, dict]) -> list[str]:
    ca, ll, single = rows.get("cache-aware"), rows.get("least-loaded"), rows.get("1 worker")
    lines = []
    if ca:
        lines.append(f"cache-aware hit rate / ideal          : {ratio(ca['hit_rate'], ca['ideal_hit_rate']):.3f}"
                     "   (target >= 0.9)")
        if single:
            lines.append(f"cache-aware hit rate / 1-worker's     : {ratio(ca['hit_rate'], single['hit_rate']):.3f}"
                         "   (the measured single-cache reference)")
        if ll:
            lines.append(f"cache-aware TTFT p50 / least-loaded's : {ratio(ca['ttft_p50_ms'], ll['ttft_p50_ms']):.3f}"
                         "   (target <= 0.6)")
        lines.append(f"cache-aware load spread (max/min)     : {ca['spread']:.2f}   (target <= 1.5)")
    return lines


# ----------------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.routing", description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, run in this order")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--no-single", action="store_true", help="skip the 1-worker reference stack")
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-len", type=int, default=256, help="shared system prompt tokens")
    p.add_argument("--user-len", type=int, default=32, help="tokens of each new user message")
    p.add_argument("--output-len", type=int, default=16, help="tokens of each reply (ignore_eos, greedy)")
    p.add_argument("--max-concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--session-ids", action="store_true",
                   help="send X-Session-ID per conversation to every policy (always sent to 'session')")
    p.add_argument("--rounds", type=int, default=2,
                   help="workload runs per stack, each under a fresh cache_salt (a cold cache, nothing reused "
                        "across rounds)")
    p.add_argument("--repeat", type=int, default=3,
                   help="passes over all the stacks, their order rotating (background load on a shared machine "
                        "moves; each configuration sees each slot); rounds and repeats are pooled")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=256, help="token ids are drawn below this")
    p.add_argument("--model", default=None, help="model folder (default: the demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--worker-args", default="",
                   help="extra worker flags (the launcher's CPU default: 1 torch thread per worker on 2 cores)")
    p.add_argument("--json", default=None, help="also write the rows here")
    return p.parse_args(argv)


@dataclass
class Pool:
    """What one configuration's stacks measured, pooled over rounds and repeats."""
    label: str
    routing: str
    workers: int
    session_ids: bool
    turns: list[Turn] = field(default_factory=list)
    ideal: list[int] = field(default_factory=list)
    duration: float = 0.0
    counts: dict[int, int] = field(default_factory=dict)
    prefix_routed: float = 0.0
    ttft_p50_runs: list[float] = field(default_factory=list)  # per stack, to show the run-to-run noise

    def row(self) -> dict:
        row = policy_row(self.label, self.turns, self.ideal, self.duration, self.counts,
                         self.prefix_routed if self.workers > 1 else None)
        row.update(routing=self.routing, workers=self.workers, session_ids=self.session_ids,
                   ttft_p50_runs_ms=self.ttft_p50_runs)
        return row


def bench_stack(model_dir: str, pool: Pool, wl: Workload, args) -> None:
    """One fresh stack for ``pool``'s configuration: warm-up, ``--rounds`` workload runs."""
    stack = Stack(model_dir, pool.workers, args.worker_args, args.device)
    stack.argv += ["--routing", pool.routing, "--enable-prompt-tokens-details"]  # the hit rate reads cached_tokens
    turns: list[Turn] = []
    with stack:
        wait_live_workers(stack.url, pool.workers)
        asyncio.run(warm_up(stack.url, pool.workers, 4))
        before = scrape_settled(stack.url, WARMUP_PER_RANK * pool.workers)
        for _ in range(args.rounds):
            salt = uuid.uuid4().hex  # a cold cache namespace per round (the warm-up's is another)
            got, d = asyncio.run(run_conversations(stack.url, wl, args.output_len, args.max_concurrency,
                                                   pool.session_ids, salt))
            turns += got
            pool.ideal += ideal_cached(got)
            pool.duration += d
        sent_before = per_worker_received(before)
        after = scrape_settled(stack.url, sum(sent_before.values()) + len(turns))
    shutil.rmtree(stack.tmp, ignore_errors=True)
    pool.turns += turns
    sent_after = per_worker_received(after)
    for r in set(sent_after) | set(sent_before):
        pool.counts[r] = pool.counts.get(r, 0) + int(sent_after.get(r, 0) - sent_before.get(r, 0))
    name = "tokserve:broker_requests_prefix_routed"
    pool.prefix_routed += metric(after, name) - metric(before, name)
    pool.ttft_p50_runs.append(percentile([t.ttft * 1e3 for t in turns if t.error is None and t.ttft is not None], 50))


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise SystemExit(f"unknown policies {sorted(unknown)}; choose from {', '.join(POLICIES)}")
    if args.model:
        model_dir = args.model
    else:
        from worker.engine.loading.demo_model import build_demo_model

        model_dir = str(build_demo_model())
    wl = make_workload(args.conversations, args.turns, args.system_len, args.user_len, args.vocab_size, args.seed)
    print(f"workload: {args.conversations} conversations x {args.turns} turns, system prompt {args.system_len} "
          f"tokens (shared), +{args.user_len} user tokens and {args.output_len} reply tokens per turn "
          f"(last prompt {args.system_len + args.turns * args.user_len + (args.turns - 1) * args.output_len} "
          f"tokens), {args.max_concurrency} in flight; {args.workers} workers; {args.rounds} round(s) per stack, "
          f"{args.repeat} repeat(s); seed {args.seed}", flush=True)
    pools: dict[str, Pool] = {}
    for policy in policies:
        sids = args.session_ids or policy == "session"
        pools[policy] = Pool(policy + (" +sid" if sids else ""), policy, args.workers, sids)
    if not args.no_single:
        pools["1 worker"] = Pool("1 worker", "least-loaded", 1, args.session_ids)
    keys = list(pools)
    for rep in range(args.repeat):
        for key in keys[rep % len(keys):] + keys[:rep % len(keys)]:  # rotate: each sees each slot
            pool = pools[key]
            t0 = time.perf_counter()
            bench_stack(model_dir, pool, wl, args)
            print(f"  repeat {rep}: {pool.label:<14} TTFT p50 {pool.ttft_p50_runs[-1]:7.1f} ms "
                  f"(stack {time.perf_counter() - t0:.0f} s)", flush=True)
    rows = {key: pool.row() for key, pool in pools.items()}
    print()
    print_table(list(rows.values()))
    print()
    for line in target_lines(rows):
        print(line)
    ca, ll = pools.get("cache-aware"), pools.get("least-loaded")
    if ca and ll and args.repeat > 1:
        per = ", ".join(f"{ratio(a, b):.2f}" for a, b in zip(ca.ttft_p50_runs, ll.ttft_p50_runs))
        print(f"  (TTFT p50 ratio per repeat: {per})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": list(rows.values())}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
