"""Does a structured-outputs constraint convert to a grammar?  vLLM's ``validate_xgrammar_grammar``
(v1/structured_output/backend_xgrammar.py) with its messages, run before admission so that a bad
schema, regex or grammar is a 400 at the gateway instead of a failure inside every worker.

Only the grammar-level conversion runs here (``xgr.Grammar.from_*``: parsing, no tokenizer),
which is cheap -- the tokenizer-level compile is the workers' -- but still proportional to the
spec, so callers run it on the render pool; results (accepted, or the refusal's message) are
kept in a bounded LRU keyed by a digest of the constraint, so a warm spec costs one lookup.

``backend: auto`` is xgrammar here with no fallback: a schema using features xgrammar does not
support (vLLM's ``has_xgrammar_unsupported_json_features``; common/structured_outputs_spec.py)
is refused, where vLLM's auto mode would hand it to guidance or outlines.  Where vLLM's message gives no reason (grammars, structural
tags) the compiler's reason is appended after vLLM's sentence; xgrammar's log prefix (time,
C++ source location) is dropped from the reasons.
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from typing import Any, Optional

import msgspec

from common.errors import BadRequest
from common.protocol import StructuredOutputs
from common.structured_outputs_spec import (MAX_JSON_NESTING, STRUCTURAL_TAG_WRAPPER_NESTING, choice_as_grammar,
                                            exceeds_json_nesting, grammar_is_likely_lark, unsupported_json_feature)

_PARAM = "structured_outputs"


class GrammarError(ValueError):
    """The constraint does not convert; its message is the client's."""


_XGRAMMAR_LOCATION = re.compile(r"^\[\d{2}:\d{2}:\d{2}\] \S+:\d+: ")


MAX_REASON_CHARS = 1000  # a compiler message may quote the spec: the cache keeps at most this much


def _reason(err: Exception) -> str:
    """xgrammar's message without its log prefix (time of day, C++ source location): the
    same constraint gives the same message, and the cache holds it."""
    reason = _XGRAMMAR_LOCATION.sub("", str(err)).strip()
    return reason if len(reason) <= MAX_REASON_CHARS else reason[:MAX_REASON_CHARS] + "..."


def check_json_nesting(spec: Any, *, structural_tag: bool = False) -> None:
    limit = MAX_JSON_NESTING + (STRUCTURAL_TAG_WRAPPER_NESTING if structural_tag else 0)
    if spec and exceeds_json_nesting(spec, limit):
        raise GrammarError("The JSON schema is nested too deeply: objects and arrays may nest at most "
                           f"{MAX_JSON_NESTING} levels")


def convert(so: StructuredOutputs) -> None:
    """Raise GrammarError unless the constraint converts (vLLM's validate_xgrammar_grammar)."""
    import xgrammar as xgr

    if so.regex is not None:
        try:
            xgr.Grammar.from_regex(so.regex)
        except Exception as err:
            raise GrammarError(f"Failed to transform regex into a grammar: {_reason(err)}") from None
        return
    if so.choice:
        try:
            xgr.Grammar.from_ebnf(choice_as_grammar(so.choice))
        except Exception as err:
            raise GrammarError(f"Failed to transform choices into a grammar: {_reason(err)}") from None
        return
    if so.json is not None:
        check_json_nesting(so.json)
        try:
            schema = json.loads(so.json)
        except (ValueError, RecursionError):
            raise GrammarError("Invalid JSON grammar specification.") from None
        if unsupported_json_feature(schema) is not None:
            raise GrammarError("The provided JSON schema contains features not supported by xgrammar.")
        try:
            xgr.Grammar.from_json_schema(so.json)
        except Exception as err:
            raise GrammarError(f"Failed to transform json schema into a grammar: {_reason(err)}") from None
        return
    if so.json_object:
        return
    if so.grammar:
        try:
            if grammar_is_likely_lark(so.grammar):
                xgr.Grammar.from_lark(so.grammar)
            else:
                xgr.Grammar.from_ebnf(so.grammar)
        except Exception as err:
            raise GrammarError(f"Invalid grammar specification. {_reason(err)}") from None
        return
    if so.structural_tag:
        check_json_nesting(so.structural_tag, structural_tag=True)
        try:
            convert_structural_tag(so.structural_tag)
        except Exception as err:
            raise GrammarError(f"Invalid structural tag specification. {_reason(err)}") from None
        return
    raise GrammarError("XGrammar structured outputs backend does not support this structured outputs specification")


def convert_structural_tag(payload: str) -> None:
    """A structural tag: vLLM's legacy ``{"structures", "triggers"}`` shape or xgrammar's format."""
    import xgrammar as xgr

    tag = json.loads(payload)
    if isinstance(tag, dict) and "structures" in tag:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        xgr.Grammar.from_structural_tag(items, tag["triggers"])
    else:
        xgr.Grammar.from_structural_tag(payload)


_key_encoder = msgspec.msgpack.Encoder()


def _digest(so: StructuredOutputs) -> bytes:
    """The constraint's identity (the whitespace options do not change whether it converts)."""
    key = _key_encoder.encode((so.json, so.regex, so.choice, so.grammar, so.json_object, so.structural_tag))
    return hashlib.blake2b(key, digest_size=16).digest()


class GrammarChecker:
    """``check`` (thread-safe: render pool threads call it) with an LRU of ``cache_size``
    outcomes, keyed by 16-byte digests so the cache's memory does not grow with spec size."""

    def __init__(self, cache_size: int = 4096):
        self.cache_size = cache_size
        self._cache: OrderedDict[bytes, Optional[str]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def cached(self, so: StructuredOutputs) -> tuple[bool, Optional[str]]:
        """(known, refusal message or None) without converting anything."""
        key = _digest(so)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.hits += 1
                return True, self._cache[key]
        return False, None

    def check(self, so: StructuredOutputs) -> None:
        known, message = self.cached(so)
        if not known:
            try:
                convert(so)
                message = None
            except GrammarError as exc:
                message = str(exc)
            with self._lock:
                self.misses += 1
                self._cache[_digest(so)] = message
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if message is not None:
            raise BadRequest(message, _PARAM)
