"""Worker membership: who is in the pool, and what happens to a worker's requests when it leaves.

Owns READY (the worker-token check first: a process without the cluster's token
never registers, whatever identity it uses; then the rank claim), heartbeats both
ways, draining goodbyes, liveness expiry, and a worker's departure: its requests
re-dispatched when no delta reached the client yet, failed otherwise.  Also asks
unknown workers (e.g. after a broker restart) to re-register, rate limited.
broker/workers.py's WorkerRegistry stays the data structure; this is its protocol.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import zmq

from broker.control import ControlPlane
from broker.legs import Legs
from broker.links import Links
from broker.prefix_index import PrefixIndex
from broker.requests import E_INTERNAL, RequestTable
from broker.router import Router
from broker.settings import BrokerConfig
from broker.workers import Worker, WorkerRegistry
from common import framing, runtime_dir
from common.logging import RateLimitedLog, get_logger
from common.protocol import BrokerStats, Disconnect, MsgType, WorkerLoad, WorkerReady
from common.transfer_peers import parse_address

log = get_logger("tokserve.broker")


class Membership:
    def __init__(self, cfg: BrokerConfig, workers: WorkerRegistry, table: RequestTable, links: Links, router: Router,
                 legs: Legs, control: ControlPlane, stats: BrokerStats, refused: RateLimitedLog):
        self.cfg = cfg  # reads worker_token, heartbeat_interval, no_worker_timeout
        self.workers = workers
        self.table = table
        self.links = links
        self.router = router
        self.legs = legs
        self.control = control  # on_worker_ready / on_worker_gone, paused (broker/control.py)
        self.stats = stats
        self._refused = refused  # shared with the control plane's token refusals
        self._rejected: dict[bytes, float] = {}  # identity -> last DISCONNECT sent to an unknown worker
        self.on_worker_removed: Optional[Callable[[bytes], None]] = None  # set by the broker (its KV publisher)

    # ------------------------------------------------------------ joining
    def on_ready(self, identity: bytes, worker: Optional[Worker], ready: WorkerReady) -> None:
        if not runtime_dir.token_matches(self.cfg.worker_token, ready.worker_token):
            # Not one of ours: it must never receive a prompt.  Checked first, so that a
            # forged READY from a registered worker's identity changes nothing either.
            self.stats.workers_refused += 1
            self._refused.warning("refused a worker registration (rank %d, pid %d): %s worker token; workers read "
                                  "it from the runtime directory or --worker-token-file", ready.rank, ready.pid,
                                  "wrong" if ready.worker_token else "no")
            if worker is None:
                self.reject_unknown(identity)
            return
        if worker is not None:  # re-registration: it dropped whatever it was running
            self.worker_gone(worker, "re-registered", notify=False)
        holder = self.workers.by_rank(ready.rank)
        if holder is not None:
            # Another live process claims this rank (e.g. a restarted worker while the old one is
            # not yet expired).  Ignore it: it re-sends READY after a liveness period without our
            # heartbeats, by which time a dead holder has expired.
            log.error("worker pid %d claims rank %d already held by pid %d; ignored", ready.pid, ready.rank,
                      holder.pid)
            return
        worker = Worker(identity=identity, rank=ready.rank, model=ready.model, load=ready.load, pid=ready.pid,
                        weight_version=ready.weight_version, world_size=ready.world_size,
                        # A worker caches at most its KV blocks; the slack absorbs event lag.
                        prefix_index=PrefixIndex(capacity=max(4096, 2 * ready.load.total_kv_blocks)),
                        role=ready.role)
        worker.transfer_peer = parse_address(ready.transfer_address)
        self.workers.add(worker)
        self.control.on_worker_ready(worker)
        log.info("worker rank %d registered (pid %d, model %s, max_num_seqs %d)", ready.rank, ready.pid,
                 ready.model.name, ready.model.max_num_seqs)
        self.links.to_worker(worker, framing.message(MsgType.HEARTBEAT))
        self.router.dispatch_pending()

    def reject_unknown(self, identity: bytes) -> None:
        """A worker we do not know (e.g. after a broker restart): ask it to re-register.

        At most once per heartbeat interval per identity: a worker's backlog of messages
        must not turn into a burst of re-registrations."""
        now = time.monotonic()
        if now - self._rejected.get(identity, -1e9) < self.cfg.heartbeat_interval:
            return
        if len(self._rejected) > 1024:
            self._rejected = {k: t for k, t in self._rejected.items() if now - t < self.cfg.heartbeat_interval}
        self._rejected[identity] = now
        try:  # not Links.to_worker: an unknown identity has no Worker to unregister
            framing.send_frames(self.links.backend, [identity, *framing.message(MsgType.DISCONNECT)])
        except zmq.ZMQError:
            pass

    # ------------------------------------------------------------ staying
    def on_heartbeat(self, worker: Worker, rest: list) -> None:
        framing.expect_count(rest, 1, "HEARTBEAT")
        worker.last_seen = time.monotonic()
        if rest[0]:
            worker.load = framing.decode(rest[0], WorkerLoad)
            if self.table.pending:
                self.router.dispatch_pending()

    def heartbeat_workers(self) -> None:
        beat = framing.message(MsgType.HEARTBEAT)
        for worker in self.workers.all():
            self.links.to_worker(worker, beat)
            worker.prefix_index.expire()

    def expire(self, now: float) -> None:
        for worker in self.workers.expired(now):
            self.worker_gone(worker, f"no heartbeat for {now - worker.last_seen:.1f}s")
        if self.table.pending and not self.control.paused and not self.workers.dispatchable() and \
                self.workers.no_worker_for(now) > self.cfg.no_worker_timeout:
            self.router.fail_pending()

    # ------------------------------------------------------------ leaving
    def on_disconnect(self, worker: Worker, rest: list) -> None:
        bye = framing.decode(rest[0], Disconnect) if rest and rest[0] else Disconnect()
        if bye.drain:
            log.info("worker rank %d draining", worker.rank)
            worker.draining = True
            worker.last_seen = self.workers.last_alive = time.monotonic()
        else:
            self.worker_gone(worker, "disconnected", notify=False)

    def worker_gone(self, worker: Worker, reason: str, notify: bool = True) -> None:
        self.workers.remove(worker)
        if self.on_worker_removed is not None:  # the cell's KV-event publisher forgets its blocks
            self.on_worker_removed(worker.identity)
        self.control.on_worker_gone(worker)
        table = self.table
        retried = failed = 0
        for rid in list(worker.requests):
            entry = table.requests[rid]
            if entry.orphaned:
                table.finish(entry)
            elif entry.started or entry.rank is not None:
                # Deltas already reached the client (or it asked for this rank): cannot retry.
                table.fail(entry, 500, f"worker (rank {worker.rank}) died: {reason}", E_INTERNAL)
                failed += 1
            else:
                worker.requests.discard(rid)
                entry.worker = None
                if entry.leg == "encode":  # the request has its pixels: it runs without the leg
                    self.legs.after_encode(entry, None)
                else:
                    self.router.assign(entry)
                retried += 1
        self.stats.workers_removed += 1
        self.stats.failed_worker_death += failed
        self.stats.redispatched += retried
        log.warning("worker rank %d (pid %d) removed: %s; %d request(s) failed, %d re-dispatched", worker.rank,
                    worker.pid, reason, failed, retried)
        if notify:  # if it is in fact alive, make it drop its requests and re-register
            self.reject_unknown(worker.identity)
