"""Worker liveness with real processes: a worker that is slow (its Python thread cannot
run: the GIL is held, or the CPU is starved) stays registered, while a worker that is
gone (killed, stopped) is dropped within the link liveness (--liveness x
--heartbeat-interval), by libzmq's heartbeats that need no GIL."""
from __future__ import annotations

import signal
import threading
import time

import pytest

from common.client import Client
from common.protocol import GenerateRequest, SamplingParams
from tests.support.fake_worker import GIL_HOG_TOKEN
from tests.support.procs import ProcGroup, cluster_info, scaled, wait_for, wait_for_workers

pytestmark = pytest.mark.timeout(120)

OLD_LIVENESS_S = 3.0  # interval 1 s x liveness 3: what dropped a GIL-bound worker before
HOG_S = 6.0


def _req(rid: str, prompt, rank: int) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=list(prompt), params=SamplingParams(max_tokens=3),
                           data_parallel_rank=rank)


def _registered(frontend: str):
    info = cluster_info(frontend, 2.0)
    return None if info is None else sorted(w.rank for w in info.workers)


def test_gil_bound_worker_stays_registered_while_a_killed_one_is_dropped(tmp_path):
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker("--heartbeat-interval", "1", "--liveness", "3")
        hog = procs.fake_worker(broker, 0, "--gil-hog-seconds", str(HOG_S))
        victim = procs.fake_worker(broker, 1)
        wait_for_workers(broker.frontend, 2)
        with Client(broker.frontend) as client:
            result = {}
            runner = threading.Thread(target=lambda: result.update(
                deltas=list(client.generate(_req("hog", [GIL_HOG_TOKEN, 1], rank=0)))))
            started = time.monotonic()
            runner.start()
            # Watch the pool for the whole hold: rank 0 must never leave it (it would fail its
            # request with "worker died" and re-register under a new identity).
            seen = []
            while runner.is_alive() and time.monotonic() - started < scaled(60):
                seen.append(_registered(broker.frontend))
                runner.join(0.2)
            runner.join(scaled(30))
            held = time.monotonic() - started
            assert not runner.is_alive(), procs.tails()
            assert held >= HOG_S > OLD_LIVENESS_S  # the hold outlasted the old liveness
            assert [d for d in result["deltas"] if d.finish_reason] and \
                sum(len(d.token_ids) for d in result["deltas"]) == 3, result
            assert all(ranks in (None, [0, 1]) for ranks in seen), seen
            stats = client.info().stats
            assert stats.workers_removed == 0 and stats.failed_worker_death == 0, stats

            victim.kill9()
            killed = time.monotonic()
            wait_for(lambda: _registered(broker.frontend) == [0], 10, "the killed worker to be dropped")
            assert time.monotonic() - killed < scaled(OLD_LIVENESS_S + 2)
            assert "worker rank 0 (pid" not in broker.tail(200)  # only rank 1 was ever removed


def test_stopped_worker_is_dropped_by_link_heartbeats_then_rejoins(tmp_path):
    """SIGSTOP keeps the socket open and freezes libzmq's thread too: its link heartbeats go
    unanswered, so it is dropped after the link liveness, long before --unresponsive-timeout."""
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker("--heartbeat-interval", "0.5", "--liveness", "4", "--unresponsive-timeout", "600")
        frozen = procs.fake_worker(broker, 0, "--heartbeat-interval", "0.5", "--liveness", "4",
                                   "--unresponsive-timeout", "600")
        procs.fake_worker(broker, 1, "--heartbeat-interval", "0.5", "--liveness", "4")
        wait_for_workers(broker.frontend, 2)
        frozen.popen.send_signal(signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            wait_for(lambda: _registered(broker.frontend) == [1], 20, "the stopped worker to be dropped")
            # link liveness 2 s (+ up to one interval before libzmq's first unanswered PING)
            assert time.monotonic() - stopped < scaled(2.0 + 0.5 + 2.0)
            assert "link down" in broker.tail(200)
        finally:
            frozen.popen.send_signal(signal.SIGCONT)
        wait_for_workers(broker.frontend, 2, timeout=30)
