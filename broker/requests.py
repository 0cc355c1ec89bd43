"""The broker's request table: every request from GENERATE until its last choice finishes.

Owns the entries (by request id and by client), the pending queue with its count,
finishing (the one place an entry leaves every index), aborting (by a client, by the
RL route, or because its client vanished), and the errors sent to clients.  Routing
and legs change an entry's worker / body; only this table adds and removes entries.

The containers (``requests``, ``by_client``, ``pending``) are created once and never
rebound: the OUTPUTS hot path (broker/outputs.py) keeps direct references to them.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Optional

from broker.links import Links
from broker.workers import Worker
from common import framing
from common.protocol import Abort, CompletionDelta, ErrorMsg, GenerateRequest, MsgType, Outputs

E_OVERLOADED = "ServiceUnavailableError"
E_INTERNAL = "InternalServerError"


@dataclass(eq=False)
class Entry:
    """One request the broker knows about, from GENERATE until its last choice finishes."""

    request_id: str
    client: bytes
    body: bytes  # the GenerateRequest as received: re-sent untouched on redispatch
    n: int
    rank: Optional[int]
    session_id: Optional[str]
    lora_name: Optional[str] = None  # adapter-aware dispatch prefers workers holding it
    prefix_hashes: Optional[list] = None  # routing keys of the prompt's blocks (cache-aware dispatch)
    roles: tuple = ()  # worker roles that may serve it (empty: any)
    pd_request: Optional[GenerateRequest] = None  # broker-native P/D / E/P/D: the request, while a leg runs
    leg: Optional[str] = None  # that leg: "prefill" | "encode" (broker/disagg.py)
    worker: Optional[Worker] = None  # None while pending
    started: bool = False  # a delta reached the client: cannot be retried elsewhere
    orphaned: bool = False  # client vanished; abort already sent
    queued: bool = False  # waiting in the pending deque
    done: bool = False  # removed (lets the pending deque skip it lazily)


class RequestTable:
    def __init__(self, links: Links):
        self.links = links
        self.requests: dict[str, Entry] = {}
        self.by_client: dict[bytes, set] = collections.defaultdict(set)
        self.pending: collections.deque[Entry] = collections.deque()
        self.pending_count = 0  # entries queued and not done (the deque also holds done ones, skipped lazily)

    def add(self, entry: Entry) -> None:
        self.requests[entry.request_id] = entry
        self.by_client[entry.client].add(entry.request_id)

    def finish(self, entry: Entry) -> None:
        if entry.done:
            return
        entry.done = True
        self.requests.pop(entry.request_id, None)
        rids = self.by_client.get(entry.client)
        if rids is not None:
            rids.discard(entry.request_id)
            if not rids:
                del self.by_client[entry.client]
        if entry.worker is not None:
            entry.worker.requests.discard(entry.request_id)
        if entry.queued:
            entry.queued = False
            self.pending_count -= 1

    # ------------------------------------------------------------ to clients
    def error(self, entry_or_client, request_id: str, status: int, message: str, type_: str,
              param: Optional[str] = None) -> None:
        client = entry_or_client.client if isinstance(entry_or_client, Entry) else entry_or_client
        err = ErrorMsg(request_id=request_id, status=status, message=message, type=type_, param=param)
        self.links.to_client(client, framing.message(MsgType.ERROR, err))

    def fail(self, entry: Entry, status: int, message: str, type_: str, param: Optional[str] = None) -> None:
        """Finish ``entry`` and tell its client why."""
        self.finish(entry)
        self.error(entry, entry.request_id, status, message, type_, param)

    def answer_aborted(self, entry: Entry) -> None:
        """A final "abort" delta per choice, as a worker would have sent (the broker answers
        for a request no worker holds)."""
        deltas = [CompletionDelta(request_id=entry.request_id, index=i, finish_reason="abort", weight_versions=[])
                  for i in range(entry.n)]
        self.links.to_client(entry.client, framing.message(MsgType.OUTPUTS, Outputs(deltas)))

    # ------------------------------------------------------------ aborting
    def on_abort(self, client: bytes, request_ids: list[str]) -> None:
        entries = [self.requests.get(rid) for rid in request_ids]
        # Unknown, finished or another client's: aborting is idempotent.
        self.abort_entries([e for e in entries if e is not None and e.client == client])

    def abort_everywhere(self, request_ids: Optional[list[str]]) -> int:
        """The RL route's abort: the given requests, or every request, of every client."""
        if request_ids is None:
            entries = [e for e in self.requests.values() if not e.orphaned]
        else:
            entries = [e for e in map(self.requests.get, request_ids) if e is not None and not e.orphaned]
        self.abort_entries(entries)
        return len(entries)

    def abort_entries(self, entries: list[Entry]) -> None:
        per_worker: dict[Worker, list[str]] = {}
        for entry in entries:
            if entry.worker is None:  # still queued here: answer for the worker
                self.finish(entry)
                self.answer_aborted(entry)
            else:
                per_worker.setdefault(entry.worker, []).append(entry.request_id)
        self._abort_on_workers(per_worker)

    def client_gone(self, client: bytes) -> None:
        per_worker: dict[Worker, list[str]] = {}
        for rid in list(self.by_client.get(client, ())):
            entry = self.requests[rid]
            if entry.worker is None:
                self.finish(entry)
            elif not entry.orphaned:
                entry.orphaned = True
                per_worker.setdefault(entry.worker, []).append(rid)
        self._abort_on_workers(per_worker)

    def _abort_on_workers(self, per_worker: dict) -> None:
        for worker, rids in per_worker.items():
            self.links.to_worker(worker, framing.message(MsgType.ABORT, Abort(rids)))
