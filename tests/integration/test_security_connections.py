"""Connection-level denial of service (issue 39), against real gateway processes over
loopback TCP: one peer opening idle connections past the gateway's file descriptor limit
starved every other client (22,000 idle connections dropped every /health).  Now the
open connections are capped (--limit-concurrency, on by default, fitted under the fd
limit), per address too (--limit-concurrency-per-peer), a new connection closes the
longest-idle one in its way, and with nothing idle a small headroom serves the probes.

The first test reproduces the issue at a small scale: the gateway runs under a
1024-descriptor limit (prlimit) with its default caps, and an attacker holds 1,000 idle
connections, re-opening each one the gateway closes, while a legitimate client measures
its latency (p99 < 100 ms)."""
from __future__ import annotations

import http.client
import json
import math
import select
import socket
import threading
import time

import httpx
import pytest

from gateway.connection_limits import DEFAULT_PROBE_HEADROOM
from gateway.main import FD_RESERVE
from tests.support.gateway_helpers import start_gateway
from tests.support.procs import ProcGroup, wait_for, wait_for_workers

pytestmark = pytest.mark.timeout(300)

KEY = "sk-conn-test"
FD_LIMIT = 1024  # the gateway's RLIMIT_NOFILE in the flood test: its cap is fitted under it
CAP = FD_LIMIT - DEFAULT_PROBE_HEADROOM - FD_RESERVE


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    with ProcGroup(tmp_path_factory.mktemp("security-connections")) as group:
        yield group


@pytest.fixture(scope="module")
def broker(procs):
    broker = procs.broker()
    procs.fake_worker(broker, 0)
    wait_for_workers(broker.frontend, 1)
    return broker


def _connect(port: int, source: str, timeout: float = 2.0) -> socket.socket | None:
    try:
        return socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0))
    except OSError:  # the gateway is out of descriptors and its backlog is full
        return None


def _closed_by_server(socks) -> list[socket.socket]:
    """The sockets the server has closed (EOF or reset readable now)."""
    if not socks:
        return []
    readable, _, _ = select.select(list(socks), [], [], 0)
    closed = []
    for s in readable:
        try:
            if s.recv(1) == b"":
                closed.append(s)
        except OSError:
            closed.append(s)
    return closed


class Attacker:
    """Idle connections from one loopback address; ``hold()`` re-opens, in a thread,
    each one the gateway closes, as the issue's attacker did."""

    def __init__(self, port: int, source: str = "127.0.0.1"):
        self.port, self.source = port, source
        self.socks: set[socket.socket] = set()
        self.closed_by_server = 0
        self.reopened = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def open(self, count: int, within_s: float = 60.0) -> int:
        deadline = time.monotonic() + within_s
        opened = 0
        while opened < count and time.monotonic() < deadline:
            s = _connect(self.port, self.source)
            if s is not None:
                self.socks.add(s)
                opened += 1
        return opened

    def reap(self) -> int:
        closed = _closed_by_server(self.socks)
        for s in closed:
            self.socks.discard(s)
            s.close()
        self.closed_by_server += len(closed)
        return len(closed)

    def hold(self) -> None:
        def loop():
            while not self._stop.is_set():
                # Pacing: the select waits for the gateway to close something; each one
                # closed is re-opened (at most 50 a turn: a bounded attacker on 2 cores).
                if self.socks:
                    select.select(list(self.socks), [], [], 0.05)
                else:
                    self._stop.wait(0.05)
                for _ in range(min(self.reap(), 50)):
                    s = _connect(self.port, self.source, timeout=0.5)
                    if s is not None:
                        self.socks.add(s)
                        self.reopened += 1

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        for s in self.socks:
            s.close()
        self.socks.clear()


def _p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[math.ceil(0.99 * len(ordered)) - 1]


def _fresh_get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


