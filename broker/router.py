"""Choosing a worker for a request, and the pending queue of those that wait for one.

Owns ``assign`` and its routes, in order of precedence: a worker role the entry's
leg needs (P/D, E/P/D), a ``data_parallel_rank`` pin, ``session_id`` stickiness, an
adapter's workers (LoRA), then the routing policy (broker/dispatch.py: cache-aware
or least-loaded).  What cannot go anywhere now is queued (bounded by max_pending)
or failed; ``dispatch_pending`` drains the queue when capacity appears.

The policy decides among candidates; this module decides who the candidates are and
what happens when there are none.  An encode leg with no encoder worker left is handed
back through ``encode_fallback`` (broker/legs.py runs the request without it), wired by
the Broker: legs assign through this router, so the router cannot own them.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from broker import disagg
from broker.control import ControlPlane
from broker.dispatch import LeastLoaded, sticky_worker
from broker.links import Links
from broker.requests import E_OVERLOADED, Entry, RequestTable
from broker.settings import BrokerConfig
from broker.workers import Worker, WorkerRegistry
from common import framing
from common.protocol import BrokerStats, MsgType


class Router:
    def __init__(self, cfg: BrokerConfig, workers: WorkerRegistry, table: RequestTable, links: Links,
                 policy: LeastLoaded, control: ControlPlane, stats: BrokerStats):
        self.cfg = cfg  # reads routing, max_pending, no_worker_timeout
        self.workers = workers
        self.table = table
        self.links = links
        self.policy = policy
        self.control = control  # paused, pool_version (broker/control.py)
        self.stats = stats
        self.encode_fallback: Optional[Callable[[Entry], None]] = None

    def assign(self, entry: Entry) -> None:
        """Send ``entry`` to a worker, queue it, or fail it."""
        if self.control.paused:  # waits for /resume (bounded by max_pending)
            self.enqueue(entry)
            return
        while True:
            live = self.workers.dispatchable()
            if entry.roles:
                live = [w for w in live if w.role in entry.roles]
            elif entry.rank is None:  # encoder-only workers produce no tokens: only pinned requests go there
                live = [w for w in live if w.role != disagg.ENCODE_ROLE]
            if not live and entry.leg == "encode":  # no encoder worker (any more): it encodes its own pixels
                self.encode_fallback(entry)
                return
            if not live:
                self.enqueue(entry)
                return
            if entry.rank is not None:
                worker = self.workers.by_rank(entry.rank)
                if worker is not None and worker.stale:
                    self.table.fail(entry, 503,
                                    f"data_parallel_rank {entry.rank} holds weights {worker.weight_version!r}, not "
                                    f"the pool's {self.control.pool_version!r}: held out until it is updated",
                                    E_OVERLOADED)
                    return
                if worker is None or worker.draining:
                    ranks = sorted(w.rank for w in live)
                    self.table.fail(entry, 400, f"data_parallel_rank {entry.rank} is out of range (live ranks: "
                                                f"{ranks})", "BadRequestError", "data_parallel_rank")
                    return
            elif entry.session_id is not None and (sticky := self._session_worker(entry, live)) is not None:
                worker = sticky
            else:
                candidates = [w for w in live if self.workers.has_capacity(w)]
                if entry.lora_name is not None and any(entry.lora_name in w.lora_adapters for w in live) \
                        and not any(entry.lora_name in w.lora_adapters for w in candidates):
                    self.enqueue(entry)  # its adapter's workers are full: wait for one of them
                    return
                worker = self.policy.pick(candidates, entry.lora_name, entry.prefix_hashes)
                if worker is None:
                    self.enqueue(entry)
                    return
            if self._send_generate(worker, entry):
                return
            # The worker vanished under us (EHOSTUNREACH): it is unregistered now, try again.

    def _session_worker(self, entry: Entry, live: list[Worker]) -> Optional[Worker]:
        """The session's worker; cache-aware routing leaves it (None) while that worker is full."""
        worker = sticky_worker(entry.session_id, live)
        if self.cfg.routing == "cache-aware" and worker is not None and (
                worker.saturated() or not self.workers.has_capacity(worker)):
            return None
        return worker

    def _send_generate(self, worker: Worker, entry: Entry) -> bool:
        # A leg's deltas come back to the broker itself (broker/disagg.py), never to the client.
        reply_to = disagg.PD_CLIENT if entry.pd_request is not None else entry.client
        if not self.links.to_worker(worker, framing.message(MsgType.GENERATE, entry.body, reply_to)):
            return False
        if entry.prefix_hashes and entry.leg != "encode":  # an encode leg caches no KV there
            worker.prefix_index.expect(entry.prefix_hashes)
        entry.worker = worker
        worker.sent += 1
        worker.requests.add(entry.request_id)
        self.stats.dispatched += 1
        return True

    # ------------------------------------------------------------ pending queue
    def enqueue(self, entry: Entry) -> None:
        table = self.table
        now = time.monotonic()
        if not self.control.paused and not self.workers.dispatchable() and \
                self.workers.no_worker_for(now) > self.cfg.no_worker_timeout:
            table.fail(entry, 503, "no worker available", E_OVERLOADED)
            self.stats.rejected_overloaded += 1
            return
        if table.pending_count >= self.cfg.max_pending:
            table.fail(entry, 503, f"server overloaded: {table.pending_count} requests already queued", E_OVERLOADED)
            self.stats.rejected_overloaded += 1
            return
        entry.worker = None
        entry.queued = True
        table.pending.append(entry)
        table.pending_count += 1

    def dispatch_pending(self) -> None:
        if self.control.paused:
            return
        table = self.table
        pending = table.pending
        while pending:
            entry = pending[0]
            if entry.done:
                pending.popleft()
                continue
            live = self.workers.dispatchable()
            if not live:
                return
            if entry.rank is None and entry.session_id is None and not any(
                    self.workers.has_capacity(w) for w in live):
                return
            pending.popleft()
            table.pending_count -= 1
            entry.queued = False
            self.assign(entry)
            if entry.worker is None and not entry.done:  # re-queued: still no capacity
                return

    def fail_pending(self) -> None:
        """No worker for longer than no_worker_timeout: every queued request gets its 503."""
        pending = self.table.pending
        while pending:
            entry = pending.popleft()
            if not entry.done:
                self.table.fail(entry, 503, "no worker available", E_OVERLOADED)
