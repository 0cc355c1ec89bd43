"""Encoder disaggregation as an engine component (the protocol and transport: ec_transfer.py).

An encoder worker (``ec_producer``) exports the encodings its
requests use and answers with ``ec_transfer_params``; an encoder-only one
(``--mm-encoder-only``) runs nothing but the vision tower; any engine pulls the
encodings a request's ``ec_transfer_params`` announce before scheduling it.
"""
from __future__ import annotations

import logging
import math
import queue
import time
from typing import Optional

from common.errors import BadRequest
from common.protocol import GenerateRequest
from common.transfer_peers import TRUST_EC, TRUST_PEERS, UNKNOWN_PEER, check_shape, ec_peers
from worker.engine.component import EngineComponent
from worker.engine.config import EngineConfig
from worker.engine.disagg.ec_transfer import PARAM as EC_PARAM
from worker.engine.disagg.ec_transfer import (PRODUCER_ROLES, EcPulls, EncoderExports, RemoteEncoding, announce,
                                       remote_sources)
from worker.engine.multimodal.images import MAX_ENCODE_PATCHES, REMOTE
from worker.engine.records import EngineSequence, FinishReason, Request, SequenceOutput

log = logging.getLogger(__name__)

GATE = "encoder_pull"  # a request's readiness gate: the encodings it pulls are here
# An encoder-only worker's requests: its encode_step runs and finishes them, the scheduler never.
ENCODE_ONLY_GATE = "encode_only"


