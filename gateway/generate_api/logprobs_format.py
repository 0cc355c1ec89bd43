"""Column-wise ``TokenLogprobs`` from the worker -> vLLM's JSON logprob shapes.

vLLM builds, for each position, an ordered dict {sampled token, top-1, top-2, ...}
(the sampled token first, duplicates collapsing), then keeps the first ``max(k, 1)``
entries (all of them for k = -1).  Logprobs are clamped: NaN and values below -9999
become -9999.0 so the JSON stays valid; rank 0 (no rank) is sent as null.
"""
from __future__ import annotations

import base64
import io
import math
from typing import Optional

import numpy as np

from common.protocol import CompletionDelta, TokenLogprobs
from gateway.generate_api.protocol import (
    PromptLogprob,
    TextLogprob,
    TextLogprobContent,
    TokenLogprob,
    TokenLogprobContent,
)


def clamp(logprob: float) -> float:
    return -9999.0 if math.isnan(logprob) else max(logprob, -9999.0)


def _candidates(lp: TokenLogprobs, i: int) -> list[tuple[int, float, int, Optional[str]]]:
    """Ordered (token_id, logprob, rank, text) for position i: sampled first, then top-k."""
    texts = lp.token_texts
    top_texts = lp.top_texts[i] if lp.top_texts is not None else None
    first = lp.token_ids[i]
    out = [(first, lp.logprobs[i], lp.ranks[i], texts[i] if texts is not None else None)]
    seen = {first}
    for j, (tid, tlp) in enumerate(zip(lp.top_ids[i], lp.top_logprobs[i])):
        if tid in seen:
            continue
        seen.add(tid)
        out.append((tid, tlp, j + 1, top_texts[j] if top_texts is not None else None))
    return out


def _keep(num: Optional[int], total: int) -> int:
    if num is None:
        return 0
    return total if num == -1 else min(total, max(num, 1))


def token_logprobs(lp: TokenLogprobs, num: Optional[int]) -> list[TokenLogprobContent]:
    """Tokens mode: ``{"token_id","logprob","rank","top_logprobs":[...]}`` per sampled token."""
    content = []
    for i, token_id in enumerate(lp.token_ids):
        cands = _candidates(lp, i)
        content.append(TokenLogprobContent(
            token_id=token_id,
            logprob=clamp(lp.logprobs[i]),
            rank=lp.ranks[i] or None,
            top_logprobs=[TokenLogprob(t, clamp(l), r or None) for t, l, r, _ in cands[:_keep(num, len(cands))]],
        ))
    return content


def _text_entry(token_id: int, text: Optional[str]) -> tuple[str, Optional[list[int]]]:
    if text is None:  # worker sent no decoded string: vLLM's placeholder, no bytes
        return f"token_id:{token_id}", None
    return text, list(text.encode("utf-8", errors="replace"))


def token_id_placeholder(token_id: int) -> str:
    """vLLM's ``format_token_id_placeholder`` (``return_tokens_as_token_ids``)."""
    return f"token_id:{token_id}"


def _id_entry(token_id: int) -> tuple[str, list[int]]:
    token = token_id_placeholder(token_id)
    return token, list(token.encode("utf-8"))


def text_logprobs(lp: TokenLogprobs, num: Optional[int], as_token_ids: bool = False,
                  placeholders_only: bool = False) -> list[TextLogprobContent]:
    """Text mode: ``{"token","logprob","bytes","top_logprobs":[...]}`` per sampled token.

    ``as_token_ids`` (the request's ``return_tokens_as_token_ids``): every token string is
    ``token_id:N``, as vLLM's ``_create_chat_logprobs`` writes them; the sampled token's
    ``bytes`` stay those of its decoded text (vLLM encodes ``step_token.decoded_token``),
    the top entries' are those of the ``token_id:N`` string.  ``placeholders_only``
    (/inference/v1/generate under --return-tokens-as-token-ids): ``token_id:N`` everywhere,
    no bytes, as vLLM's generate writes them without a tokenizer."""
    content = []
    for i, token_id in enumerate(lp.token_ids):
        cands = _candidates(lp, i)
        if placeholders_only:
            tops = [TextLogprob(token=token_id_placeholder(t), logprob=clamp(l), bytes=None)
                    for t, l, _, _ in cands[:_keep(num, len(cands))]]
            content.append(TextLogprobContent(token=token_id_placeholder(token_id), logprob=clamp(lp.logprobs[i]),
                                              bytes=None, top_logprobs=tops))
            continue
        token, raw = _text_entry(token_id, cands[0][3])
        if as_token_ids:
            token = token_id_placeholder(token_id)
        tops = []
        for t, l, _, txt in cands[:_keep(num, len(cands))]:
            s, b = _id_entry(t) if as_token_ids else _text_entry(t, txt)
            tops.append(TextLogprob(token=s, logprob=clamp(l), bytes=b))
        content.append(TextLogprobContent(token=token, logprob=clamp(lp.logprobs[i]), bytes=raw, top_logprobs=tops))
    return content


def prompt_logprobs(lp: Optional[TokenLogprobs], num: Optional[int]) -> Optional[list]:
    """``[null, {token_id: {logprob, rank, decoded_token}}, ...]``; position 0 has no logprob."""
    if lp is None:
        return None
    out: list = [None]
    for i in range(len(lp.token_ids)):
        cands = _candidates(lp, i)
        # The prompt token is always kept; the top-k follow (k = num, -1 = all).
        keep = len(cands) if num == -1 else 1 + (num or 0)
        out.append({t: PromptLogprob(clamp(l), r or None, txt) for t, l, r, txt in cands[:keep]})
    return out


def prompt_token_id_logprobs(scores: Optional[bytes], shape: Optional[list[int]]) -> Optional[str]:
    """Base64 of a float32 ``.npy`` array [rows, ids] (vLLM's numpy2base64), -inf padding kept."""
    if scores is None or shape is None:
        return None
    array = np.frombuffer(scores, dtype=np.float32).reshape(shape)
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getvalue()).decode("ascii")


def chat_logprobs(delta: CompletionDelta, top_logprobs: Optional[int], as_token_ids: bool = False) -> Optional[list]:
    """Chat entries: the k most likely (the sampled token first, as vLLM orders them)."""
    if top_logprobs is None or delta.logprobs is None:
        return None
    entries = text_logprobs(delta.logprobs, top_logprobs, as_token_ids)
    if top_logprobs != -1:
        for e in entries:
            e.top_logprobs = e.top_logprobs[:top_logprobs]
    return entries
