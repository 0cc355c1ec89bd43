"""How many connections the gateway holds open, and which one gives way at a cap.

One peer that opens thousands of idle TCP connections must not use up the process's
file descriptors and starve everyone else (issue 39: 22,000 idle connections in 10 s
dropped every /health until the attacker let go).  uvicorn's ``limit_concurrency``
cannot help: it answers 503 to *requests*, and idle connections never send one.  So
the accounting is per connection, from the protocol's ``connection_made``:

- at most ``max_connections`` open (``--limit-concurrency``), and at most
  ``max_per_peer`` from one remote address (``--limit-concurrency-per-peer``);
- a new connection over either cap closes the *oldest idle* connection in its way (of
  its own address for the per-peer cap): idle means no request in flight, whether it
  never sent a byte, is between keep-alive requests or is still trickling headers.  A
  fresh connection therefore always gets in while the attacker's connections are idle,
  even when the attacker shares its address (every loopback client does);
- when nothing in the way is idle (every connection runs a request), the new one is
  admitted into a small ``probe_headroom`` that serves only the probe routes
  (``/health``, ``/metrics``, ``/version``) once and closes; past the headroom it is
  closed at once.

Closing never answers: a connection that sent nothing could read an unasked-for answer
as the reply to the request it sends next (as the keep-alive timeout, it just closes).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Optional

# Routes a headroom connection may ask for (gateway/auth.py serves them without a key).
PROBE_PATHS = frozenset({"/health", "/metrics", "/version"})
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_MAX_PER_PEER = 1024
DEFAULT_PROBE_HEADROOM = 64


def is_probe_path(raw_path: bytes) -> bool:
    """Whether a request target names a probe route, spelled as Falcon's router would
    still match it (percent-escapes, repeated and trailing slashes)."""
    from urllib.parse import unquote

    path = unquote(raw_path.split(b"?", 1)[0].decode("latin-1"))
    return "/" + "/".join(s for s in path.split("/") if s) in PROBE_PATHS


class ConnectionLimiter:
    """Open-connection accounting for one server process (its event loop thread only).

    A connection is any hashable handle; ``close`` is how the limiter closes one it
    evicts.  ``admit`` returns ``"ok"``, ``"probe"`` (headroom: probe routes only) or
    ``"refuse"``; every admitted connection must be ``release``d when it closes.
    """

    def __init__(self, max_connections: int, max_per_peer: int, probe_headroom: int,
                 close: Callable[[Hashable], None]):
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self.probe_headroom = probe_headroom
        self._close = close
        self._peer_of: dict[Hashable, Optional[str]] = {}  # regular connections
        self._probes: set[Hashable] = set()
        self._per_peer: dict[str, int] = {}
        # Idle regular connections, least recently active first, overall and per peer.
        self._idle: OrderedDict[Hashable, None] = OrderedDict()
        self._idle_by_peer: dict[str, OrderedDict[Hashable, None]] = {}
        self.evicted = 0
        self.refused = 0

    @property
    def open_connections(self) -> int:
        return len(self._peer_of) + len(self._probes)

    def admit(self, conn: Hashable, peer: Optional[str]) -> str:
        room = True
        if peer is not None and self._per_peer.get(peer, 0) >= self.max_per_peer:
            room = self._evict_oldest(self._idle_by_peer.get(peer))
        if room and len(self._peer_of) >= self.max_connections:
            room = self._evict_oldest(self._idle)
        if room:
            self._peer_of[conn] = peer
            if peer is not None:
                self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
            self.idle(conn)
            return "ok"
        if len(self._probes) < self.probe_headroom:
            self._probes.add(conn)
            return "probe"
        self.refused += 1
        return "refuse"

    def idle(self, conn: Hashable) -> None:
        """No request in flight (again), or the idle one was just active: it moves to
        the back of the eviction order."""
        if conn not in self._peer_of:
            return
        peer = self._peer_of[conn]
        self._idle[conn] = None
        self._idle.move_to_end(conn)
        if peer is not None:
            by_peer = self._idle_by_peer.setdefault(peer, OrderedDict())
            by_peer[conn] = None
            by_peer.move_to_end(conn)

    def busy(self, conn: Hashable) -> None:
        """A request is in flight: not evictable until it has been answered."""
        self._idle.pop(conn, None)
        peer = self._peer_of.get(conn)
        if peer is not None:
            by_peer = self._idle_by_peer.get(peer)
            if by_peer is not None:
                by_peer.pop(conn, None)
                if not by_peer:
                    del self._idle_by_peer[peer]

    def release(self, conn: Hashable) -> None:
        """The connection is closed (idempotent)."""
        self._probes.discard(conn)
        if conn not in self._peer_of:
            return
        self.busy(conn)
        peer = self._peer_of.pop(conn)
        if peer is not None:
            left = self._per_peer[peer] - 1
            if left:
                self._per_peer[peer] = left
            else:
                del self._per_peer[peer]

    def _evict_oldest(self, idle: Optional[OrderedDict]) -> bool:
        if not idle:
            return False
        victim = next(iter(idle))
        self.release(victim)  # counted out now: its connection_lost comes later
        self.evicted += 1
        self._close(victim)
        return True
