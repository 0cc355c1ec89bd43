"""Link liveness without the GIL: ZeroMQ's own ZMTP heartbeats on a broker <-> worker link.

Two questions, two mechanisms:
  * Is the peer's process alive and its link up?  libzmq answers that: with
    ZMQ_HEARTBEAT_IVL set, its C I/O thread PINGs the peer and drops the connection
    when nothing (no PONG, no message) came back within ZMQ_HEARTBEAT_TIMEOUT.  The
    peer's PONG comes from its own I/O thread too, so neither side needs the GIL or its
    Python loop: a worker starved of CPU, or whose step holds the GIL, still answers,
    while a killed, stopped (SIGSTOP) or cut-off one does not.
  * Is the peer's Python loop responsive?  The application heartbeats answer that,
    against the much longer ``--unresponsive-timeout`` (common/config.py).

A dropped connection shows on a ROUTER as an unroutable identity (ROUTER_MANDATORY:
EHOSTUNREACH on the next send) and as a DISCONNECTED event on its monitor, which
``disconnect_monitor`` / ``drain_disconnects`` watch so the broker acts on it at once.
"""
from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message


def enable(sock: zmq.Socket, interval: float, liveness: int) -> None:
    """PING every ``interval`` seconds; a link silent for ``interval * liveness`` is closed.

    TTL tells the peer the same bound, so that it too closes a link we stopped serving."""
    ivl_ms = max(1, int(interval * 1000))
    timeout_ms = max(ivl_ms, int(interval * liveness * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
    # TTL is sent in deciseconds (at most 6553.5 s), rounded down by libzmq: keep >= 100 ms.
    sock.setsockopt(zmq.HEARTBEAT_TTL, min(6_553_000, max(100, timeout_ms)))


def disconnect_monitor(sock: zmq.Socket) -> zmq.Socket:
    """A PAIR socket that becomes readable when a connection of ``sock`` is dropped."""
    return sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)


def drain_disconnects(monitor: zmq.Socket) -> int:
    """Consume the pending monitor events; returns how many connections were dropped."""
    dropped = 0
    while True:
        try:
            event = recv_monitor_message(monitor, zmq.NOBLOCK)
        except zmq.Again:
            return dropped
        if event["event"] == zmq.EVENT_DISCONNECTED:
            dropped += 1
