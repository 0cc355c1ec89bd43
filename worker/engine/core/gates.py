"""Readiness gates: what a request still waits for before it may be scheduled (issue 41).

A component that must finish something before a request's first step -- pull its
prompt's KV blocks (``kv_pull``), pull its images' encodings (``encoder_pull``),
compile its grammar (``grammar``) -- closes a named gate for it at admission and opens
it when done; the core queues the request for the scheduler once every gate is open.
Features so never coordinate with each other (no hook order, no "held" flag, no taking
a request back out of the queue): each waits for its own gate only, and the request
starts when the last one opens, whichever that is.

The set lives in the core; this class is only its bookkeeping (no engine state)."""
from __future__ import annotations


class Gates:
    """Per request id, the names of its gates still closed (absent: none)."""

    def __init__(self) -> None:
        self._closed: dict[str, set[str]] = {}

    def close(self, request_id: str, name: str) -> None:
        self._closed.setdefault(request_id, set()).add(name)

    def open(self, request_id: str, name: str) -> bool:
        """Open one gate; True when it was the request's last closed one (it may start)."""
        closed = self._closed.get(request_id)
        if closed is None or name not in closed:
            return False  # never closed, or opened already: nothing changes
        closed.discard(name)
        if closed:
            return False
        del self._closed[request_id]
        return True

    def closed(self, request_id: str) -> frozenset[str]:
        return frozenset(self._closed.get(request_id, ()))

    def drop(self, request_id: str) -> None:
        """The request is gone: its gates with it."""
        self._closed.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._closed

    def __len__(self) -> int:
        return len(self._closed)
