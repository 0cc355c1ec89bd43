"""An idle-connection flood, as in issue 39: TCP connections that never send a byte,
from one loopback address, each one the server closes opened again.

Used in-process (``Attacker``) for small counts, and as its own process for the flood
(``python -m tests.support.conn_flood``) so that its work never holds the measuring
test's GIL: the latencies measured are the gateway's, not the attacker thread's.
The process writes ``{"ready": true}`` to ``--stats`` once it holds its connections and
its counts there when it gets SIGTERM.
"""
from __future__ import annotations

import argparse
import json
import select
import signal
import socket
import time


def connect(port: int, source: str, timeout: float = 2.0):
    try:
        return socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0))
    except OSError:  # a server out of descriptors, its backlog full
        return None


def readable(socks, timeout_s: float) -> list[socket.socket]:
    """poll, not select: the attacker's descriptors go past select's 1024."""
    poller = select.poll()
    by_fd = {s.fileno(): s for s in socks}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    return [by_fd[fd] for fd, _ in poller.poll(timeout_s * 1000)]


class Attacker:
    def __init__(self, port: int, source: str = "127.0.0.1"):
        self.port, self.source = port, source
        self.socks: set[socket.socket] = set()
        self.opened = 0
        self.closed_by_server = 0
        self.reopened = 0

    def open(self, count: int, within_s: float = 60.0) -> int:
        deadline = time.monotonic() + within_s
        opened = 0
        while opened < count and time.monotonic() < deadline:
            s = connect(self.port, self.source)
            if s is not None:
                self.socks.add(s)
                opened += 1
        self.opened += opened
        return opened

    def reap(self, timeout_s: float = 0.0) -> int:
        """Counts (and forgets) the connections the server has closed."""
        closed = []
        for s in readable(self.socks, timeout_s) if self.socks else ():
            try:
                if s.recv(1) == b"":
                    closed.append(s)
            except OSError:
                closed.append(s)
        for s in closed:
            self.socks.discard(s)
            s.close()
        self.closed_by_server += len(closed)
        return len(closed)

    def hold(self, rate_per_s: float, until) -> None:
        """Re-open what the server closes, at most ``rate_per_s`` connections a second
        (the issue's attacker opened 2,200 a second), until ``until()``."""
        budget, last = 0.0, time.monotonic()
        owed = 0
        while not until():
            owed += self.reap(0.02)
            now = time.monotonic()
            budget = min(budget + (now - last) * rate_per_s, rate_per_s / 10)
            last = now
            while owed and budget >= 1:
                s = connect(self.port, self.source, timeout=0.5)
                budget -= 1
                owed -= 1
                if s is not None:
                    self.socks.add(s)
                    self.reopened += 1

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.socks.clear()

    def stats(self) -> dict:
        return {"opened": self.opened, "closed_by_server": self.closed_by_server, "reopened": self.reopened,
                "held": len(self.socks)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--source", default="127.0.0.1")
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--rate", type=float, default=2200.0)
    p.add_argument("--stats", required=True)
    args = p.parse_args()
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    attacker = Attacker(args.port, args.source)
    attacker.open(args.count)
    _write_json(args.stats, {"ready": True, **attacker.stats()})
    attacker.hold(args.rate, lambda: bool(stop))
    stats = attacker.stats()
    attacker.close()
    _write_json(args.stats, stats)


def _write_json(path: str, value: dict) -> None:
    import os

    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)  # the test never reads half a file


if __name__ == "__main__":
    main()
