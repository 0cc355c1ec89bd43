"""Sending to clients and workers over the broker's two ROUTER sockets.

Owns what a failed send means, in one place: a client that cannot be reached has its
requests aborted, a worker that cannot be reached is unregistered.  Those reactions
belong to the request table and the membership, which the Broker wires in as
``on_client_gone`` / ``on_worker_unreachable`` after building them (they send through
this object, so it exists first).
"""
from __future__ import annotations

from typing import Callable, Optional

import zmq

from broker.workers import Worker, WorkerRegistry
from common import framing
from common.logging import RateLimitedLog


class Links:
    def __init__(self, frontend: zmq.Socket, backend: zmq.Socket, workers: WorkerRegistry, unreachable: RateLimitedLog):
        self.frontend = frontend
        self.backend = backend
        self.workers = workers
        self.unreachable = unreachable  # rate limited: a vanished client's backlog is one line, not thousands
        self.on_client_gone: Optional[Callable[[bytes], None]] = None
        self.on_worker_unreachable: Optional[Callable[[Worker, str], None]] = None

    def to_client(self, client: bytes, frames: list) -> bool:
        try:
            framing.send_frames(self.frontend, [client, *frames])
            return True
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            self.client_unreachable(client, exc)
            return False

    def client_unreachable(self, client: bytes, exc: zmq.ZMQError) -> None:
        """Also the OUTPUTS hot path's answer to a failed send (it sends on the socket itself)."""
        self.unreachable.warning("client %s unreachable (%s): aborting its requests", client.hex(), exc)
        self.on_client_gone(client)

    def to_worker(self, worker: Worker, frames: list) -> bool:
        try:
            framing.send_frames(self.backend, [worker.identity, *frames])
            return True
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            if self.workers.get(worker.identity) is worker:  # not already gone (e.g. removed mid-loop)
                # Its connection closed: the process exited, or libzmq dropped a link whose
                # heartbeats went unanswered (killed, stopped, cut off: common/link_heartbeats.py).
                self.on_worker_unreachable(worker, f"link down, unreachable ({exc})")
            return False