class EncoderDisaggregation(EngineComponent):
    """The engine's side of encoder disaggregation: the engine context (model config,
    device, queueing, failing and forgetting requests), the runner (whose encoder cache
    encodes and holds images) and the KV transfer server (exports ride on it)."""

    name = "encoder_disaggregation"

    def __init__(self, ctx, config: EngineConfig, runner, kv_transfer):
        self.ctx = ctx  # EngineContext: device, gates, fail_request, forget_request, is_live
        self.config = config
        self.model_config = ctx.model_config
        self.runner = runner
        self.kv_transfer = kv_transfer  # the transfer server exports ride on
        self.ec_pulls = EcPulls()
        self.encoder_only = config.mm_encoder_only
        self._to_encode: list[EngineSequence] = []  # encoder-only: admitted, not yet encoded
        self.ec_exports: Optional[EncoderExports] = None
        self.answers: dict[str, dict] = {}  # request id -> ec_transfer_params its final delta carries
        if config.ec_role in PRODUCER_ROLES:
            self._start_encoder_exports()

    # --- hooks ---------------------------------------------------------------------------
    def can_overlap(self, request: Request) -> bool:
        # Images run the vision tower inside the step's input preparation (and the
        # encoder cache it fills): those steps run synchronously.
        return request.mm is None

    def check(self, req: GenerateRequest, mm) -> None:
        check_shape(req.ec_transfer_params, EC_PARAM)  # bounded, plain JSON before anything reads it
        self._check_ec_params(req)
        if self.encoder_only:
            self._check_encoder_only(req, mm)
        elif mm is not None:
            self._encoder_sources(req, mm)  # BadRequest when malformed

    def admit(self, request: Request, seq: EngineSequence) -> None:
        if self.encoder_only:  # encode_step runs it (and finishes it): never scheduled
            self._to_encode.append(seq)
            self.ctx.close_gate(request, ENCODE_ONLY_GATE)
            return
        mm = request.mm
        if mm is None:
            return
        sources = self._encoder_sources(request.req, mm)
        if sources and self._pull_encodings(request, seq, sources):
            self.ctx.close_gate(request, GATE)  # opened once its encoder outputs are pulled

    def tick(self) -> None:
        while not self.ec_pulls.done.empty():
            self._finish_encoder_pull(*self.ec_pulls.done.get_nowait())

    def wait_idle(self) -> bool:
        if not self.ec_pulls.pending:
            return False
        try:
            done = self.ec_pulls.done.get(timeout=0.02)
        except queue.Empty:
            done = None
        if done is not None:
            self._finish_encoder_pull(*done)
        return True

    def on_finished(self, seq: EngineSequence) -> None:
        request = seq.request
        if self.ec_exports is not None and request.mm is not None and seq.index == 0 \
                and seq.finish_reason != FinishReason.ABORT:
            self._announce_encodings(request)

    def forget(self, request: Request) -> None:
        self.ec_pulls.pending.pop(request.request_id, None)

    def fill_deltas(self, outs, deltas) -> None:
        if self.answers:  # only an encoder worker's finished requests answer
            for out, delta in zip(outs, deltas):
                self._fill_delta(out, delta)

    def _fill_delta(self, out, delta) -> None:
        if out.index == 0 and delta.finish_reason is not None:
            answer = self.answers.pop(out.request.request_id, None)
            if answer is not None:
                delta.ec_transfer_params = answer

    def fill_load(self, load) -> None:
        cache = self.runner.encoder_cache  # the multimodal encoder cache's hit rate
        if cache is not None:
            load.mm_cache_queries, load.mm_cache_hits = cache.num_queries, cache.num_hits

    def _check_ec_params(self, req: GenerateRequest) -> None:
        """ec_transfer_params announcing producers make this worker connect to them and cache
        what they send: only with an E/P/D role (--ec-transfer-config) or on the broker's own
        legs, and only to peers the broker vouched for."""
        if not ec_peers(req.ec_transfer_params):
            return  # nothing to pull: ignored, as before
        if self.config.ec_role is None and not req.transfer_trust & TRUST_EC:
            raise BadRequest(f"{EC_PARAM}: this worker does not take part in encoder disaggregation; start it with "
                             "--ec-transfer-config '{\"ec_connector\": \"ECCPUConnector\", \"ec_role\": "
                             "\"ec_consumer\"}'", EC_PARAM)
        if not req.transfer_trust & TRUST_PEERS:
            raise BadRequest(f"{EC_PARAM}: {UNKNOWN_PEER}", EC_PARAM)

    def _start_encoder_exports(self) -> None:
        """An encoder worker (ec_producer): export every encoder output through the
        transfer server, bound now so that answers can name it."""
        cache = self.runner.encoder_cache
        if cache is None:
            raise ValueError(f"--ec-transfer-config ec_role {self.config.ec_role}: {self.model_config.architecture} "
                             "has no vision encoder to export outputs of")
        self.ec_exports = cache.exports = self.kv_transfer.encodings = EncoderExports()
        self.kv_transfer.server()

    def _encoder_sources(self, req: GenerateRequest, mm) -> dict[str, RemoteEncoding]:
        """The encodings ``req.ec_transfer_params`` announce for its items (BadRequest
        when malformed; checked at admission, before the request is registered)."""
        return remote_sources(req.ec_transfer_params, mm.items, mm.wire_hashes, self.model_config.hidden_size)

    def _pull_encodings(self, request: Request, seq: EngineSequence, sources: dict[str, RemoteEncoding]) -> bool:
        """Pull the announced encodings this engine's encoder cache lacks (True: the
        request waits for them); cached ones are held by the request meanwhile."""
        mm, cache = request.mm, self.runner.encoder_cache
        for key in [k for k in sources if k in cache]:
            mm.embeds[key] = cache.peek(key)
            del sources[key]
        if not sources:
            return False
        self.ec_pulls.start(request, seq, sources)
        return True

    def _check_encoder_only(self, req: GenerateRequest, mm) -> None:
        """What an encoder-only worker (it samples nothing) refuses."""
        why = None
        if req.params.n != 1:
            why = "n must be 1"
        elif req.params.prompt_logprobs is not None or req.params.prompt_logprob_token_ids:
            why = "prompt logprobs need the language model"
        elif req.kv_transfer_params is not None:
            why = "kv_transfer_params need the language model"
        elif mm is not None and any(it.encoding == REMOTE for it in mm.items):
            why = "it encodes images itself, so every item needs its pixels (no metadata-only items)"
        if why:
            raise BadRequest(f"this worker runs only the vision encoder (--mm-encoder-only): {why}", "mm_encoder_only")

    def encode_step(self) -> list[SequenceOutput]:
        """Encoder-only: encode admitted requests' images (one batched fetch of at most
        about ``MAX_ENCODE_PATCHES`` patches, which exports them) and finish those requests
        with no tokens and their announcement."""
        todo = [s for s in self._to_encode if self.ctx.is_live(s.request.request_id)]
        batch, patches = [], 0
        for seq in todo:
            if batch and patches >= MAX_ENCODE_PATCHES:
                break
            batch.append(seq)
            mm = seq.request.mm
            patches += sum(math.prod(int(v) for v in it.grid_thw) for it in mm.items) if mm is not None else 0
        self._to_encode = todo[len(batch):]
        if not batch:
            return []
        now = time.time()
        items = [it for s in batch if s.request.mm is not None for it in s.request.mm.items]
        if items:
            self.runner.encoder_cache.fetch(items)
        outs = []
        for seq in batch:
            request = seq.request
            request.first_scheduled_time = request.first_scheduled_time or now
            seq.finish(FinishReason.STOP)
            if request.mm is not None:
                self._announce_encodings(request)
            self.ctx.forget_request(request)
            outs.append(SequenceOutput(request, seq.index, seq, []))
        return outs

    def _finish_encoder_pull(self, rid: str, token: int, pulled: dict, failed: dict) -> None:
        entry = self.ec_pulls.pending.get(rid)
        if entry is None or entry[3] != token:
            return  # aborted meanwhile
        del self.ec_pulls.pending[rid]
        request, seq, sources, _ = entry
        for key, error in failed.items():
            if sources[key].required:  # the gate never opens
                self.ctx.fail_request(request, error.status, error.message, EC_PARAM)
                return
            log.warning("request %s: %s; encoding its pixels here instead", rid, error.message)
        dtype = self.config.torch_dtype
        for key, emb in pulled.items():
            request.mm.embeds[key] = emb.to(device=self.ctx.device, dtype=dtype)
        self.ctx.open_gate(request, GATE)

    def _announce_encodings(self, request: Request) -> None:
        """An encoder worker's request finished: where consumers read its items' outputs."""
        server = self.kv_transfer.server()
        self.answers[request.request_id] = announce(request.mm.items, request.mm.wire_hashes, self.ec_exports,
                                           server.host, server.port)


def maybe_create(config: EngineConfig, ctx, runner, transport) -> EncoderDisaggregation:
    """Always on: it checks ec_transfer_params (and pulls what they announce); an
    encoder-only engine's step is its ``encode_step``."""
    return EncoderDisaggregation(ctx, config, runner, transport)
