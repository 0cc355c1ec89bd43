"""Admitting a client's GENERATE: from the frame to an entry in the table, routed.

Owns what the broker checks before a request exists: it decodes (a well-framed
request with a bad field gets a 400, not a hang), its id is not already in flight,
and its transfer parameters name only this cluster's workers (the transfer-peer
check, common/transfer_peers.py), and no user pause in abort / wait mode holds (a
retryable 503, vLLM 0.33's paused-engine rejection; broker/control.py).  It then
builds the Entry with the routing keys the policy uses, plans legs (broker/legs.py),
adds it to the table and assigns it.
"""
from __future__ import annotations

import msgspec

from broker.control import PAUSED_MESSAGE
from broker.legs import Legs
from broker.requests import E_OVERLOADED, Entry, RequestTable
from broker.router import Router
from broker.settings import BrokerConfig
from broker.workers import WorkerRegistry
from common import framing
from common.errors import BadRequest
from common.framing import FrameError
from common.protocol import GenerateRequest
from common.transfer_peers import (EC_PARAM, GONE_PEER, KV_PARAM, TRUST_PEERS, UNKNOWN_PEER, check_shape, ec_peers,
                                   kv_peer)


class Admission:
    def __init__(self, cfg: BrokerConfig, workers: WorkerRegistry, table: RequestTable, legs: Legs, router: Router):
        self.cfg = cfg  # reads routing
        self.workers = workers
        self.table = table
        self.legs = legs
        self.router = router

    def on_generate(self, client: bytes, body: bytes) -> None:
        table = self.table
        try:
            req = framing.decode(body, GenerateRequest)
        except FrameError as exc:
            rid = framing.request_id_of(body)
            if rid is not None:  # well framed, a field of the wrong type: a 400, not a hang
                table.error(client, rid, 400, f"malformed GENERATE request: {exc}", "BadRequestError")
            raise  # logged as a dropped malformed message
        rid = req.request_id
        if rid in table.requests:
            table.error(client, rid, 400, f"request_id {rid!r} is already in flight", "BadRequestError",
                        "request_id")
            return
        vetted = self._vet_transfer(client, req, body)
        if vetted is None:
            return
        req, body = vetted
        if self.router.control.rejecting:  # after validation, as vLLM's engine rejects once the API server took it
            table.error(client, rid, 503, PAUSED_MESSAGE, E_OVERLOADED)
            return
        session = req.session_id if self.cfg.routing != "least-loaded" else None
        entry = Entry(rid, client, body, max(1, req.params.n), req.data_parallel_rank, session, req.lora_name,
                      prefix_hashes=req.prefix_hashes if self.cfg.routing == "cache-aware" else None)
        if req.data_parallel_rank is None:
            self.legs.plan(entry, req)
        table.add(entry)
        self.router.assign(entry)

    def _vet_transfer(self, client: bytes, req: GenerateRequest, body: bytes):
        """A client's transfer parameters (common/transfer_peers.py): bounded JSON naming
        only registered workers' transfer servers, or a 400 before anything is dispatched
        (naming no host or port: no port-scan oracle); a 503 for the server of a worker that
        has left, whose parameters this cluster handed out (a race with its death).  Returns (request, body) with
        ``transfer_trust`` as this broker vouches for it: a client's own value is never
        kept, so only the broker's legs carry TRUST_KV / TRUST_EC."""
        try:
            check_shape(req.kv_transfer_params, KV_PARAM)
            check_shape(req.ec_transfer_params, EC_PARAM)
            peers = [(KV_PARAM, p) for p in [kv_peer(req.kv_transfer_params)] if p is not None]
            peers += [(EC_PARAM, p) for p in ec_peers(req.ec_transfer_params)]
            if peers:
                known = {w.transfer_peer for w in self.workers.all() if w.transfer_peer is not None}
                for param, peer in peers:
                    if peer in known:
                        continue
                    if self.workers.departed(peer):  # handed out by this cluster, then its worker left
                        self.table.error(client, req.request_id, 503, f"{param}: {GONE_PEER}", E_OVERLOADED, param)
                        return None
                    raise BadRequest(f"{param}: {UNKNOWN_PEER}", param)
        except BadRequest as exc:
            self.table.error(client, req.request_id, 400, exc.message, "BadRequestError", exc.param)
            return None
        trust = TRUST_PEERS if peers else 0
        if trust != req.transfer_trust:
            req = msgspec.structs.replace(req, transfer_trust=trust)
            body = framing.encode(req)
        return req, body
