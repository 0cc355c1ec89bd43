"""Token ids -> text in the gateway, for derender: the same incremental detokenizer the
workers run (common/detokenizer.py), seeded with the prompt tail, and the logprob
token strings vLLM's derender fills in (``_resolve_logprobs``).

The streaming derender carries the decoder's window in vLLM's ``DerenderStreamState``
fields: ``prev_tokens`` (vocabulary pieces of the window), ``prefix_offset`` and
``read_offset``.  Pieces map back to ids through the vocabulary, so the state stays
plain JSON and bounded by the window.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from common.detokenizer import IncrementalDetokenizer, decode_token_texts, ids_to_tokens
from common.errors import BadRequest
from common.protocol import SamplingParams
from common.tokenizer import Tokenizer
from gateway.generate_api.protocol import TextLogprob, TextLogprobContent
from gateway.generate_api.logprobs_format import clamp

LOGPROB_CONTEXT = 4  # preceding sampled ids that can hold the rest of a UTF-8 character


class ChoiceDecoder:
    """Decodes one choice's output tokens; ``stop_terminated`` drops the final EOS /
    stop token's text as the engine does (it is not part of the output text)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Optional[Sequence[int]],
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        params = SamplingParams(skip_special_tokens=skip_special_tokens,
                                spaces_between_special_tokens=spaces_between_special_tokens)
        self.detok = IncrementalDetokenizer(tokenizer, list(prompt_token_ids or []), params)

    def feed(self, token_ids: Sequence[int], *, stop_terminated: bool = False) -> str:
        text, _ = self.detok.update(token_ids, stop_terminated=stop_terminated)
        self.detok.finished = False  # no stop strings here: the next chunk continues the same window
        return text

    # -- the stream state's window ----------------------------------------------------
    def window_state(self) -> tuple[list[str], int, int]:
        ids, prefix, read = self.detok.window()
        return ids_to_tokens(self.tokenizer, ids), prefix, read

    def restore_window(self, pieces: list[str], prefix_offset: int, read_offset: int) -> None:
        ids = []
        for piece in pieces:
            tid = self.tokenizer.token_to_id(piece)
            if tid is None:
                raise BadRequest("invalid stream_state: prev_tokens holds a piece that is not in the vocabulary",
                                 "stream_state")
            ids.append(tid)
        if not prefix_offset <= read_offset <= len(ids):
            raise BadRequest("invalid stream_state: offsets outside prev_tokens", "stream_state")
        self.detok.restore_window(ids, prefix_offset, read_offset)


def ends_on_stop_token(finish_reason: Optional[str], stop_reason: Any) -> bool:
    """The last output token is EOS or a stop token id (finish "stop" without a stop string)."""
    return finish_reason == "stop" and not isinstance(stop_reason, str)


def resolve_token_logprobs(content: list[dict], tokenizer: Tokenizer,
                           context: Sequence[int] = ()) -> list[TextLogprobContent]:
    """Generate's tokens-mode logprob entries -> OpenAI chat entries with token text and bytes."""
    out = []
    ctx = list(context)[-LOGPROB_CONTEXT:]
    for entry in content:
        tid = entry["token_id"]
        tops = entry.get("top_logprobs") or []
        texts = decode_token_texts(tokenizer, [tid] + [t["token_id"] for t in tops], ctx)
        top_entries = [TextLogprob(token=txt, logprob=clamp(t["logprob"]), bytes=list(txt.encode("utf-8")))
                       for t, txt in zip(tops, texts[1:])]
        out.append(TextLogprobContent(token=texts[0], logprob=clamp(entry["logprob"]),
                                      bytes=list(texts[0].encode("utf-8")), top_logprobs=top_entries))
        ctx = (ctx + [tid])[-LOGPROB_CONTEXT:]
    return out


def logprob_context_tail(context: Sequence[int], new_ids: Sequence[int]) -> list[int]:
    return (list(context) + list(new_ids))[-LOGPROB_CONTEXT:]
