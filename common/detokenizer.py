"""Incremental detokenization and stop-string detection for one choice.

Decoding follows the prefix_offset / read_offset scheme of TGI and vLLM's
``detokenize_incrementally``: the text of the new tokens is
``decode(ids[prefix:]) - decode(ids[prefix:read])``, decoded together with a few
previous tokens so that tokenizers which drop or add leading spaces depending on
context (SentencePiece) produce the same text as a full decode.  While the decoded
window ends in U+FFFD (a multi-byte UTF-8 character split across tokens) nothing
is emitted; the bytes stay in the window until the character completes.

Stop strings follow vLLM v1 (``BaseIncrementalDetokenizer.update`` /
``check_stop_strings``): the accumulated output text is searched only where new
characters could complete a match, so a stop string split over several tokens is
found; the text is cut at the stop string (or after it with
include_stop_str_in_output) and, while streaming, the last ``max(len(stop)) - 1``
characters are held back so a partial stop string is never emitted.

The tokenizer is duck-typed: ``decode(ids, skip_special_tokens=...)`` and, for
special-token handling, ``all_special_ids`` and ``convert_ids_to_tokens`` (the
engine's tokenizer wrapper), or a raw ``tokenizers.Tokenizer``.
"""
from __future__ import annotations

import sys
from bisect import bisect_left
from typing import Any, Optional, Sequence

from common.protocol import SamplingParams, TokenLogprobs

# Prompt tokens decoded together with the first output tokens (vLLM uses 5).
INITIAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT = "\ufffd"
_METASPACE = "\u2581"  # SentencePiece's space marker, stripped by decode() of one token
_MAX_UTF8_CONTEXT = 4  # preceding tokens that can hold the rest of one UTF-8 character


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    ids = getattr(tokenizer, "all_special_ids", None)
    if ids is None and hasattr(tokenizer, "get_added_tokens_decoder"):
        ids = [i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special]
    return frozenset(ids or ())


