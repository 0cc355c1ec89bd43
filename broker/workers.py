"""The broker's registry of workers: identity, rank, model, load, liveness."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

from broker.prefix_index import PrefixIndex
from common.protocol import DEFAULT_WEIGHT_VERSION, ModelInfo, WorkerLoad, WorkerStatus


MAX_DEPARTED_PEERS = 256  # remembered transfer servers of workers that left


@dataclass(eq=False)
class Worker:
    identity: bytes  # ZeroMQ routing id on the backend ROUTER
    rank: int
    model: ModelInfo
    load: WorkerLoad
    pid: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    sent: int = 0  # GENERATEs sent; minus load.num_received = still on the wire
    requests: set = field(default_factory=set)  # request ids assigned and not finished
    draining: bool = False  # said goodbye: finishes its requests, gets no new ones
    weight_version: str = DEFAULT_WEIGHT_VERSION
    stale: bool = False  # weights differ from the pool's version: held out of dispatch
    replaying: bool = False  # the broker is bringing it to the pool's version
    world_size: int = 1  # devices it drives (tensor-parallel size)
    # LoRA adapters registered on it (name -> path): from its READY, then each of its
    # load / unload replies.  A request naming an adapter goes only where it is.
    lora_adapters: dict = field(default_factory=dict)
    # Its prefix cache as its KV events describe it (cache-aware dispatch).
    prefix_index: PrefixIndex = field(default_factory=PrefixIndex)
    role: str = "both"  # prefill | decode | both (broker/disagg.py) | encode (pinned requests only)
    # (host, port) of its transfer server, from READY: transfer parameters may name only these.
    transfer_peer: Optional[tuple] = None

    def score(self) -> int:
        """Least-loaded dispatch score (vLLM DP balancing: waiting weighs 4x running)."""
        load = self.load
        unreported = self.sent - load.num_received
        return load.waiting * 4 + load.running + (unreported if unreported > 0 else 0)

    def saturated(self) -> bool:
        """Every sequence seat taken, or requests already queued behind them."""
        load = self.load
        return load.waiting > 0 or load.running + max(self.sent - load.num_received, 0) >= max(1, load.max_num_seqs)

    def status(self) -> WorkerStatus:
        return WorkerStatus(rank=self.rank, load=self.load, alive=True, weight_version=self.weight_version,
                            stale=self.stale, world_size=self.world_size)


class WorkerRegistry:
    def __init__(self, expiry: float, max_inflight_per_worker: int = 0, inflight_per_seq_slot: int = 4):
        # Seconds without any message before a worker whose link is still up counts as hung
        # (a dead link is libzmq's to notice: common/link_heartbeats.py).
        self.expiry = expiry
        self._by_identity: dict[bytes, Worker] = {}
        self._by_rank: dict[int, Worker] = {}
        self._max_inflight = max_inflight_per_worker
        self._per_slot = inflight_per_seq_slot
        self.last_model: Optional[ModelInfo] = None  # survives worker loss: /v1/models keeps working
        self.last_alive = time.monotonic()  # when a worker was last known alive
        self.num_prefill = 0  # registered --role prefill workers: P/D planning only runs with one
        # Transfer servers of workers that left (newest last, bounded): a client naming one
        # holds parameters this cluster handed out, so it gets a 503 (the peer is gone),
        # not the 400 for a peer nobody knows.
        self._departed_peers: OrderedDict = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_identity)

    def get(self, identity: bytes) -> Optional[Worker]:
        return self._by_identity.get(identity)

    def by_rank(self, rank: int) -> Optional[Worker]:
        return self._by_rank.get(rank)

    def all(self) -> list[Worker]:
        return list(self._by_identity.values())

    def dispatchable(self) -> list[Worker]:
        """Live workers taking new requests, in rank order (stable for tie rotation)."""
        return sorted((w for w in self._by_identity.values() if not w.draining and not w.stale),
                      key=lambda w: w.rank)

    def has_capacity(self, worker: Worker) -> bool:
        limit = self._max_inflight or self._per_slot * max(1, worker.model.max_num_seqs)
        return len(worker.requests) < limit

    def add(self, worker: Worker) -> None:
        if worker.role == "prefill" and worker.identity not in self._by_identity:
            self.num_prefill += 1
        self._by_identity[worker.identity] = worker
        self._by_rank[worker.rank] = worker
        self._departed_peers.pop(worker.transfer_peer, None)
        self.last_model = worker.model
        self.last_alive = time.monotonic()

    def remove(self, worker: Worker) -> None:
        if self._by_identity.pop(worker.identity, None) is not None and worker.role == "prefill":
            self.num_prefill -= 1
        if self._by_rank.get(worker.rank) is worker:
            del self._by_rank[worker.rank]
        if worker.transfer_peer is not None:
            self._departed_peers[worker.transfer_peer] = None
            self._departed_peers.move_to_end(worker.transfer_peer)
            while len(self._departed_peers) > MAX_DEPARTED_PEERS:
                self._departed_peers.popitem(last=False)
        self.last_alive = time.monotonic()

    def departed(self, peer: tuple) -> bool:
        """Whether ``peer`` was the transfer server of a worker that has since left."""
        return peer in self._departed_peers

    def expired(self, now: float) -> list[Worker]:
        return [w for w in self._by_identity.values() if now - w.last_seen > self.expiry]

    def no_worker_for(self, now: float) -> float:
        """Seconds without any dispatchable worker (0 while one exists, or one is being
        brought to the pool's weight version)."""
        if any(not w.draining and (not w.stale or w.replaying) for w in self._by_identity.values()):
            self.last_alive = now
            return 0.0
        return now - self.last_alive
