"""Dispatch policy: which live worker gets a request.

Order of precedence: an explicit ``data_parallel_rank`` pin, then ``session_id``
stickiness, then least-loaded with ties rotated.  A request naming a LoRA adapter
goes to a worker that has it registered, preferring those that have it in a device
slot (no load before its first step, no eviction of another adapter) unless they are
saturated; any other worker with it registered loads it on demand.
"""
from __future__ import annotations

import hashlib
from typing import Optional, Sequence

from broker.workers import Worker


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

    def pick(self, workers: Sequence[Worker], lora_name: Optional[str] = None) -> Optional[Worker]:
        if lora_name is not None:
            # Nobody has it (a direct client naming an unknown adapter): any worker
            # answers the 404 in vLLM's words.
            workers = [w for w in workers if lora_name in w.lora_adapters] or workers
            resident = [w for w in workers if lora_name in w.load.resident_loras and not w.saturated()]
            if resident:
                workers = resident
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