def ids_to_tokens(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Raw vocabulary pieces ('' for unknown ids)."""
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        toks = tokenizer.convert_ids_to_tokens(list(ids))
    else:
        toks = [tokenizer.id_to_token(i) for i in ids]
    return [t or "" for t in toks]


def decode_token_texts(tokenizer: Any, ids: Sequence[int],
                       context_token_ids: Sequence[int] = ()) -> list[str]:
    """Each id decoded on its own, as vLLM reports logprob tokens
    (``convert_ids_list_to_tokens`` + ``_verify_tokens``): ``decode([id])``, with
    the leading spaces that SentencePiece's decode strips restored from the raw
    piece.  ``ids`` are alternatives at one position; ``context_token_ids`` the
    tokens before it: a text ending in U+FFFD (the id completes a multi-byte
    character begun by earlier tokens) is re-decoded with that context."""
    ids = list(ids)
    if not ids:
        return []
    texts = [tokenizer.decode([i], skip_special_tokens=False) or "" for i in ids]
    raws = ids_to_tokens(tokenizer, ids)
    for j, (raw, text) in enumerate(zip(raws, texts)):
        markers = len(raw) - len(raw.lstrip(_METASPACE))
        if markers:
            missing = markers - (len(text) - len(text.lstrip(" ")))
            if missing > 0:
                texts[j] = " " * missing + text
    context = list(context_token_ids)[-_MAX_UTF8_CONTEXT:]
    for j, text in enumerate(texts):
        if text.endswith(_REPLACEMENT):
            texts[j] = _complete_with_context(tokenizer, ids[j], context)
    return texts


def _complete_with_context(tokenizer: Any, token_id: int, context: list[int]) -> str:
    """vLLM ``_correct_decoded_token``: the text this token completes together with
    the shortest tail of ``context`` that makes a whole character; the context
    tokens that were incomplete on their own are attributed to this token.  ""
    when the character is still incomplete."""
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    for n in range(1, len(context) + 1):
        ctx = context[-n:]
        full = decode(ctx + [token_id])
        if full.endswith(_REPLACEMENT):
            continue
        clean_end = len(ctx)
        while clean_end > 0 and decode([ctx[clean_end - 1]]).endswith(_REPLACEMENT):
            clean_end -= 1
        prefix = decode(ctx[:clean_end]) if clean_end else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        common = 0
        for a, b in zip(prefix, full):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""


def token_text_bytes(text: str) -> list[int]:
    """UTF-8 bytes of a logprob entry's token string (vLLM: errors='replace')."""
    return list(text.encode("utf-8", errors="replace"))


def attach_token_texts(logprobs: TokenLogprobs, tokenizer: Any,
                       context_token_ids: Sequence[int] = ()) -> TokenLogprobs:
    """Fill ``token_texts`` / ``top_texts`` for text-mode responses.  Position i is
    decoded with the chosen tokens before it (``context_token_ids``, then
    ``logprobs.token_ids[:i]``) as context for characters split over tokens."""
    context = list(context_token_ids)[-_MAX_UTF8_CONTEXT:]
    token_texts: list[str] = []
    top_texts: list[list[str]] = []
    for i, tid in enumerate(logprobs.token_ids):
        token_texts.extend(decode_token_texts(tokenizer, [tid], context))
        top_texts.append(decode_token_texts(tokenizer, logprobs.top_ids[i], context))
        context = (context + [tid])[-_MAX_UTF8_CONTEXT:]
    logprobs.token_texts = token_texts
    logprobs.top_texts = top_texts
    return logprobs


def needs_detokenizer(params: SamplingParams, output_text: bool) -> bool:
    """Text mode, or stop strings (which stop generation in tokens mode too)."""
    return params.detokenize and (output_text or bool(params.stop))


class IncrementalDetokenizer:
    """Detokenizes one choice's output as tokens arrive and watches its stop strings."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = [s for s in (params.stop or []) if s]
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.stop_buffer_length = (max(len(s) for s in self.stop) - 1
                                   if self.stop and not self.include_stop_str_in_output else 0)
        # Consecutive special tokens are joined without spaces only when they are
        # rendered at all and the client asked for it.
        self._join_specials = not (params.skip_special_tokens
                                   or params.spaces_between_special_tokens)
        self._special_ids = special_token_ids(tokenizer) if self._join_specials else frozenset()
        self._last_special = False

        tail = list(prompt_token_ids[-(INITIAL_DETOKENIZATION_OFFSET + 1):])
        self._window: list[int] = tail  # ids from prefix_offset on
        self._prefix_offset = 0
        self._read_offset = len(tail)
        # Decode the prompt tail with the window from offset 1 so the window
        # starts where vLLM's prefix offset would (read - 5).
        if len(tail) > INITIAL_DETOKENIZATION_OFFSET:
            self._prefix_offset = len(tail) - INITIAL_DETOKENIZATION_OFFSET
        self._prefix_text = self._decode(self._window[self._prefix_offset:self._read_offset])

        self.output_token_ids: list[int] = []
        self.output_text = ""
        self._emitted = 0  # characters of output_text already returned
        self.dropped_token_count = 0  # tokens cut by the last update (after a stop string)
        self.finished = False

    # -- decoding -------------------------------------------------------------------------

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def _decode_next(self, token_id: int) -> str:
        self._window.append(token_id)
        if self._join_specials:
            is_special = token_id in self._special_ids
            if is_special and self._last_special:
                # Back-to-back specials: the raw piece, no separating space.
                self._last_special = True
                text = ids_to_tokens(self.tokenizer, [token_id])[0]
                self._advance()
                return text
            self._last_special = is_special
        full = self._decode(self._window[self._prefix_offset:])
        if len(full) > len(self._prefix_text) and not full.endswith(_REPLACEMENT):
            text = full[len(self._prefix_text):]
            self._advance()
            return text
        return ""

    def _advance(self) -> None:
        """The window up to now is emitted: the old read offset becomes the prefix."""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._window)
        if self._prefix_offset:
            del self._window[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self._prefix_text = self._decode(self._window[:self._read_offset])

    # -- resumable window (the gateway's stateless streaming derender carries it) ----------

    def window(self) -> tuple[list[int], int, int]:
        """(ids from the prefix offset on, prefix offset, read offset): all later decoding reads."""
        return list(self._window), self._prefix_offset, self._read_offset

    def restore_window(self, ids: Sequence[int], prefix_offset: int, read_offset: int) -> None:
        self._window = list(ids)
        self._prefix_offset = prefix_offset
        self._read_offset = read_offset
        self._prefix_text = self._decode(self._window[prefix_offset:read_offset])

    # -- public API -----------------------------------------------------------------------

    def update(self, new_token_ids: Sequence[int], *, stop_terminated: bool = False,
               finished: bool = False) -> tuple[str, Optional[str]]:
        """Feed this step's new tokens; return (text to emit now, matched stop string).

        ``stop_terminated``: the last new token is an EOS / stop token id; its text
        is left out unless include_stop_str_in_output (vLLM).  ``finished``: the
        request ends this step for another reason (length, stop token, abort), so
        the text held back for stop strings is released (an unfinished character
        never is: vLLM's DecodeStream does not emit it).  A matched stop string finishes the choice
        as well; tokens after the one completing it are removed from
        ``output_token_ids`` (``dropped_token_count`` says how many).
        """
        if self.finished:
            return "", None
        new_token_ids = list(new_token_ids)
        self.dropped_token_count = 0
        skipped_stop_id = None
        if stop_terminated and new_token_ids and not self.include_stop_str_in_output:
            skipped_stop_id = new_token_ids.pop()

        num_prev = len(self.output_token_ids)
        first_new = num_prev
        offsets = [len(self.output_text)]
        for tid in new_token_ids:
            self.output_token_ids.append(tid)
            self.output_text += self._decode_next(tid)
            offsets.append(len(self.output_text))
        if skipped_stop_id is not None:
            self.output_token_ids.append(skipped_stop_id)
            offsets.append(len(self.output_text))

        stop_str = None
        if self.stop and len(self.output_token_ids) > self.min_tokens:
            check_from = offsets[max(self.min_tokens - num_prev, 0)]
            match = find_stop_string(self.output_text, len(self.output_text) - check_from,
                                     self.stop, self.include_stop_str_in_output)
            if match is not None:
                stop_str, truncate_to = match
                stop_end = len(self.output_text) if truncate_to == -1 else truncate_to
                if not self.include_stop_str_in_output:
                    stop_end += len(stop_str)
                kept = bisect_left(offsets, stop_end, lo=1)
                total = len(self.output_token_ids)
                del self.output_token_ids[first_new + kept:]
                self.dropped_token_count = total - len(self.output_token_ids)
                if truncate_to != -1:
                    self.output_text = self.output_text[:truncate_to]
        if stop_str is not None or finished or stop_terminated:
            self.finished = True
        return self._next_text(), stop_str

    def _next_text(self) -> str:
        hold = 0 if self.finished else self.stop_buffer_length
        end = len(self.output_text) - hold
        if end <= self._emitted:
            return ""
        text = self.output_text[self._emitted:end]
        self._emitted = end
        return text

    def release_held(self) -> str:
        """End the choice without a final token (abort): release the text held back for
        stop-string matching; bytes of an unfinished character stay unsent (vLLM)."""
        self.finished = True
        return self._next_text()

    def flush(self) -> str:
        """Release held-back text when the choice ends without a final update.  Like
        vLLM (tokenizers' DecodeStream), a character still incomplete is never emitted."""
        return self.release_held()


def find_stop_string(output_text: str, new_char_count: int, stop: Sequence[str],
                     include_in_output: bool) -> Optional[tuple[str, int]]:
    """vLLM ``check_stop_strings``: the stop string completing earliest in the last
    ``new_char_count`` characters (ties: list order).  Returns (stop string, length
    to truncate the text to, or -1 for no truncation) or None."""
    if not new_char_count or not stop:
        return None
    best: Optional[str] = None
    best_index = 0
    best_end = sys.maxsize
    for s in stop:
        index = output_text.find(s, max(0, len(output_text) + 1 - new_char_count - len(s)))
        if index == -1:
            continue
        end = index + len(s)
        if end < best_end:
            best, best_index, best_end = s, index, end
    if best is None:
        return None
    if include_in_output:
        return (best, -1) if best_end >= len(output_text) else (best, best_end)
    return best, best_index
