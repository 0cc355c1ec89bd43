"""Dispatch policy: which live worker gets a request.

Order of precedence: an explicit ``data_parallel_rank`` pin, then ``session_id``
stickiness, then the routing policy (``--routing``): ``cache-aware`` (default) sends a
request to the worker already holding the longest prefix of its prompt (from the
workers' KV events, broker/prefix_index.py) among those not loaded much beyond the
least-loaded one, else least-loaded; ``session`` and ``least-loaded`` ignore caches
(``least-loaded`` ignores sessions too).  A request naming a LoRA adapter
goes to a worker that has it registered, preferring those that have it in a device
slot (no load before its first step, no eviction of another adapter) unless they are
saturated; any other worker with it registered loads it on demand.
"""
from __future__ import annotations

import hashlib
from typing import Optional, Sequence

from broker.workers import Worker

ROUTING_POLICIES = ("cache-aware", "session", "least-loaded")


def sticky_worker(session_id: str, workers: Sequence[Worker]) -> Optional[Worker]:
    """Rendezvous (highest-random-weight) hashing over the live ranks.

    A session maps to the same worker as long as that worker lives, and only the
    sessions of a departed worker move when the set changes.
    """
    best, best_weight = None, b""
    key = session_id.encode()
    for w in workers:
        weight = hashlib.blake2b(key + b"|%d" % w.rank, digest_size=8).digest()
        if best is None or weight > best_weight:
            best, best_weight = w, weight
    return best


class LeastLoaded:
    """Lowest ``Worker.score()`` among those with capacity; equal scores rotate."""

    def __init__(self) -> None:
        self._next = 0

    def pick(self, workers: Sequence[Worker], lora_name: Optional[str] = None,
             prefix_hashes: Optional[Sequence[bytes]] = None) -> Optional[Worker]:
        workers = self._for_adapter(workers, lora_name)
        return self._least_loaded(workers)

    @staticmethod
    def _for_adapter(workers: Sequence[Worker], lora_name: Optional[str]) -> Sequence[Worker]:
        if lora_name is not None:
            # Nobody has it (a direct client naming an unknown adapter): any worker
            # answers the 404 in vLLM's words.
            workers = [w for w in workers if lora_name in w.lora_adapters] or workers
            resident = [w for w in workers if lora_name in w.load.resident_loras and not w.saturated()]
            if resident:
                workers = resident
        return workers

    def _least_loaded(self, workers: Sequence[Worker]) -> Optional[Worker]:
        n = len(workers)
        if not n:
            return None
        start = self._next % n
        best, best_score, best_i = None, None, 0
        for k in range(n):
            i = (start + k) % n
            score = workers[i].score()
            if best_score is None or score < best_score:
                best, best_score, best_i = workers[i], score, i
        self._next = best_i + 1
        return best


class CacheAware(LeastLoaded):
    """The longest cached prompt prefix wins among workers within the load guard.

    The guard keeps a hot prefix from piling every request onto the one worker that
    holds it (SGLang's cache-aware "death spiral"): a worker whose load score exceeds
    ``balance_rel`` x the least loaded one's plus ``balance_abs`` is not preferred for
    its cache, so load spills to the others, which then cache the prefix as well.
    """

    def __init__(self, balance_rel: float = 1.5, balance_abs: int = 4):
        super().__init__()
        self.balance_rel = balance_rel
        self.balance_abs = balance_abs
        self.prefix_routed = 0  # dispatches decided by a cached prefix

    def pick(self, workers: Sequence[Worker], lora_name: Optional[str] = None,
             prefix_hashes: Optional[Sequence[bytes]] = None) -> Optional[Worker]:
        workers = self._for_adapter(workers, lora_name)
        if not prefix_hashes or len(workers) < 2:
            return self._least_loaded(workers)
        scores = [w.score() for w in workers]
        limit = min(scores) * self.balance_rel + self.balance_abs
        best, best_match, best_score = None, 0, 0
        for w, score in zip(workers, scores):
            if score > limit:  # a short queue behind a long cached prefix still beats recomputing it
                continue
            matched = w.prefix_index.match(prefix_hashes)
            if matched > best_match or (matched == best_match and best is not None and score < best_score):
                best, best_match, best_score = w, matched, score
        if best is None or best_match == 0:
            return self._least_loaded(workers)
        self.prefix_routed += 1
        return best


def make_policy(name: str) -> LeastLoaded:
    if name not in ROUTING_POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(ROUTING_POLICIES)}")
    return CacheAware() if name == "cache-aware" else LeastLoaded()
