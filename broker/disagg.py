"""Broker-native prefill/decode disaggregation (``--pd auto``) and encoder disaggregation
(``--epd auto``).

With workers registered as ``--role prefill`` and ``--role decode``, the broker runs an
ordinary generate request as vLLM's disaggregated proxy would, with no proxy: a
prefill leg (``max_tokens`` 1, ``kv_transfer_params.do_remote_decode``) on a prefill
worker, whose final delta carries the transfer parameters (NixlConnector's shape), then
the request itself on a decode worker with those parameters, which pulls the prompt's
KV blocks instead of recomputing them.  Both legs are picked by the dispatch policy
(cache-aware: the prefill leg where the prompt's prefix is cached).

The request keeps one broker entry across both legs: its prefill leg is sent with
``PD_CLIENT`` as the reply identity, so that leg's deltas come back here (never to the
client) and finishing it starts the decode leg instead of finishing the request.

Encoder disaggregation is the same shape: with ``--mm-encoder-only`` workers registered
(role ``encode``), an image request first runs as an encode leg there, whose final delta
carries ec_transfer_params (worker/engine/disagg/ec_transfer.py); the request then runs whole on
another worker with them, which pulls the images' encodings instead of running the vision
tower.  The request keeps its pixels, so it still runs (encoding them itself) if the
encode leg fails.
"""
from __future__ import annotations

from typing import Optional

import msgspec

from common.protocol import GenerateRequest
from common.transfer_peers import TRUST_EC, TRUST_KV, TRUST_PEERS

PD_CLIENT = b"\x00tokserve-broker-pd"  # reply identity of prefill legs: their deltas stay in the broker
PD_MODES = ("off", "auto")
EPD_MODES = ("off", "auto")
PREFILL_ROLES = ("prefill",)
DECODE_ROLES = ("decode",)
WHOLE_ROLES = ("both", "decode")  # requests served in one piece never go to prefill-only workers
ENCODE_ROLE = "encode"  # --mm-encoder-only workers (encoder disaggregation): pinned requests only

# vLLM's proxy asks the prefill instance for this (NixlConnector).
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def eligible(req: GenerateRequest, block_size: int) -> bool:
    """Requests the broker splits: no explicit transfer, pin, adapter or image, and a prompt
    with at least one full block to move; prompt scores need the whole prefill on one worker."""
    p = req.params
    return (req.kv_transfer_params is None and req.data_parallel_rank is None and req.lora_name is None
            and not req.mm_items and p.prompt_logprobs is None and not p.prompt_logprob_token_ids
            and len(req.prompt_token_ids) > block_size)


def prefill_leg(req: GenerateRequest) -> GenerateRequest:
    params = msgspec.structs.replace(req.params, n=1, max_tokens=1, max_tokens_is_default=False, min_tokens=0,
                                     logprobs=None, stop=[], include_stop_str_in_output=False)
    # TRUST_KV: the broker's own leg, served by any worker (client parameters need a P/D role there).
    return msgspec.structs.replace(req, params=params, output_text=False, kv_transfer_params=dict(PREFILL_PARAMS),
                                   transfer_trust=req.transfer_trust | TRUST_KV)


def decode_leg(req: GenerateRequest, transfer: dict) -> GenerateRequest:
    # The peer is the prefill worker's own answer (this broker's registered worker).
    return msgspec.structs.replace(req, kv_transfer_params=transfer,
                                   transfer_trust=req.transfer_trust | TRUST_KV | TRUST_PEERS)


def encode_eligible(req: GenerateRequest) -> bool:
    """Image requests the broker runs an encode leg for: every item has its pixels (an
    encoder worker encodes them) and the client sent no encoder transfer of its own."""
    return bool(req.mm_items) and req.ec_transfer_params is None and req.data_parallel_rank is None \
        and all(it.encoding != "remote" for it in req.mm_items)


def encode_leg(req: GenerateRequest) -> GenerateRequest:
    """What an encoder-only worker serves: the prompt and its images, nothing to sample."""
    params = msgspec.structs.replace(req.params, n=1, max_tokens=1, max_tokens_is_default=False, min_tokens=0,
                                     logprobs=None, prompt_logprobs=None, prompt_logprob_token_ids=None, stop=[],
                                     include_stop_str_in_output=False)
    return msgspec.structs.replace(req, params=params, output_text=False, kv_transfer_params=None,
                                   ec_transfer_params=None, lora_name=None, transfer_trust=0)


def after_encode(req: GenerateRequest, ec_transfer_params: Optional[dict]) -> GenerateRequest:
    """The request with the encode leg's answer (unchanged without one: it encodes itself)."""
    if isinstance(ec_transfer_params, dict) and ec_transfer_params:
        # The encoder worker's own answer: its peers are its transfer server.
        return msgspec.structs.replace(req, ec_transfer_params=ec_transfer_params,
                                       transfer_trust=req.transfer_trust | TRUST_EC | TRUST_PEERS)
    return req


def transfer_params(kv_transfer_params: Optional[dict]) -> Optional[dict]:
    """The prefill leg's answer, if it is one the decode leg can use."""
    if isinstance(kv_transfer_params, dict) and kv_transfer_params.get("do_remote_prefill") and \
            kv_transfer_params.get("remote_block_ids") is not None:
        return kv_transfer_params
    return None
