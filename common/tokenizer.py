"""HF fast-tokenizer files (tokenizer.json + tokenizer_config.json) read with the
``tokenizers`` library only.  ``load_tokenizer`` returns None when the model has
no tokenizer.json, which is the tokens-only serving mode."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterable, Optional, Sequence

from tokenizers import Tokenizer as _HFTokenizer

log = logging.getLogger(__name__)

# Texts / id lists longer than this are (de)tokenized with the GIL released (see encode).
_LONG = 4096
# Texts longer than this are encoded a piece this long at a time (Tokenizer._encode_in_chunks),
# each cut checked on a window this wide either side, trying this many cuts per piece.
_CHUNK = 64 * 1024
_CUT_WINDOW = 256
_CUT_TRIES = 16

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _token_content(value) -> Optional[str]:
    """tokenizer_config stores special tokens as a string or as an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return value.get("content")
    return None


class Tokenizer:
    """The subset of ``PreTrainedTokenizerFast`` the worker needs."""

    def __init__(self, tokenizer: _HFTokenizer, config: Optional[dict] = None,
                 eos_token_ids: Sequence[int] = ()):
        self._tok = tokenizer
        config = config or {}
        specials: dict[str, int] = {}
        for key in _SPECIAL_KEYS:
            content = _token_content(config.get(key))
            if content is not None:
                tid = tokenizer.token_to_id(content)
                if tid is not None:
                    specials[key] = tid
        for content in config.get("additional_special_tokens") or []:
            content = _token_content(content)
            if content is not None and tokenizer.token_to_id(content) is not None:
                specials.setdefault(content, tokenizer.token_to_id(content))
        ids = set(specials.values())
        for tid, added in tokenizer.get_added_tokens_decoder().items():
            if added.special:
                ids.add(tid)
        for tid, entry in (config.get("added_tokens_decoder") or {}).items():
            if isinstance(entry, dict) and entry.get("special"):
                ids.add(int(tid))
        self.all_special_ids: list[int] = sorted(ids)
        self.bos_token_id: Optional[int] = specials.get("bos_token")
        # tokenizer_config's eos_token, else the model config's first eos id.
        self.eos_token_id: Optional[int] = specials.get("eos_token", eos_token_ids[0] if eos_token_ids else None)
        self.pad_token_id: Optional[int] = specials.get("pad_token")
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self._affixes: Optional[tuple] = None  # _special_affixes' probe, done once
        # vLLM's max_chars_per_token: the longest vocabulary string.  A text longer than
        # max_model_len x this cannot fit (the cheap bound checked before tokenizing).
        self.max_chars_per_token: int = max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)

    @classmethod
    def from_file(cls, tokenizer_json: str | Path, config: Optional[dict] = None,
                  eos_token_ids: Sequence[int] = ()) -> "Tokenizer":
        return cls(_HFTokenizer.from_file(str(tokenizer_json)), config, eos_token_ids)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) > _CHUNK:
            ids = self._encode_in_chunks(text, add_special_tokens)
            if ids is not None:
                return ids
        if len(text) > _LONG:
            # tokenizers' encode() holds the GIL throughout (a 7 MB prompt: seconds in which
            # no other thread, the gateway's event loop included, ran); encode_batch() lets
            # it go while it works and gives the same ids.
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def _encode_in_chunks(self, text: str, add_special_tokens: bool) -> Optional[list[int]]:
        """``encode`` of a long text a piece at a time, or None where that cannot be shown
        to give the same ids.  The tokenizers library keeps ~280 bytes per character while
        it encodes (offsets, alignments, token strings): one 7 MB /tokenize peaked at 2 GB;
        in 64 KiB pieces only the ids accumulate.

        A piece ends just before a space that follows a non-space and precedes a non-space:
        the byte-level / GPT-style pre-tokenizers always split there (a word takes at most
        one leading space), so merges never cross it.  Each cut is also checked on a
        window around it (the window encoded whole equals its two halves encoded apart),
        which refuses the cut where the tokenizer does something else there (a
        metaspace prefix added to each piece, an added token across the cut)."""
        prefix, suffix = self._special_affixes(add_special_tokens)
        if prefix is None:
            return None
        encode = self._tok.encode_batch_fast if hasattr(self._tok, "encode_batch_fast") else self._tok.encode_batch
        ids = list(prefix)
        start, n = 0, len(text)
        while n - start > _CHUNK:
            cut = self._find_cut(text, start + _CHUNK, encode)
            if cut is None:
                return None  # no provable cut: the caller encodes the text whole
            ids.extend(encode([text[start:cut]], add_special_tokens=False)[0].ids)
            start = cut
        ids.extend(encode([text[start:]], add_special_tokens=False)[0].ids)
        ids.extend(suffix)
        return ids

    def _find_cut(self, text: str, at: int, encode) -> Optional[int]:
        end = min(len(text) - 1, at + _CHUNK // 2)
        pos, tries = at, 0
        while tries < _CUT_TRIES:
            pos = text.find(" ", pos, end)
            if pos < 0:
                return None
            if not text[pos - 1].isspace() and not text[pos + 1].isspace():
                tries += 1
                lo, hi = max(0, pos - _CUT_WINDOW), min(len(text), pos + _CUT_WINDOW)
                whole, left, right = encode([text[lo:hi], text[lo:pos], text[pos:hi]], add_special_tokens=False)
                if whole.ids == left.ids + right.ids:
                    return pos
            pos += 1
        return None

    def _special_affixes(self, add_special_tokens: bool) -> tuple[Optional[list[int]], list[int]]:
        """The ids the post-processor puts before and after a text (BOS / EOS), found by
        encoding one probe character with and without them; (None, []) where the
        tokenizer pads or truncates (a whole-text operation) or the probe is not found."""
        if self._tok.truncation is not None or self._tok.padding is not None:
            return None, []
        if not add_special_tokens:
            return [], []
        if self._affixes is None:
            found: tuple = (None, [])
            core = self._tok.encode("a", add_special_tokens=False).ids
            full = self._tok.encode("a", add_special_tokens=True).ids
            spots = [i for i in range(len(full) - len(core) + 1) if full[i:i + len(core)] == core]
            if core and len(spots) == 1:
                found = (full[:spots[0]], full[spots[0] + len(core):])
            self._affixes = found
        return self._affixes

    def encode_with_offsets(self, text: str, add_special_tokens: bool = False) -> tuple[list[int], list[list[int]]]:
        """The ids and each token's ``[start, end)`` character span in ``text``: the fast
        tokenizer's ``offset_mapping`` (``(0, 0)`` for the special tokens
        ``add_special_tokens`` adds), as vLLM's ``return_token_offsets`` takes it."""
        if len(text) > _LONG:  # as encode
            enc = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        else:
            enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return enc.ids, [[int(s), int(e)] for s, e in enc.offsets]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if len(ids) > _LONG:
            return self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]  # as encode
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[Optional[str]]:
        """Raw vocabulary strings (byte-level symbols for BPE); None for unknown ids."""
        id_to_token = self._tok.id_to_token
        return [id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        """Raw vocabulary string -> id, added tokens included (HF's ``get_vocab``)."""
        return self._tok.get_vocab(with_added_tokens=True)

    def backend_json(self) -> str:
        """The tokenizer.json text (its model, pre-tokenizer and decoder describe how the
        vocabulary's strings map to bytes: what a grammar compiler needs)."""
        return self._tok.to_str()


def load_tokenizer(model_dir: str | Path, eos_token_ids: Sequence[int] = ()) -> Optional[Tokenizer]:
    """Tokenizer of ``model_dir``, or None when it ships no tokenizer.json."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        log.info("no tokenizer.json in %s: serving tokens only", model_dir)
        return None
    config: dict = {}
    cfg_path = model_dir / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None
    try:
        return Tokenizer.from_file(path, config, eos_token_ids)
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise ValueError(f"cannot load {path}: {e}") from None
