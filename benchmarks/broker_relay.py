"""Broker relay benchmark: deltas/s through a real broker process and the latency it
adds per hop, each against a direct DEALER<->ROUTER baseline measured in the same run.

  python benchmarks/broker_relay.py [--steps 5000] [--concurrency 1,16,256] [--pings 2000] [--full]

Throughput: a lean "blaster" worker answers GENERATEs of one client by shipping
one OUTPUTS frame set per step carrying one delta for every open request (the
real worker's layout), as fast as it can; the client decodes every body and
counts deltas.  Baseline: the same blaster bound as a ROUTER sending the same
bodies straight to the client.  Latency: round trips of a 1-token request through
the broker (client -> broker -> worker -> broker -> client) vs a direct echo;
the broker's added latency per hop is (rtt_broker - rtt_direct) / 2.  On a small
shared machine wall-clock rates mostly measure CPU contention between the three
processes, so the broker's own CPU time per relayed message (from /proc) and the
delta rate one broker core sustains at that cost are printed too.
``--full`` also runs tests/support/fake_worker.py (real WorkerServer loop, fake engine)
with the AsyncClient, i.e. the whole Python path minus the model.
"""
from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zmq  # noqa: E402

from common import framing, runtime_dir  # noqa: E402
from common.protocol import (MAGIC, CompletionDelta, GenerateRequest, ModelInfo, MsgType, Outputs,  # noqa: E402
                             OutputsHeader, SamplingParams, WorkerLoad, WorkerReady)
from tests.support.procs import ProcGroup, free_endpoint, wait_for_workers  # noqa: E402

MODEL = ModelInfo(name="bench", vocab_size=1000, max_model_len=100_000, max_num_seqs=100_000)


# ------------------------------------------------------------------ workers
def _worker_token() -> str:
    """The broker registers only workers that know its token (common/runtime_dir.py)."""
    return runtime_dir.load_or_create_token(runtime_dir.WORKER)


def _step_bodies(rids: list[str], steps: int) -> tuple[bytes, bytes]:
    mid = framing.encode(Outputs([CompletionDelta(r, 0, [7]) for r in rids]))
    last = framing.encode(Outputs([CompletionDelta(r, 0, [7], finish_reason="length") for r in rids]))
    return mid, last


def blaster_via_broker(backend: str, concurrency: int, steps: int) -> None:
    """Registers with the broker, collects ``concurrency`` GENERATEs, then blasts."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(backend)
    sock.send_multipart(framing.message(MsgType.READY, WorkerReady(0, MODEL, WorkerLoad(max_num_seqs=100_000),
                                                                     worker_token=_worker_token())))
    last_beat = time.monotonic()
    while True:
        rids, client = [], None
        while len(rids) < concurrency:
            if sock.poll(200):
                frames = sock.recv_multipart()
                if frames[1] == MsgType.GENERATE:
                    rids.append(framing.decode(frames[2], GenerateRequest).request_id)
                    client = frames[3]
                elif frames[1] == MsgType.DISCONNECT:
                    return
            if time.monotonic() - last_beat > 0.5:
                sock.send_multipart(framing.message(MsgType.HEARTBEAT, WorkerLoad()))
                last_beat = time.monotonic()
        mid, last = _step_bodies(rids, steps)
        start = framing.encode(OutputsHeader(started=rids))
        plain = framing.encode(OutputsHeader())
        end = framing.encode(OutputsHeader(finished=rids))
        for k in range(steps):
            header = start if k == 0 else end if k == steps - 1 else plain
            sock.send_multipart([MAGIC, MsgType.OUTPUTS, header, client, last if k == steps - 1 else mid])


def blaster_direct(endpoint: str, concurrency: int, steps: int) -> None:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(endpoint)
    rids, client = [], None
    while len(rids) < concurrency:
        frames = sock.recv_multipart()
        client = frames[0]
        rids.append(framing.decode(frames[3], GenerateRequest).request_id)
    mid, last = _step_bodies(rids, steps)
    for k in range(steps):
        sock.send_multipart([client, MAGIC, MsgType.OUTPUTS, last if k == steps - 1 else mid])
    time.sleep(1)


def echo_worker_via_broker(backend: str) -> None:
    """Answers each GENERATE at once with a 1-token finished delta."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(backend)
    sock.send_multipart(framing.message(MsgType.READY, WorkerReady(0, MODEL, worker_token=_worker_token())))
    last_beat = time.monotonic()
    while True:
        if sock.poll(200):
            frames = sock.recv_multipart()
            if frames[1] == MsgType.GENERATE:
                rid = framing.decode(frames[2], GenerateRequest).request_id
                body = framing.encode(Outputs([CompletionDelta(rid, 0, [7], finish_reason="length")]))
                sock.send_multipart([MAGIC, MsgType.OUTPUTS, framing.encode(OutputsHeader(finished=[rid])),
                                     frames[3], body])
            elif frames[1] == MsgType.DISCONNECT:
                return
        if time.monotonic() - last_beat > 0.5:
            sock.send_multipart(framing.message(MsgType.HEARTBEAT, WorkerLoad()))
            last_beat = time.monotonic()


