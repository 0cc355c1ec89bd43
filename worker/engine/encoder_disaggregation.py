"""Encoder disaggregation in the engine (the protocol and transport: ec_transfer.py).

Mixed into EngineCore: an encoder worker (``ec_producer``) exports the encodings its
requests use and answers with ``ec_transfer_params``; an encoder-only one
(``--mm-encoder-only``) runs nothing but the vision tower; any engine pulls the
encodings a request's ``ec_transfer_params`` announce before scheduling it.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Optional

from common.errors import BadRequest
from common.protocol import GenerateRequest
from worker.engine.config import EngineConfig
from worker.engine.ec_transfer import PARAM as EC_PARAM
from worker.engine.ec_transfer import (PRODUCER_ROLES, EcPulls, EncoderExports, RemoteEncoding, announce,
                                       remote_sources)
from worker.engine.multimodal import MAX_ENCODE_PATCHES, REMOTE
from worker.engine.outputs import SequenceOutput
from worker.engine.request import EngineSequence, FinishReason, Request

log = logging.getLogger(__name__)


class EncoderDisaggregation:
    """Mixed into EngineCore (needs config, model_config, runner, kv_transfer, scheduler,
    requests, device, _forget and _request_errors)."""

    def _init_encoder_disaggregation(self, config: EngineConfig) -> None:
        self.ec_pulls = EcPulls()
        self.encoder_only = config.mm_encoder_only
        self._to_encode: list[EngineSequence] = []  # encoder-only: admitted, not yet encoded
        self.ec_exports: Optional[EncoderExports] = None
        if config.ec_role in PRODUCER_ROLES:
            self._start_encoder_exports()

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

    def _encode_step(self) -> list[SequenceOutput]:
        """Encoder-only: encode admitted requests' images (one batched fetch of at most
        about ``MAX_ENCODE_PATCHES`` patches, which exports them) and finish those requests
        with no tokens and their announcement."""
        queue = [s for s in self._to_encode if s.request.request_id in self.requests]
        batch, patches = [], 0
        for seq in queue:
            if batch and patches >= MAX_ENCODE_PATCHES:
                break
            batch.append(seq)
            mm = seq.request.mm
            patches += sum(math.prod(int(v) for v in it.grid_thw) for it in mm.items) if mm is not None else 0
        self._to_encode = queue[len(batch):]
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
            self._forget(request)
            outs.append(SequenceOutput(request, seq.index, seq, []))
        return outs

    def _finish_encoder_pull(self, rid: str, token: int, pulled: dict, failed: dict) -> None:
        entry = self.ec_pulls.pending.get(rid)
        if entry is None or entry[3] != token:
            return  # aborted meanwhile
        del self.ec_pulls.pending[rid]
        request, seq, sources, _ = entry
        for key, error in failed.items():
            if sources[key].required:
                self._forget(request)
                self._request_errors.append((rid, error.status, error.message, EC_PARAM))
                return
            log.warning("request %s: %s; encoding its pixels here instead", rid, error.message)
        dtype = self.config.torch_dtype
        for key, emb in pulled.items():
            request.mm.embeds[key] = emb.to(device=self.device, dtype=dtype)
        self.scheduler.add(seq)

    def _announce_encodings(self, request: Request) -> None:
        """An encoder worker's request finished: where consumers read its items' outputs."""
        server = self.kv_transfer.server()
        request.ec_transfer_out = announce(request.mm.items, request.mm.wire_hashes, self.ec_exports,
                                           server.host, server.port)

    def _encoder_pulls_tick(self) -> None:
        while not self.ec_pulls.done.empty():
            self._finish_encoder_pull(*self.ec_pulls.done.get_nowait())
