"""KV transfer (prefill/decode disaggregation, NixlConnector-style) as an engine component.

The transport -- the transfer server that serves held blocks, the pulls, the held-block
bookkeeping -- is ``disagg/kv_transfer.py``'s ``KvTransfer`` (shared with encoder
disaggregation, whose exports ride the same server).  This component is the engine
side: which requests are legs, what a prefill leg holds for its decode side when it
finishes (and answers with), starting a decode leg only once its prompt blocks are
pulled, and releasing held blocks that were freed or expired."""
from __future__ import annotations

import logging
import queue
import secrets
import time
from typing import Any, Optional

import torch

from common.errors import BadRequest, Overloaded
from common.transfer_peers import KV_PARAM, TRUST_KV, TRUST_PEERS, UNKNOWN_PEER, check_shape
from worker.engine.component import EngineComponent
from worker.engine.disagg.kv_transfer import (ENABLE_HINT, DecodeLeg, KvTransfer, PrefillLeg, TransferError,
                                       blocks_from_reply, parse_params)
from worker.engine.records import FinishReason

log = logging.getLogger(__name__)

GATE = "kv_pull"  # a decode leg's readiness gate: its prompt's KV blocks are here


class KvTransferComponent(EngineComponent):
    name = "kv_transfer"

    def __init__(self, ctx, transport: KvTransfer):
        self.ctx = ctx  # EngineContext: config, block_manager, kv_cache, gates, fail_request
        self.transport = transport
        self.legs: dict[str, Any] = {}  # request id -> PrefillLeg / DecodeLeg, while the request lives
        self.answers: dict[str, dict] = {}  # request id -> a finished prefill leg's kv_transfer_params
        # Legs forgotten since the last step: their deltas of this step are still to be packed.
        self._closing: dict[str, Optional[dict]] = {}

    # --- admission ---------------------------------------------------------------------
    # Both legs overlap under async scheduling (no can_overlap hook): a prefill leg hands
    # its *full* prompt blocks to the transfer server when it finishes, and a step still in
    # flight then writes only positions past the prompt (its sampled token's), never those
    # blocks; a decode leg's pull fills its blocks behind the kv_pull gate, before its
    # first step is planned.

    def check(self, req, mm) -> None:
        """Requests whose KV blocks move between workers: what this engine refuses."""
        check_shape(req.kv_transfer_params, KV_PARAM)  # bounded, plain JSON before anything reads it
        leg = parse_params(req.kv_transfer_params)
        if leg is None:
            return
        config = self.ctx.config
        if not config.kv_transfer_enabled and not req.transfer_trust & TRUST_KV:
            # vLLM honours kv_transfer_params only with a KV connector configured.
            raise BadRequest(f"{KV_PARAM}: this worker does not take part in KV transfer (prefill/decode "
                             f"disaggregation); {ENABLE_HINT}", KV_PARAM)
        if isinstance(leg, DecodeLeg) and not req.transfer_trust & TRUST_PEERS:
            raise BadRequest(f"{KV_PARAM}: {UNKNOWN_PEER}", KV_PARAM)
        if config.tensor_parallel_size > 1:
            raise BadRequest("kv_transfer_params: KV transfer is not supported with tensor parallelism "
                             f"(this worker has tensor_parallel_size {config.tensor_parallel_size})",
                             "kv_transfer_params")
        if req.lora_name is not None:
            raise BadRequest("kv_transfer_params: KV transfer is not supported for LoRA requests",
                             "kv_transfer_params")
        if req.params.n != 1 and isinstance(leg, PrefillLeg):  # a decode leg's choices fork after the pull
            raise BadRequest("kv_transfer_params: a prefill leg (do_remote_decode) needs n=1", "kv_transfer_params")
        if not config.enable_prefix_caching:
            raise BadRequest("kv_transfer_params: KV transfer needs prefix caching (this worker runs with "
                             "--no-prefix-caching)", "kv_transfer_params")
        if isinstance(leg, PrefillLeg):
            kv, need = self.transport, self._prefill_leg_blocks(req)
            if kv.committed_blocks() + need > kv.max_held_blocks:
                # Held blocks are pinned until their decode side pulls them (or the timeout):
                # past the cap they would starve ordinary requests of the KV cache.
                raise Overloaded(f"{KV_PARAM}: too many KV blocks are held for remote decode on this worker "
                                 f"({kv.committed_blocks()} held or reserved, this prompt needs {need}, the cap is "
                                 f"{kv.max_held_blocks}: --kv-transfer-max-held); retry later", KV_PARAM)

    def _prefill_leg_blocks(self, req) -> int:
        """The full prompt blocks a prefill leg keeps for its decode side."""
        return len(req.prompt_token_ids) // self.ctx.block_manager.block_size

    def admit(self, request, seq) -> None:
        leg = parse_params(request.req.kv_transfer_params)
        if leg is None:
            return
        rid = request.request_id
        self.legs[rid] = leg
        if isinstance(leg, DecodeLeg):  # its first step waits for its prompt blocks
            self.ctx.close_gate(request, GATE)
            self.transport.start_pull(request, seq, leg)
            return
        self.transport.reserved[rid] = self._prefill_leg_blocks(request.req)
        self.transport.server()  # bound before the answer names its host and port

    # --- every step ----------------------------------------------------------------------
    def tick(self) -> None:
        """Release blocks the decode side freed or that waited past the timeout; start the
        decode legs whose pull finished."""
        self._closing.clear()  # the last step's deltas are packed
        kv, bm = self.transport, self.ctx.block_manager
        while True:
            try:
                rid = kv.held.freed.get_nowait()
            except queue.Empty:
                break
            blocks = kv.held.take(rid)
            if blocks:
                bm.release_blocks(blocks)
        if len(kv.held):
            for rid, blocks in kv.held.take_expired(time.monotonic()):
                log.info("KV transfer of %s expired: releasing %d block(s)", rid, len(blocks))
                bm.release_blocks(blocks)
        while not kv.pulled.empty():
            self._finish_pull(*kv.pulled.get_nowait())

    def wait_idle(self) -> bool:
        """Nothing to schedule: with pulls in flight, wait for one a little instead of spinning."""
        if not self.transport.pending:
            return False
        try:
            done = self.transport.pulled.get(timeout=0.02)
        except queue.Empty:
            done = None
        if done is not None:
            self._finish_pull(*done)
        return True

    def on_stalled(self) -> bool:
        """Requests wait but none can start: blocks held for remote decode come back (FREE or
        the timeout), so wait a little for a FREE (False: nothing is held, a bug)."""
        kv, bm = self.transport, self.ctx.block_manager
        if not kv.held.num_blocks:
            return False
        try:  # expiry is checked every step
            rid = kv.held.freed.get(timeout=0.05)
        except queue.Empty:
            return True
        blocks = kv.held.take(rid)
        if blocks:
            bm.release_blocks(blocks)
        return True

    def _finish_pull(self, rid: str, token: int, result, error) -> None:
        entry = self.transport.pending.get(rid)
        if entry is None or entry[3] != token:
            return  # aborted meanwhile (the pull FREEd the remote blocks already)
        del self.transport.pending[rid]
        request, seq, leg, _ = entry
        if error is None:
            try:
                self._import_pulled(seq, leg, *result)
            except TransferError as exc:
                error = exc
        if error is not None:  # the gate never opens
            self.ctx.fail_request(request, error.status, error.message, "kv_transfer_params")
            return
        self.ctx.open_gate(request, GATE)

    def _import_pulled(self, seq, leg: DecodeLeg, header: dict, raw) -> None:
        """The pulled prompt blocks become this engine's cached blocks (keyed by the
        prompt's block hashes): the prefix-cache lookup then serves them."""
        kv_cache = self.ctx.kv_cache()
        if kv_cache is None:
            raise TransferError(503, "kv_transfer_params: the KV cache is released (sleeping)")
        data = blocks_from_reply(header, raw, kv_cache, len(leg.block_ids))
        bm = self.ctx.block_manager
        if seq.request.wants_prompt_scores:
            return  # prompt scores read nothing from the cache: recompute
        taken = bm.import_blocks(seq, len(leg.block_ids))
        if not taken:
            return
        src = torch.tensor([i for i, _ in taken], dtype=torch.long)
        dst = torch.tensor([b for _, b in taken], dtype=torch.long, device=kv_cache.device)
        kv_cache.index_copy_(2, dst, data.index_select(2, src).to(kv_cache.device))
        bm.release_blocks([b for _, b in taken])

    # --- a request's end ---------------------------------------------------------------
    def on_finished(self, seq) -> None:
        if seq.index == 0 and seq.finish_reason != FinishReason.ABORT:
            if isinstance(self.legs.get(seq.request.request_id), PrefillLeg):
                self._hold_for_transfer(seq)

    def _hold_for_transfer(self, seq) -> None:
        """A prefill leg finished: keep its full prompt blocks for the decode side and
        answer with NixlConnector's kv_transfer_params."""
        request, kv = seq.request, self.transport
        bm = self.ctx.block_manager
        num_full = min(seq.num_prompt_tokens, seq.num_computed_tokens) // bm.block_size
        blocks = list(seq.block_ids[:num_full])
        kv.reserved.pop(request.request_id, None)  # the reservation becomes the held blocks
        # The transfer's name on the transfer server: the request id (clients may choose
        # those) plus a secret, so only whoever got this answer can PULL or FREE the blocks.
        handle = f"{request.request_id}.{secrets.token_hex(16)}"
        if blocks:
            bm.hold_blocks(blocks)
            old = kv.held.hold(handle, blocks, kv.timeout)
            if old:
                bm.release_blocks(old)
        server = kv.server()
        self.answers[request.request_id] = {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [blocks], "remote_engine_id": kv.engine_id,
            "remote_request_id": handle,
            "remote_host": server.host, "remote_port": server.port,
            "tp_size": 1, "dcp_size": 1, "pp_size": 1,
            "remote_num_tokens": seq.num_computed_tokens,
            "remote_blocks_expiry_time": None, "transfer_mode": "pull",
        }

    def forget(self, request) -> None:
        rid = request.request_id
        self.transport.pending.pop(rid, None)
        self.transport.reserved.pop(rid, None)
        if self.legs.pop(rid, None) is not None:
            self._closing[rid] = self.answers.pop(rid, None)

    def fill_deltas(self, outs, deltas) -> None:
        if self.legs or self._closing:  # only P/D legs answer differently
            for out, delta in zip(outs, deltas):
                self._fill_delta(out, delta)

    def _fill_delta(self, out, delta) -> None:
        """P/D legs answer with their own params (a prefill leg's on its final delta; a
        decode leg's none, as vLLM) instead of echoing the request's."""
        rid = out.request.request_id
        if rid in self._closing:
            answer = self._closing[rid]
        elif rid in self.legs:
            answer = self.answers.get(rid)
        else:
            return
        delta.kv_transfer_params = None
        if out.index == 0 and delta.finish_reason is not None:
            delta.kv_transfer_params = answer

    def close(self) -> None:
        self.transport.close()


def maybe_create(config, ctx, transport: KvTransfer) -> KvTransferComponent:
    """Always on: its checks refuse transfer parameters this worker cannot serve."""
    transport.max_held_blocks = int(config.kv_transfer_max_held * ctx.block_manager.num_blocks)
    if config.kv_transfer_enabled:
        transport.server()  # bound now: READY announces it (the broker admits only known peers)
    return KvTransferComponent(ctx, transport)
