"""Engine-core outputs -> the wire's ``CompletionDelta`` (the layer above the core).

Besides a choice's new tokens, text and logprobs, the first delta of a request
carries what belongs to the request once: its prompt logprobs, prompt token-id
scores (one float32 block) and kv_transfer_params.
"""
from __future__ import annotations

import io
from typing import Optional

import numpy as np

from common.protocol import CompletionDelta
from worker.engine.sample.logprobs import extend_token_logprobs
from worker.engine.records import FinishReason, SequenceOutput


def to_delta(out: SequenceOutput) -> CompletionDelta:
    request, seq = out.request, out.seq
    if seq is None:  # aborted before this choice was forked
        return CompletionDelta(request_id=request.request_id, index=out.index, finish_reason=FinishReason.ABORT,
                               num_prompt_tokens=request.num_prompt_tokens,
                               num_cached_tokens=request.num_cached_tokens,
                               first_scheduled_time=request.first_scheduled_time)
    delta = CompletionDelta(
        request_id=request.request_id,
        index=seq.index,
        token_ids=out.new_token_ids,
        logprobs=seq.pending_logprobs,
        text=(out.text or "") if request.req.output_text else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        first_scheduled_time=request.first_scheduled_time,
        first_token_time=request.first_token_time,
    )
    seq.pending_logprobs = None
    if not request.first_delta_sent and seq.index == 0:
        request.first_delta_sent = True
        # Echoed (P/D legs answer with their own instead: the KV transfer component's fill_deltas).
        delta.kv_transfer_params = request.req.kv_transfer_params
        delta.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
        if request.prompt_token_id_rows:
            scores = _stack_padded(request.prompt_token_id_rows)
            delta.prompt_token_id_scores = scores.tobytes()
            delta.prompt_token_id_shape = list(scores.shape)
            request.prompt_token_id_rows = []
    return delta


def merge_delta(acc: Optional[CompletionDelta], d: CompletionDelta) -> CompletionDelta:
    """Fold a later delta of the same choice into ``acc`` (used by ``generate``)."""
    if acc is None:
        return CompletionDelta(**{f: getattr(d, f) for f in d.__struct_fields__})
    acc.token_ids = acc.token_ids + d.token_ids
    if d.logprobs is not None:
        acc.logprobs = extend_token_logprobs(acc.logprobs, d.logprobs)
    if d.text is not None:
        acc.text = (acc.text or "") + d.text
    acc.finish_reason = d.finish_reason
    acc.stop_reason = d.stop_reason
    acc.num_cached_tokens = d.num_cached_tokens
    acc.weight_versions = d.weight_versions
    if d.sampling_mask is not None:
        acc.sampling_mask = (acc.sampling_mask or []) + d.sampling_mask
    if d.routed_experts is not None:
        acc.routed_experts = d.routed_experts
    if d.spec_decode is not None:
        acc.spec_decode = d.spec_decode
    if d.kv_transfer_params is not None:
        acc.kv_transfer_params = d.kv_transfer_params
    for f in ("prompt_logprobs", "prompt_token_id_scores", "prompt_token_id_shape",
              "first_scheduled_time", "first_token_time"):
        if getattr(acc, f) is None:
            setattr(acc, f, getattr(d, f))
    return acc


def npy_bytes(array: Optional[np.ndarray]) -> Optional[bytes]:
    """The ``.npy`` serialisation vLLM base64-encodes into ``routed_experts``."""
    if array is None:
        return None
    with io.BytesIO() as buf:
        np.save(buf, array, allow_pickle=False)
        return buf.getvalue()


def _stack_padded(parts: list[np.ndarray]) -> np.ndarray:
    """Concatenate per-chunk score rows, padding narrower chunks with -inf."""
    width = max(p.shape[1] for p in parts)
    out = np.full((sum(p.shape[0] for p in parts), width), -np.inf, dtype=np.float32)
    r = 0
    for p in parts:
        out[r:r + p.shape[0], :p.shape[1]] = p
        r += p.shape[0]
    return out
