"""One broker's ceiling: how many decoding workers one broker process can relay for.

  python benchmarks/broker_ceiling.py [--workers 1,4,16,32,64] [--batch 64] [--step-rate 40] [--gateways 4]

N simulated workers (one process, N registered DEALER peers) each run ``--batch``
streams and emit one OUTPUTS message per decode step at ``--step-rate`` steps/s, one
delta per stream per step, split by gateway as the real worker does (one
identity/body pair per gateway: tests/support/fake_worker.py's layout), followed by the
step's KV_EVENTS message (``--kv-events``: ``batch / 16`` blocks filled and as many
evicted per step, what the broker's prefix index and the cell's publisher digest); ``--gateways``
simulated gateways (one process, one DEALER each) open the streams through the broker
and count every delta they receive.  For each N the offered load grows (N x batch x
step-rate deltas/s, N x step-rate messages/s) until the broker saturates: it delivers
less than what the workers sent in the same window, or its process uses a full core.

Printed per N: concurrent streams, deltas/s the workers sent and the gateways received,
the broker's CPU (cores, from /proc, libzmq IO thread included), its CPU time per delta
and the deltas/s one broker core sustains at that cost, and from it **workers per
broker** at this per-worker rate.  Everything shares this machine's cores (a 2-core box
here), so wall-clock delivery saturates early from contention; the per-core figure is
the one that carries to a dedicated broker core.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import zmq  # noqa: E402

from benchmarks.broker_relay import MODEL, cpu_seconds  # noqa: E402
from common import framing, runtime_dir  # noqa: E402
from common.protocol import (MAGIC, CompletionDelta, GenerateRequest, KvBlockTokens, KvEvents, MsgType,  # noqa: E402
                             Outputs, OutputsHeader, WorkerLoad, WorkerReady)
from tests.support.procs import ProcGroup, free_endpoint, wait_for_workers  # noqa: E402


KV_RING = 64  # distinct KV_EVENTS messages per worker, cycled


def kv_event_ring(rank: int, batch: int, block_size: int, with_tokens: bool) -> list[list[bytes]]:
    """Steady-state decode KV events of one worker: each step ``batch / block_size`` blocks
    fill up (stored) and as many old ones are evicted (removed), as a real worker reports
    after every step; with tokens (for the cell's KV-event publisher) as the worker sends them."""
    per_step = max(1, batch // block_size)
    key = lambda j, i: rank.to_bytes(3, "big") + (j % KV_RING).to_bytes(3, "big") + i.to_bytes(2, "big")  # noqa: E731
    tokens = np.arange(block_size, dtype="<i4").tobytes()
    ring = []
    for j in range(KV_RING):
        stored = [key(j, i) for i in range(per_step)]
        ev = KvEvents(stored=stored, removed=[key(j - KV_RING // 2, i) for i in range(per_step)],
                      tokens=[KvBlockTokens(k, None, tokens) for k in stored] if with_tokens else [])
        ring.append(framing.message(MsgType.KV_EVENTS, ev))
    return ring


def sim_workers(backend: str, n: int, batch: int, step_rate: float, seconds: float, blasting, report,
                kv_events: str = "on") -> None:
    """N workers in one process: register, collect n*batch streams, then emit paced steps
    (an OUTPUTS message per step and worker, then its KV_EVENTS unless ``kv_events`` is "off")."""
    ctx = zmq.Context.instance()
    token = runtime_dir.load_or_create_token(runtime_dir.WORKER)
    socks = []
    for rank in range(n):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(backend)
        s.send_multipart(framing.message(MsgType.READY, WorkerReady(rank, MODEL, WorkerLoad(max_num_seqs=batch),
                                                                     worker_token=token)))
        socks.append(s)
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    streams: list[dict[bytes, list[str]]] = [dict() for _ in range(n)]  # worker -> client -> request ids
    got, last_beat = 0, 0.0
    beat = framing.message(MsgType.HEARTBEAT, WorkerLoad(max_num_seqs=batch))
    while got < n * batch:
        for s, _ in poller.poll(100):
            frames = s.recv_multipart()
            if frames[1] == MsgType.GENERATE:
                w = socks.index(s)
                streams[w].setdefault(frames[3], []).append(framing.decode(frames[2], GenerateRequest).request_id)
                got += 1
        if time.monotonic() - last_beat > 0.3:
            for s in socks:
                s.send_multipart(beat)
            last_beat = time.monotonic()
    # Pre-encoded step messages per worker: [MAGIC, OUTPUTS, header, client, body, client, body, ...]
    steps = max(3, int(seconds * step_rate))

    def message(w: int, k: int) -> list[bytes]:
        rids = [r for ids in streams[w].values() for r in ids]
        header = OutputsHeader(started=rids) if k == 0 else OutputsHeader(finished=rids) if k == steps - 1 \
            else OutputsHeader()
        out = [MAGIC, MsgType.OUTPUTS, framing.encode(header)]
        for client, ids in streams[w].items():
            out += [client, framing.encode(Outputs([CompletionDelta(r, 0, [7], finish_reason="length" if k == steps - 1
                                                                    else None) for r in ids]))]
        return out

    counts = [sum(len(ids) for ids in streams[w].values()) for w in range(n)]
    first = [message(w, 0) for w in range(n)]
    mid = [message(w, 1) for w in range(n)]
    last = [message(w, steps - 1) for w in range(n)]
    rings = [kv_event_ring(w, batch, 16, kv_events == "tokens") for w in range(n)] if kv_events != "off" else None
    blasting.set()
    t0 = time.perf_counter()
    sent = 0
    for k in range(steps):
        wait = t0 + k / step_rate - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        for w, s in enumerate(socks):
            s.send_multipart(first[w] if k == 0 else last[w] if k == steps - 1 else mid[w], copy=False)
            sent += counts[w]
            if rings is not None:
                s.send_multipart(rings[w][k % KV_RING], copy=False)
        if time.monotonic() - last_beat > 0.3:
            for s in socks:
                s.send_multipart(beat)
            last_beat = time.monotonic()
    report.put((sent, time.perf_counter() - t0))
    time.sleep(2)  # let the broker drain before the sockets close


def sim_gateways(frontend: str, gateways: int, streams: int, report) -> None:
    """``gateways`` DEALERs open ``streams`` requests round-robin and count deltas until all finished."""
    ctx = zmq.Context.instance()
    socks = []
    for g in range(gateways):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(frontend)
        socks.append(s)
    time.sleep(0.3)
    for i in range(streams):
        socks[i % gateways].send_multipart(framing.message(MsgType.GENERATE, GenerateRequest(f"s{i}", [1])))
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    decoder = framing._decoders[Outputs]
    deltas = finished = 0
    t_first = t_last = None
    while finished < streams:
        ready = poller.poll(30_000)
        if not ready:
            break  # lost deltas: report what arrived
        for s, _ in ready:
            frames = s.recv_multipart()
            if frames[1] != MsgType.OUTPUTS:
                continue
            now = time.perf_counter()
            t_first = t_first or now
            t_last = now
            for d in decoder.decode(frames[2]).deltas:  # as a gateway does (it must read each delta)
                deltas += 1
                finished += d.finish_reason is not None
    report.put((deltas, (t_last or 0) - (t_first or 0), finished))


def run_level(procs: ProcGroup, n: int, args) -> dict:
    ctx = mp.get_context("spawn")
    kv_events = ["--kv-events-endpoint", free_endpoint(), "--kv-events-allow-tcp"] if args.kv_events == "tokens" else []
    broker = procs.broker(*kv_events)
    blasting, wq, gq = ctx.Event(), ctx.Queue(), ctx.Queue()
    w = ctx.Process(target=sim_workers, args=(broker.backend, n, args.batch, args.step_rate, args.seconds, blasting,
                                              wq, args.kv_events), daemon=True)
    w.start()
    wait_for_workers(broker.frontend, n, timeout=60)
    g = ctx.Process(target=sim_gateways, args=(broker.frontend, args.gateways, n * args.batch, gq), daemon=True)
    g.start()
    if not blasting.wait(120):
        raise RuntimeError("the simulated workers never got their streams\n" + broker.tail())
    cpu0, t0 = cpu_seconds(broker.pid), time.perf_counter()
    sent, send_secs = wq.get(timeout=args.seconds * 20 + 60)
    received, recv_secs, finished = gq.get(timeout=120)
    cpu, wall = cpu_seconds(broker.pid) - cpu0, time.perf_counter() - t0
    w.join(10)
    g.join(10)
    broker.stop()
    return {"workers": n, "streams": n * args.batch, "offered": n * args.batch * args.step_rate,
            "sent": sent / send_secs, "received": received / max(recv_secs, 1e-9), "lost": sent - received,
            "finished": finished, "broker_cores": cpu / wall, "us_per_delta": cpu / max(received, 1) * 1e6}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="1,4,16,32,64", help="simulated workers per run")
    p.add_argument("--batch", type=int, default=64, help="streams per worker (its decode batch)")
    p.add_argument("--step-rate", type=float, default=40.0, help="decode steps/s per worker (tokens/s per stream)")
    p.add_argument("--gateways", type=int, default=4)
    p.add_argument("--seconds", type=float, default=5.0, help="blast duration per run")
    p.add_argument("--kv-events", default="on", choices=["off", "on", "tokens"],
                   help="per step and worker also a KV_EVENTS message (batch/16 blocks stored, as many evicted); "
                        "tokens: with the blocks' token ids and the broker's KV-event publisher on (cells)")
    args = p.parse_args(argv)
    per_worker = args.batch * args.step_rate
    print(f"broker ceiling ({os.cpu_count()} CPUs shared by broker, simulated workers and gateways); "
          f"per worker: batch {args.batch} x {args.step_rate:g} steps/s = {per_worker:,.0f} deltas/s, "
          f"{args.gateways} gateways, KV events {args.kv_events}")
    print(f"{'workers':>8} {'streams':>8} {'offered/s':>10} {'sent/s':>10} {'received/s':>12} {'recv/sent':>9} "
          f"{'broker cores':>13} {'us/delta':>9} {'deltas/s/core':>14} {'workers/core':>13}")
    with ProcGroup(tempfile.mkdtemp(prefix="bench-ceiling-")) as procs:
        for n in [int(x) for x in args.workers.split(",")]:
            r = run_level(procs, n, args)
            per_core = 1e6 / r["us_per_delta"]
            print(f"{r['workers']:>8} {r['streams']:>8} {r['offered']:>10,.0f} {r['sent']:>10,.0f} "
                  f"{r['received']:>12,.0f} {r['received'] / r['sent']:>9.2f} {r['broker_cores']:>13.2f} "
                  f"{r['us_per_delta']:>9.2f} {per_core:>14,.0f} {per_core / per_worker:>13.1f}"
                  + ("" if r["finished"] == r["streams"] else f"  ({r['streams'] - r['finished']} streams unfinished)"),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
