"""The broker-native P/D and E/P/D leg state machine (``--pd auto`` / ``--epd auto``).

Owns the transitions of a request that runs in legs: planning its first leg at
admission, starting the next once a leg's final delta comes back (prefill -> decode
with the KV transfer parameters, encode -> the request itself with the encoder
transfer parameters), and the fallbacks (an encode leg that failed or has no encoder
worker: the request encodes its own pixels; a prefill leg refused for lack of room:
the request runs whole).  broker/disagg.py holds the pure helpers that build each
leg's GenerateRequest; this module holds the state kept on the table's entries.
"""
from __future__ import annotations

from broker import disagg
from broker.requests import E_INTERNAL, Entry, RequestTable
from broker.router import Router
from broker.settings import BrokerConfig
from broker.workers import Worker, WorkerRegistry
from common import framing
from common.protocol import GenerateRequest, Outputs


class Legs:
    def __init__(self, cfg: BrokerConfig, workers: WorkerRegistry, table: RequestTable, router: Router):
        self.cfg = cfg  # reads pd, epd
        self.workers = workers
        self.table = table
        self.router = router

    def plan(self, entry: Entry, req: GenerateRequest) -> None:
        """Broker-native disaggregation: an encode leg first for an image request when
        encode workers are up (E/P/D); a prefill leg first when prefill and decode
        workers are up (P/D)."""
        if self.cfg.epd == "auto" and disagg.encode_eligible(req) and \
                any(w.role == disagg.ENCODE_ROLE for w in self.workers.dispatchable()):
            entry.pd_request, entry.leg = req, "encode"
            entry.roles = (disagg.ENCODE_ROLE,)
            entry.body = framing.encode(disagg.encode_leg(req))
            return
        self._plan_whole_or_prefill(entry, req)

    def _plan_whole_or_prefill(self, entry: Entry, req: GenerateRequest) -> None:
        entry.roles = ()
        if not self.workers.num_prefill:  # the common pool: nothing to plan
            return
        live = self.workers.dispatchable()
        roles = {w.role for w in live}
        if "prefill" not in roles:
            return
        if self.cfg.pd == "auto" and "decode" in roles and disagg.eligible(req, live[0].model.kv_block_size):
            entry.pd_request, entry.leg = req, "prefill"
            entry.roles = disagg.PREFILL_ROLES
            entry.body = framing.encode(disagg.prefill_leg(req))
        elif any(w.role != "prefill" for w in live):
            entry.roles = disagg.WHOLE_ROLES

    def after_encode(self, entry: Entry, ec_transfer_params) -> None:
        """The encode leg is over (answered, or failed: then the request encodes its own
        pixels): the request itself runs next."""
        if entry.worker is not None:
            entry.worker.requests.discard(entry.request_id)
            entry.worker = None
        req = disagg.after_encode(entry.pd_request, ec_transfer_params)
        entry.pd_request, entry.leg = None, None
        entry.body = framing.encode(req)
        self._plan_whole_or_prefill(entry, req)
        self.router.assign(entry)

    def without_encoder(self, entry: Entry) -> None:
        """The router found no encoder worker for an encode leg (the Router's encode_fallback)."""
        self.after_encode(entry, None)

    def run_whole(self, entry: Entry) -> None:
        """A prefill leg that could not run: the request itself goes to a whole/decode worker."""
        if entry.worker is not None:
            entry.worker.requests.discard(entry.request_id)
            entry.worker = None
        req = entry.pd_request
        entry.pd_request, entry.leg = None, None
        entry.body = framing.encode(req)
        entry.roles = disagg.WHOLE_ROLES
        self.router.assign(entry)

    def on_outputs(self, worker: Worker, body: bytes) -> None:
        """Deltas of legs: a finished prefill leg hands its request to a decode worker, a
        finished encode leg to a worker that pulls the encodings."""
        table = self.table
        for delta in framing.decode(body, Outputs).deltas:
            entry = table.requests.get(delta.request_id)
            if delta.finish_reason is None or entry is None or entry.pd_request is None or entry.worker is not worker:
                continue
            worker.requests.discard(entry.request_id)
            entry.worker = None
            if entry.leg == "encode" and not entry.orphaned and delta.finish_reason != "abort":
                self.after_encode(entry, delta.ec_transfer_params)
                continue
            transfer = disagg.transfer_params(delta.kv_transfer_params)
            if entry.orphaned:
                table.finish(entry)
            elif transfer is None:  # aborted, or the worker could not keep the blocks
                table.finish(entry)
                if delta.finish_reason == "abort":
                    table.answer_aborted(entry)
                else:
                    table.error(entry, entry.request_id, 500, "prefill leg returned no KV transfer parameters",
                                E_INTERNAL)
            else:
                entry.body = framing.encode(disagg.decode_leg(entry.pd_request, transfer))
                entry.pd_request, entry.leg = None, None
                entry.roles = disagg.DECODE_ROLES
                self.router.assign(entry)