def echo_direct(endpoint: str) -> None:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(endpoint)
    while True:
        frames = sock.recv_multipart()
        rid = framing.decode(frames[3], GenerateRequest).request_id
        body = framing.encode(Outputs([CompletionDelta(rid, 0, [7], finish_reason="length")]))
        sock.send_multipart([frames[0], MAGIC, MsgType.OUTPUTS, body])


# ------------------------------------------------------------------ client side
def _client(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def measure_stream(endpoint: str, concurrency: int, steps: int, tag: str) -> float:
    """Open ``concurrency`` requests, decode every delta; deltas/s from first to last byte."""
    sock = _client(endpoint)
    time.sleep(0.2)
    for i in range(concurrency):
        sock.send_multipart(framing.message(MsgType.GENERATE, GenerateRequest(f"{tag}-{i}", [1])))
    decoder = framing._decoders[Outputs]
    expected, got, finished, t0 = concurrency * steps, 0, 0, None
    while finished < concurrency:
        frames = sock.recv_multipart()
        if t0 is None:
            t0 = time.perf_counter()
        if frames[1] != MsgType.OUTPUTS:
            continue
        for d in decoder.decode(frames[2]).deltas:
            got += 1
            finished += d.finish_reason is not None
    elapsed = time.perf_counter() - t0
    sock.close(0)
    assert got == expected, (got, expected)
    return got / elapsed


def measure_rtt(endpoint: str, pings: int, tag: str) -> list[float]:
    sock = _client(endpoint)
    time.sleep(0.2)
    rtts = []
    for i in range(pings + 100):
        t0 = time.perf_counter()
        sock.send_multipart(framing.message(MsgType.GENERATE, GenerateRequest(f"{tag}-{i}", [1])))
        sock.recv_multipart()
        if i >= 100:  # warm-up excluded
            rtts.append(time.perf_counter() - t0)
    sock.close(0)
    return rtts


def cpu_seconds(pid: int) -> float:
    """User+system CPU time of a process, all its threads (libzmq IO threads included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_full_stack(procs: ProcGroup, concurrency: int, max_tokens: int) -> float:
    from common.client import AsyncClient

    broker = procs.broker()
    procs.fake_worker(broker, 0, "--max-num-seqs", str(concurrency))
    wait_for_workers(broker.frontend, 1)

    async def go():
        async with AsyncClient(broker.frontend) as client:
            async def one(i):
                n = 0
                async for _ in client.generate(GenerateRequest(f"full-{i}", [1], SamplingParams(
                        max_tokens=max_tokens))):
                    n += 1
                return n
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(one(i) for i in range(concurrency)))
            return sum(counts) / (time.perf_counter() - t0)

    return asyncio.run(go())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5000, help="deltas per request in the throughput runs")
    p.add_argument("--concurrency", default="1,16,256")
    p.add_argument("--pings", type=int, default=2000)
    p.add_argument("--full", action="store_true")
    p.add_argument("--repeat", type=int, default=3, help="runs per throughput point (median reported)")
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    print(f"broker relay benchmark ({os.cpu_count()} CPUs; broker, worker and client share them)")
    with ProcGroup(tempfile.mkdtemp(prefix="bench-broker-")) as procs:
        print(f"\n{'concurrent requests':>20} {'direct deltas/s':>16} {'broker deltas/s':>16} {'ratio':>7} "
              f"{'broker CPU us/msg':>18} {'deltas/s per broker core':>25}")
        for c in [int(x) for x in args.concurrency.split(",")]:
            steps = max(2, args.steps if c > 1 else args.steps * 4)  # CPU ticks are 10 ms: many messages
            directs, relays, cpu_per_msg = [], [], []
            for rep in range(args.repeat):  # alternate so that background load hits both alike
                direct_ep = free_endpoint()
                w = ctx.Process(target=blaster_direct, args=(direct_ep, c, steps), daemon=True)
                w.start()
                directs.append(measure_stream(direct_ep, c, steps, f"d{c}-{rep}"))
                w.join(5)
                w.kill()
                broker = procs.broker()
                w = ctx.Process(target=blaster_via_broker, args=(broker.backend, c, steps), daemon=True)
                w.start()
                wait_for_workers(broker.frontend, 1)
                cpu0 = cpu_seconds(broker.pid)
                relays.append(measure_stream(broker.frontend, c, steps, f"b{c}-{rep}"))
                cpu_per_msg.append((cpu_seconds(broker.pid) - cpu0) / steps)
                w.kill()
                broker.stop()
            direct, relayed = statistics.median(directs), statistics.median(relays)
            per_msg = statistics.median(cpu_per_msg)
            print(f"{c:>20} {direct:>16,.0f} {relayed:>16,.0f} {relayed / direct:>7.2f} {per_msg * 1e6:>18.1f} "
                  f"{c / per_msg:>25,.0f}")

        direct_ep = free_endpoint()
        w = ctx.Process(target=echo_direct, args=(direct_ep,), daemon=True)
        w.start()
        direct = measure_rtt(direct_ep, args.pings, "pd")
        w.kill()
        broker = procs.broker()
        w = ctx.Process(target=echo_worker_via_broker, args=(broker.backend,), daemon=True)
        w.start()
        wait_for_workers(broker.frontend, 1)
        relayed = measure_rtt(broker.frontend, args.pings, "pb")
        w.kill()
        broker.stop()
        print(f"\n{'round trip (us)':>20} {'p50':>9} {'p99':>9}")
        print(f"{'direct':>20} {pct(direct, .5) * 1e6:>9.0f} {pct(direct, .99) * 1e6:>9.0f}")
        print(f"{'via broker':>20} {pct(relayed, .5) * 1e6:>9.0f} {pct(relayed, .99) * 1e6:>9.0f}")
        for q, name in ((.5, "p50"), (.99, "p99")):
            added = (pct(relayed, q) - pct(direct, q)) / 2
            print(f"broker added latency per hop {name}: {added * 1e6:.0f} us "
                  f"(round trip ratio {pct(relayed, q) / pct(direct, q):.2f}x)")
        print(f"mean round trip: direct {statistics.mean(direct) * 1e6:.0f} us, "
              f"via broker {statistics.mean(relayed) * 1e6:.0f} us")

        if args.full:
            rate = run_full_stack(procs, 256, 100)
            print(f"\nfull path (AsyncClient + broker + WorkerServer/FakeEngine), 256 streams: {rate:,.0f} deltas/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
