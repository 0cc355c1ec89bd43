"""Broker semantics with real processes over loopback TCP: a broker process and
fake workers (tests/support/fake_worker.py runs the real worker loop around a fake engine)."""
from __future__ import annotations

import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq

from common import framing
from common.client import Client, RequestError
from common.protocol import MAGIC, Abort, GenerateRequest, MsgType, SamplingParams
from tests.support.fake_worker import BAD_TOKEN, CRASH_TOKEN
from tests.support.procs import ProcGroup, cluster_info, scaled, wait_for, wait_for_workers

pytestmark = pytest.mark.timeout(60)


def req(rid: str, max_tokens: int = 4, n: int = 1, prompt=(1, 2, 3), **kw) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=list(prompt),
                           params=SamplingParams(n=n, max_tokens=max_tokens), **kw)


def served_rank(deltas) -> int:
    ranks = {t // 1000 for d in deltas for t in d.token_ids}
    assert len(ranks) == 1, ranks
    return ranks.pop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Broker (client frames capped at 1 MiB) + fake workers of rank 0 and 1 (each step sleeps 2 ms)."""
    with ProcGroup(tmp_path_factory.mktemp("broker-logs")) as procs:
        broker = procs.broker("--max-frame-bytes", str(1 << 20))
        for rank in (0, 1):
            procs.fake_worker(broker, rank, "--step-delay", "0.002")
        wait_for_workers(broker.frontend, 2)
        with Client(broker.frontend) as client:
            yield broker, client, procs


def test_generate_streams_all_choices(cluster):
    _, client, _ = cluster
    deltas = list(client.generate(req("basic", max_tokens=3, n=2)))
    by_index = {i: [t for d in deltas if d.index == i for t in d.token_ids] for i in (0, 1)}
    rank = served_rank(deltas)
    assert by_index == {i: [rank * 1000 + i * 100 + k for k in range(3)] for i in (0, 1)}
    assert sorted(d.index for d in deltas if d.finish_reason == "length") == [0, 1]


def test_least_loaded_spreads_concurrent_requests(cluster):
    _, client, _ = cluster
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: list(client.generate(req(f"spread-{i}", max_tokens=30))), range(16)))
    counts = Counter(served_rank(r) for r in results)
    assert all(len(r) == 30 for r in results)
    assert counts[0] >= 5 and counts[1] >= 5, counts


def test_rank_pin_and_out_of_range(cluster):
    _, client, _ = cluster
    for i in range(4):
        assert served_rank(list(client.generate(req(f"pin-{i}", data_parallel_rank=1)))) == 1
    with pytest.raises(RequestError) as exc:
        list(client.generate(req("pin-bad", data_parallel_rank=7)))
    assert exc.value.status == 400 and "out of range" in exc.value.message


def test_session_is_sticky(cluster):
    _, client, _ = cluster
    for session in ("alice", "bob", "carol"):
        ranks = {served_rank(list(client.generate(req(f"{session}-{i}", session_id=session)))) for i in range(4)}
        assert len(ranks) == 1, (session, ranks)


def test_worker_errors_reach_the_client_and_worker_keeps_serving(cluster):
    _, client, _ = cluster
    with pytest.raises(RequestError) as exc:
        list(client.generate(req("bad-input", prompt=[BAD_TOKEN, 1])))
    assert exc.value.status == 400 and "out of vocabulary" in exc.value.message
    with pytest.raises(RequestError) as exc:
        list(client.generate(req("crash", prompt=[CRASH_TOKEN], max_tokens=50, data_parallel_rank=0)))
    assert exc.value.status == 500 and "engine failure" in exc.value.message
    assert len(list(client.generate(req("after-crash", data_parallel_rank=0)))) == 4


def test_duplicate_request_id_rejected(cluster):
    _, client, _ = cluster
    first = client.generate(req("dup", max_tokens=200))
    next(first)
    with Client(cluster[0].frontend) as other:
        with pytest.raises(RequestError) as exc:
            list(other.generate(req("dup")))
    assert exc.value.status == 400 and "already in flight" in exc.value.message
    first.close()


def test_abort_ends_stream_and_frees_worker(cluster):
    broker, client, _ = cluster
    stream = client.generate(req("to-abort", max_tokens=100_000, data_parallel_rank=0))
    first = next(stream)
    assert first.token_ids == [0]
    client.abort(["to-abort", "unknown-id"])
    rest = list(stream)
    assert rest[-1].finish_reason == "abort"
    # Abandoning a stream (closing the iterator) aborts it too.
    stream = client.generate(req("abandoned", max_tokens=100_000, data_parallel_rank=1))
    next(stream)
    stream.close()
    wait_for(lambda: all(w.load.running == 0 for w in cluster_info(broker.frontend).workers), 5,
             "workers to drop aborted requests")


def test_vanished_client_requests_are_aborted_on_worker(cluster):
    broker, _, _ = cluster
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(broker.frontend)
    sock.send_multipart(framing.message(MsgType.GENERATE, req("orphan", max_tokens=100_000, data_parallel_rank=0)))
    assert sock.poll(5000)
    sock.close(0)  # gone without an ABORT
    wait_for(lambda: cluster_info(broker.frontend).workers[0].load.running == 0, 5, "orphan aborted")


def test_garbage_frames_do_not_crash_the_broker(cluster):
    broker, client, _ = cluster
    ctx = zmq.Context.instance()
    for endpoint in (broker.frontend, broker.backend):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(endpoint)
        garbage = [
            [os.urandom(64)],
            [b"XXX", MsgType.GENERATE, b"\x90"],
            [MAGIC, b"\x7f", b""],
            [MAGIC, MsgType.GENERATE, os.urandom(100)],
            [MAGIC, MsgType.GENERATE],
            [MAGIC, MsgType.ABORT, framing.encode(Abort(["x"])), b"extra", b"frames"],
            [MAGIC, MsgType.INFO, b"short"],
            [MAGIC, MsgType.OUTPUTS, b"\x93\x90\x90\xc0", b"only-identity"],
            [MAGIC, MsgType.READY, b"\x01\x02"],
            [MAGIC, MsgType.HEARTBEAT, b"\xff\xff"],
            [],
        ]
        for frames in garbage:
            if frames:
                sock.send_multipart(frames)
        sock.close()
    huge = ctx.socket(zmq.DEALER)
    huge.setsockopt(zmq.LINGER, 0)
    huge.connect(broker.frontend)
    huge.send_multipart([MAGIC, MsgType.GENERATE, b"\0" * (2 << 20)])  # over the 1 MiB cap: disconnected
    time.sleep(0.5)
    huge.close(0)
    assert broker.alive()
    assert len(list(client.generate(req("after-garbage")))) == 4
    assert len(cluster_info(broker.frontend).workers) == 2


def test_info_reports_workers_and_model(cluster):
    _, client, _ = cluster
    info = client.info()
    assert sorted(w.rank for w in info.workers) == [0, 1]
    assert info.model.name == "fake-model" and info.model.max_num_seqs == 64


# ---------------------------------------------------------------- failures


def test_worker_death_fails_started_and_redispatches_unstarted(tmp_path):
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker()
        doomed = procs.fake_worker(broker, 0, "--step-delay", "0.01", "--hold-token", "7")
        wait_for_workers(broker.frontend, 1)
        with Client(broker.frontend) as client:
            started = client.generate(req("started", max_tokens=100_000))
            next(started)
            held = {}
            holder = threading.Thread(target=lambda: held.update(
                deltas=list(client.generate(req("unstarted", prompt=[7, 1], max_tokens=3)))))
            holder.start()
            wait_for(lambda: cluster_info(broker.frontend).workers[0].load.waiting == 1, 5, "held request")
            procs.fake_worker(broker, 1)
            wait_for_workers(broker.frontend, 2)
            doomed.kill9()
            killed_at = time.monotonic()
            with pytest.raises(RequestError) as exc:
                for _ in started:
                    pass
            assert time.monotonic() - killed_at < 3.0
            assert exc.value.status == 500 and "died" in exc.value.message
            holder.join(5)
            assert served_rank(held["deltas"]) == 1 and len(held["deltas"]) == 3
        assert broker.alive()


def test_graceful_worker_exit_drains_then_disconnects(tmp_path):
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker()
        worker = procs.fake_worker(broker, 0, "--step-delay", "0.01")
        wait_for_workers(broker.frontend, 1)
        with Client(broker.frontend) as client:
            stream = client.generate(req("drained", max_tokens=60))
            first = next(stream)
            worker.popen.send_signal(15)
            rest = list(stream)  # finishes normally despite SIGTERM
            assert len([first, *rest]) == 60 and rest[-1].finish_reason == "length"
            assert worker.popen.wait(10) == 0
            wait_for(lambda: cluster_info(broker.frontend).workers == [], 1.0, "worker removed via DISCONNECT")


def test_pending_queue_overflow_and_no_worker_timeout(tmp_path):
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker("--max-pending", "1", "--max-inflight-per-worker", "1", "--no-worker-timeout", "1.5")
        with Client(broker.frontend) as client:
            results = {}

            def run(rid, **kw):
                try:
                    results[rid] = list(client.generate(req(rid, **kw)))
                except RequestError as exc:
                    results[rid] = exc

            def start(rid, **kw):
                t = threading.Thread(target=run, args=(rid,), kwargs=kw)
                t.start()
                return t

            # Queued while no worker exists; served by a worker that arrives in time.
            late = start("late")
            time.sleep(0.2)
            worker = procs.fake_worker(broker, 0, "--step-delay", "0.005")
            late.join(10)
            assert len(results["late"]) == 4

            # The worker is at capacity (1 in flight): one request waits, the next is refused.
            busy = client.generate(req("busy", max_tokens=100_000))
            next(busy)
            queued = start("queued")
            wait_for(lambda: cluster_info(broker.frontend).pending == 1, 5, "request queued in the broker")
            with pytest.raises(RequestError) as exc:
                list(client.generate(req("refused")))
            assert exc.value.status == 503 and "overloaded" in exc.value.message
            busy.close()  # aborts: capacity frees, the queued request runs
            queued.join(10)
            assert len(results["queued"]) == 4

            # No worker for longer than --no-worker-timeout: queued and new requests get 503.
            assert worker.terminate(10) == 0
            waiting = start("orphaned")
            waiting.join(5)
            assert isinstance(results["orphaned"], RequestError) and results["orphaned"].status == 503
            assert "no worker" in results["orphaned"].message
            with pytest.raises(RequestError) as exc:  # still no worker: fails at once
                list(client.generate(req("immediate")))
            assert exc.value.status == 503 and "no worker" in exc.value.message


def test_broker_restart_reconnects_workers_and_clients(tmp_path):
    fast = ("--heartbeat-interval", "0.5")
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker(*fast)
        procs.fake_worker(broker, 0, "--step-delay", "0.01", *fast)
        wait_for_workers(broker.frontend, 1)
        with Client(broker.frontend, heartbeat_interval=0.5) as client:
            stream = client.generate(req("in-flight", max_tokens=100_000))
            next(stream)
            broker.kill9()
            t0 = time.monotonic()
            with pytest.raises(RequestError) as exc:
                for _ in stream:
                    pass
            assert exc.value.status == 503 and time.monotonic() - t0 < 4
            with pytest.raises(RequestError):  # nobody listening: fails fast, no hang
                list(client.generate(req("while-down")))
            broker2 = procs.broker(*fast, frontend=broker.frontend, backend=broker.backend)
            wait_for_workers(broker2.frontend, 1, timeout=10)
            deltas = wait_for(lambda: _try(client, req("after-restart")), 5, "client reconnect")
            assert len(deltas) == 4


def _try(client, request):
    try:
        return list(client.generate(request))
    except RequestError:
        return None


def test_broker_sigterm_fails_in_flight_requests_at_once(tmp_path):
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker()
        procs.fake_worker(broker, 0, "--step-delay", "0.01")
        wait_for_workers(broker.frontend, 1)
        with Client(broker.frontend) as client:
            stream = client.generate(req("cut", max_tokens=100_000))
            next(stream)
            t0 = time.monotonic()
            assert broker.terminate(5) == 0
            with pytest.raises(RequestError) as exc:
                for _ in stream:
                    pass
            # The broker's "shutting down" error, or the client seeing the connection drop first.
            assert exc.value.status == 503
            assert time.monotonic() - t0 < 1.5


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")
def test_curve_encrypted_links(tmp_path):
    import zmq.auth

    public_file, secret_file = zmq.auth.create_certificates(str(tmp_path), "broker")
    public, _ = zmq.auth.load_certificate(public_file)
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker("--curve-secret-file", secret_file, wait=False)
        procs.fake_worker(broker, 0, "--curve-server-key", public.decode())
        with Client(broker.frontend, curve_server_key=public) as client:
            wait_for(lambda: _info_workers(client) == [0], 60, "worker over CURVE")  # two process starts
            assert len(list(client.generate(req("secret")))) == 4
        assert cluster_info(broker.frontend, 0.5) is None  # plaintext peers get nothing


def _info_workers(client):
    try:
        return [w.rank for w in client.info(timeout=scaled(1.0)).workers]
    except RequestError:
        return None


def test_frozen_worker_expires_by_heartbeat_then_rejoins(tmp_path):
    """SIGSTOP keeps the TCP connection up: only the link heartbeats it no longer answers
    (libzmq's, common/link_heartbeats.py) reveal the death."""
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker()
        frozen = procs.fake_worker(broker, 0, "--step-delay", "0.01", "--hold-token", "7")
        wait_for_workers(broker.frontend, 1)
        procs.fake_worker(broker, 1)
        with Client(broker.frontend) as client:
            started = client.generate(req("frozen-started", max_tokens=100_000, data_parallel_rank=0))
            next(started)
            wait_for_workers(broker.frontend, 2)
            held = {}
            # Find a session that sticks to rank 0, so the held request lands on the frozen worker.
            session = next(s for s in (f"s{i}" for i in range(100))
                           if served_rank(list(client.generate(req(f"probe-{s}", max_tokens=1, session_id=s)))) == 0)
            holder = threading.Thread(target=lambda: held.update(
                deltas=list(client.generate(req("frozen-unstarted", prompt=[7], max_tokens=3, session_id=session)))))
            holder.start()
            wait_for(lambda: cluster_info(broker.frontend).workers[0].load.waiting == 1, 5, "held request")
            frozen.popen.send_signal(19)  # SIGSTOP
            stopped = time.monotonic()
            with pytest.raises(RequestError) as exc:
                for _ in started:
                    pass
            assert exc.value.status == 500 and "link down" in exc.value.message
            # link liveness 3 s, plus up to one interval before libzmq's first unanswered PING
            assert time.monotonic() - stopped < scaled(4.5)
            holder.join(5)
            assert served_rank(held["deltas"]) == 1
            frozen.popen.send_signal(18)  # SIGCONT: told it is unknown, it drops its requests and re-registers
            wait_for_workers(broker.frontend, 2, timeout=10)
            assert served_rank(list(client.generate(req("back", data_parallel_rank=0)))) == 0


def test_broker_restart_faster_than_liveness(tmp_path):
    """A broker back before anyone misses a heartbeat must not leave streams hanging:
    the client sees its connection drop, the worker is told to re-register and frees
    the request."""
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker()
        procs.fake_worker(broker, 0, "--step-delay", "0.01")
        wait_for_workers(broker.frontend, 1)
        with Client(broker.frontend) as client:
            stream = client.generate(req("in-flight", max_tokens=100_000))
            next(stream)
            broker.kill9()
            t0 = time.monotonic()
            broker2 = procs.broker(frontend=broker.frontend, backend=broker.backend)
            with pytest.raises(RequestError) as exc:
                for _ in stream:
                    pass
            assert exc.value.status == 503 and time.monotonic() - t0 < 3
            info = wait_for_workers(broker2.frontend, 1, timeout=5)
            wait_for(lambda: cluster_info(broker2.frontend).workers[0].load.running == 0, 5, "request freed")
            assert len(list(client.generate(req("after-fast-restart")))) == 4
            assert info.workers[0].rank == 0