def test_idle_connection_flood_does_not_starve_other_clients(procs, broker):
    """Default caps, a 1024-fd gateway, 1,000 attacker connections held: /health and
    /metrics on fresh connections, /metrics and an authorized /v1/models on a kept-alive
    one, 200 of each, p99 under 100 ms.  Today's gateway ran out of descriptors: the
    probes hung."""
    gw = start_gateway(procs, broker.frontend, "--api-key", KEY, prefix=["prlimit", f"--nofile={FD_LIMIT}"])
    attacker = Attacker(gw.port)
    try:
        opened = attacker.open(1000)
        # Connections past the cap (fitted under 1024 fds) close the longest-idle ones.
        wait_for(lambda: (attacker.reap(), attacker.closed_by_server >= opened - CAP)[1], 30,
                 "the gateway to close attacker connections past its cap")
        attacker.hold()
        latencies: dict[str, list[float]] = {"fresh /health": [], "fresh /metrics": [], "keep-alive /metrics": [],
                                             "keep-alive /v1/models (key)": []}
        with httpx.Client(base_url=gw.url, timeout=10, headers={"Authorization": f"Bearer {KEY}"}) as client:
            for _ in range(200):
                for name, call in (("fresh /health", lambda: _fresh_get(gw.port, "/health")),
                                   ("fresh /metrics", lambda: _fresh_get(gw.port, "/metrics")),
                                   ("keep-alive /metrics", lambda: client.get("/metrics").status_code),
                                   ("keep-alive /v1/models (key)", lambda: client.get("/v1/models").status_code)):
                    t0 = time.perf_counter()
                    assert call() == 200, name
                    latencies[name].append(time.perf_counter() - t0)
        held = len(attacker.socks)
    finally:
        attacker.close()
    figures = {name: f"p50 {sorted(v)[len(v) // 2] * 1000:.1f} ms, p99 {_p99(v) * 1000:.1f} ms, "
                     f"max {max(v) * 1000:.1f} ms" for name, v in latencies.items()}
    print(f"\nattacker: {opened} opened, {attacker.closed_by_server} closed by the gateway, {attacker.reopened} "
          f"re-opened, {held} held at the end\n" + "\n".join(f"  {k}: {v}" for k, v in figures.items()))
    for name, values in latencies.items():
        assert _p99(values) < 0.1, (name, figures[name])
    assert attacker.closed_by_server >= opened - CAP  # the cap held, under the fd limit


@pytest.fixture(scope="module")
def capped(procs, broker):
    """Small caps: 40 connections, 20 per address; a long keep-alive so a kept-alive
    connection is closed only by the caps."""
    return start_gateway(procs, broker.frontend, "--limit-concurrency", "40", "--limit-concurrency-per-peer", "20",
                         "--timeout-keep-alive", "60", "--body-read-timeout", "60")


def _keep_alive_get(sock: socket.socket, path: str) -> bytes:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    sock.settimeout(10)
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed; got {head!r}"
        head += chunk
    return head


def test_one_address_over_its_cap_loses_only_its_own_idle_connections(capped):
    other = socket.create_connection(("127.0.0.1", capped.port), source_address=("127.0.0.3", 0))
    attacker = Attacker(capped.port, "127.0.0.2")
    try:
        assert _keep_alive_get(other, "/health").startswith(b"HTTP/1.1 200")  # idle since, kept alive
        attacker.open(35)
        wait_for(lambda: (attacker.reap(), attacker.closed_by_server >= 15)[1], 30,
                 "the gateway to close 127.0.0.2's connections past 20")
        # Its oldest idle ones went: the other address's idle connection is still served.
        assert _keep_alive_get(other, "/health").startswith(b"HTTP/1.1 200")
        assert attacker.closed_by_server == 15 and len(attacker.socks) == 20
    finally:
        attacker.close()
        other.close()


def test_with_every_connection_busy_the_headroom_serves_only_the_probes(capped):
    """40 connections each in the middle of a request body (not idle, nothing to evict):
    a new connection still gets /health (then closed), and a 503 in vLLM's shape for the
    rest; today's gateway, uncapped, served it all."""
    busy = []
    try:
        for i in range(40):  # 10 per address: the per-address cap is not what is hit
            s = socket.create_connection(("127.0.0.1", capped.port), source_address=(f"127.0.1.{i // 10 + 1}", 0))
            s.sendall(b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n{")
            busy.append(s)
        # The gateway reads each head before the cap matters: poll until a fresh
        # connection is a headroom one (it is closed after its answer).
        def headroom_answer():
            conn = http.client.HTTPConnection("127.0.0.1", capped.port, timeout=10)
            conn.request("POST", "/inference/v1/generate", body=b"{}", headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            body = r.read()
            conn.close()
            return (r.status, body) if r.status == 503 else None

        status, body = wait_for(headroom_answer, 30, "a 503 for a non-probe route at the cap")
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == 503
        assert "--limit-concurrency" in error["message"]
        conn = http.client.HTTPConnection("127.0.0.1", capped.port, timeout=10)
        conn.request("GET", "/health")
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("connection") == "close"
        conn.close()
        assert _fresh_get(capped.port, "/metrics") == 200
    finally:
        for s in busy:
            s.close()
    # The busy ones gone, everything is served again.
    wait_for(lambda: httpx.post(capped.url + "/inference/v1/generate", json={}).status_code != 503, 30,
             "the cap to free up")


def test_connection_flags_reach_the_settings_and_default_on():
    from gateway.connection_limits import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_PER_PEER
    from gateway.main import build_parser, settings_from_args

    s = settings_from_args(build_parser().parse_args([]))
    assert (s.limit_concurrency, s.limit_concurrency_per_peer) == (DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_PER_PEER)
    s = settings_from_args(build_parser().parse_args(["--limit-concurrency", "9", "--limit-concurrency-per-peer", "3"]))
    assert (s.limit_concurrency, s.limit_concurrency_per_peer) == (9, 3)
    with pytest.raises(SystemExit, match="--limit-concurrency-per-peer"):
        settings_from_args(build_parser().parse_args(["--limit-concurrency-per-peer", "0"]))
