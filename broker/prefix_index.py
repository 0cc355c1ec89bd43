"""The broker's approximate picture of one worker's prefix cache, fed by its KV events.

Keys are routing keys (common/prefix_hash.py) of blocks the worker reported stored and
not yet removed.  A request's prompt keys are matched as a chain: the match length is
the number of leading blocks found, as the worker's own lookup stops at the first miss.

Dispatch also records a request's keys on the worker it chose *before* the worker has
computed them ("expected"), so that the next turns of a conversation arriving while the
first is still prefilling go to the same worker; expected keys the worker never
confirms (the request was aborted, or its blocks were evicted before the report)
expire.  Memory is bounded: a worker can hold at most its KV blocks, and the index
keeps at most ``capacity`` keys of each kind, dropping the oldest.
"""
from __future__ import annotations

import time
from typing import Iterable, Optional, Sequence

from common.protocol import KvEvents

EXPECTED_TTL_S = 30.0


class PrefixIndex:
    def __init__(self, capacity: int = 1 << 20):
        self.capacity = capacity
        self._stored: dict[bytes, None] = {}  # insertion-ordered set
        self._expected: dict[bytes, float] = {}  # key -> expiry (monotonic)

    def __len__(self) -> int:
        return len(self._stored)

    def apply(self, events: KvEvents) -> None:
        if events.cleared:
            self._stored.clear()
            self._expected.clear()
        stored, expected = self._stored, self._expected
        for key in events.removed:
            stored.pop(key, None)
        for key in events.stored:
            stored[key] = None
            expected.pop(key, None)
        self._bound(stored)

    def expect(self, keys: Sequence[bytes], now: Optional[float] = None) -> None:
        expiry = (time.monotonic() if now is None else now) + EXPECTED_TTL_S
        for key in keys:
            if key not in self._stored:
                self._expected[key] = expiry
        self._bound(self._expected)

    def match(self, keys: Sequence[bytes], now: Optional[float] = None) -> int:
        """Leading blocks of ``keys`` the worker holds (or is about to)."""
        now = time.monotonic() if now is None else now
        stored, expected = self._stored, self._expected
        n = 0
        for key in keys:
            if key in stored:
                n += 1
                continue
            expiry = expected.get(key)
            if expiry is None or expiry < now:
                break
            n += 1
        return n

    def expire(self, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        dead = [k for k, t in self._expected.items() if t < now]
        for k in dead:
            del self._expected[k]

    def _bound(self, keys: dict) -> None:
        excess = len(keys) - self.capacity
        if excess > 0:
            for k in list(_first(keys, excess)):
                del keys[k]


def _first(keys: dict, n: int) -> Iterable[bytes]:
    it = iter(keys)
    for _ in range(n):
        yield next(it)
