"""What workers send back about requests: OUTPUTS (the hot path) and per-request ERRORs.

Owns relaying delta bodies to clients untouched, marking requests started and
finished from the small OutputsHeader, and the foreign-output check: a worker's
deltas or errors reach a client only for requests dispatched to that worker, for
that client; anything else is dropped and counted (outputs_foreign_dropped).  Legs'
deltas (addressed to disagg.PD_CLIENT) go to broker/legs.py instead; an ERROR of a
leg falls back there too.

Per delta, only the request id is decoded (msgspec, in C) and checked with set
operations; the body itself is forwarded as received.  The table's containers and the
frontend socket are held directly: they are never rebound, and this saves attribute
lookups per message.
"""
from __future__ import annotations

import operator
import time

import msgspec
import zmq

from broker import disagg
from broker.legs import Legs
from broker.links import Links
from broker.requests import RequestTable
from broker.router import Router
from broker.workers import Worker
from common import framing
from common.framing import FrameError
from common.logging import RateLimitedLog
from common.protocol import BrokerStats, ErrorMsg, MsgType, OutputsHeader


class _DeltaId(msgspec.Struct, array_like=True, gc=False):
    request_id: str  # CompletionDelta's first field; the rest of each delta is skipped, not built


class _OutputsIds(msgspec.Struct, array_like=True, gc=False):
    deltas: list[_DeltaId]


# The request ids of an OUTPUTS body, to check that its sender serves them: about a
# third of decoding the body (its tokens, logprobs, ... are never materialized).
_outputs_ids = msgspec.msgpack.Decoder(_OutputsIds)
_request_id = operator.attrgetter("request_id")
_NONE: frozenset = frozenset()


class OutputsRelay:
    def __init__(self, table: RequestTable, links: Links, router: Router, legs: Legs, stats: BrokerStats,
                 bad_frame: RateLimitedLog, foreign: RateLimitedLog):
        self.table = table
        self.links = links
        self.router = router
        self.legs = legs
        self.stats = stats
        self._bad_frame = bad_frame  # shared with the loop's malformed-message warnings
        self._foreign = foreign
        self._requests = table.requests
        self._by_client = table.by_client
        self._pending = table.pending
        self._frontend = links.frontend

    def on_outputs(self, worker: Worker, rest: list) -> None:
        if len(rest) % 2 != 1:
            raise FrameError(f"OUTPUTS: expected header + identity/body pairs, got {len(rest)} frames")
        header = framing.decode(rest[0], OutputsHeader)
        requests = self._requests
        by_client = self._by_client
        for rid in header.started:
            entry = requests.get(rid)
            # A prefill leg can still be retried; another worker's request is not this one's to mark.
            if entry is not None and entry.pd_request is None and entry.worker is worker:
                entry.started = True
        msg_type = MsgType.OUTPUTS
        magic = framing.MAGIC
        send, frontend = framing.send_frames, self._frontend
        pd_client = disagg.PD_CLIENT
        for i in range(1, len(rest), 2):
            client = rest[i]
            # Every delta of the body must be of a request dispatched to this worker, for
            # the client it names: else a worker could answer other workers' users.  Set
            # comparisons (C loops): ``worker.requests`` holds exactly the ids whose entry's
            # worker it is, ``by_client`` each client's ids.
            try:
                rids = set(map(_request_id, _outputs_ids.decode(rest[i + 1]).deltas))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._bad_frame.warning("dropped a malformed OUTPUTS body from worker rank %d: %s", worker.rank, exc)
                continue
            if client == pd_client:  # legs answer the broker itself: each must still be a leg
                foreign = next((rid for rid in rids if rid not in worker.requests or
                                getattr(requests.get(rid), "pd_request", None) is None), None)
            elif rids <= worker.requests and rids <= by_client.get(client, _NONE):
                foreign = None
            else:  # one of them, for the log
                foreign = min(rids - (worker.requests & by_client.get(client, _NONE)))
            if foreign is not None:
                self.drop_foreign(worker, "outputs", foreign)
                continue
            if client == pd_client:
                self.legs.on_outputs(worker, rest[i + 1])
                continue
            try:
                send(frontend, (client, magic, msg_type, rest[i + 1]))
            except zmq.ZMQError as exc:
                if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                    raise
                self.links.client_unreachable(client, exc)
        if header.finished:
            finish = self.table.finish
            for rid in header.finished:
                entry = requests.get(rid)
                if entry is not None and entry.worker is worker:
                    finish(entry)
        if header.load is not None:
            worker.load = header.load
        if self._pending and header.finished:
            self.router.dispatch_pending()

    def on_error(self, worker: Worker, rest: list) -> None:
        """A worker's ERROR for one request (frames: the ErrorMsg, its client; counted by the loop)."""
        worker.last_seen = time.monotonic()
        err = framing.decode(rest[0], ErrorMsg)
        entry = self._requests.get(err.request_id)
        if entry is not None and entry.worker is worker and entry.leg == "encode" and not entry.orphaned:
            # The request has its pixels: it runs without the encode leg (an error of its
            # own comes back from that run).
            self.legs.after_encode(entry, None)
            if self._pending:
                self.router.dispatch_pending()
        elif entry is not None and entry.worker is worker and entry.leg == "prefill" and err.status == 503 \
                and not entry.orphaned:
            # The prefill worker holds all the KV blocks it may for remote decode
            # (--kv-transfer-max-held): the request runs whole instead of failing.
            self.legs.run_whole(entry)
            if self._pending:
                self.router.dispatch_pending()
        elif entry is not None and entry.worker is worker:
            self.table.finish(entry)
            if not entry.orphaned:
                self.links.to_client(entry.client, framing.message(MsgType.ERROR, rest[0]))
            if self._pending:
                self.router.dispatch_pending()
        else:  # another worker's request (or one no longer in flight): never reaches its client
            self.drop_foreign(worker, "an error", err.request_id)

    def drop_foreign(self, worker: Worker, what: str, request_id: str) -> None:
        self.stats.outputs_foreign_dropped += 1
        self._foreign.warning("dropped %s from worker rank %d (pid %d) for request %r, which is not dispatched to "
                              "it", what, worker.rank, worker.pid, request_id)
