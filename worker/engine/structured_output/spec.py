"""A request's structured-output constraint, checked and reduced to its cache key.

The gateway validates ``StructuredOutputs`` already, but a direct ZeroMQ client
reaches the worker without it, so the worker checks again here: exactly one
constraint, bounded sizes (the compiler's work grows with the spec), JSON nested at
most vLLM's 64 levels.  What the compiler itself rejects comes back later, from the
compile pool, as a 400 carrying its reason (grammar_cache.py / the component).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from common.errors import BadRequest
from common.protocol import StructuredOutputs
from common.structured_outputs_spec import (MAX_CHOICES, MAX_JSON_NESTING, MAX_SPEC_CHARS,  # noqa: F401 (re-exported)
                                            STRUCTURAL_TAG_WRAPPER_NESTING, exceeds_json_nesting,
                                            unsupported_json_feature)

PARAM = "structured_outputs"
MAX_REASONING_MARKER = 64  # tokens in reasoning_start / reasoning_end

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class GrammarKey:
    """What a compiled grammar depends on (the tokenizer is the engine's, fixed)."""

    kind: str
    spec: str  # the schema / regex / grammar text; choices as a JSON list
    any_whitespace: bool


def _load_json_object(text: str, what: str, limit: int) -> dict:
    try:
        value = json.loads(text)
    except RecursionError:
        raise BadRequest(f"{PARAM}.{what} is nested too deeply", PARAM) from None
    except ValueError as e:
        raise BadRequest(f"{PARAM}.{what} is not valid JSON: {e}", PARAM) from None
    if not isinstance(value, dict):
        raise BadRequest(f"{PARAM}.{what} must be a JSON object", PARAM)
    if exceeds_json_nesting(value, limit):
        raise BadRequest(f"{PARAM}.{what}: the JSON schema is nested too deeply: objects and arrays may nest "
                         f"at most {MAX_JSON_NESTING} levels", PARAM)
    return value


def _check_marker(ids: Any, name: str, vocab_size: int) -> None:
    if ids is None:
        return
    if not ids or len(ids) > MAX_REASONING_MARKER:
        raise BadRequest(f"{PARAM}.{name} must hold 1 to {MAX_REASONING_MARKER} token ids", PARAM)
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
        raise BadRequest(f"{PARAM}.{name} holds a token id outside the vocabulary [0, {vocab_size})", PARAM)


def grammar_key(so: StructuredOutputs, vocab_size: int, *, disable_any_whitespace: bool = False) -> GrammarKey:
    """Check ``so`` (BadRequest naming what is wrong) and return its cache key.
    The server-wide ``disable_any_whitespace`` (--structured-outputs-config) ORs the
    request's.  (``disable_additional_properties`` changes nothing with xgrammar, whose
    strict mode already allows no properties beyond the schema's: not part of the key.)"""
    set_kinds = [k for k in KINDS if getattr(so, k) not in (None, False)]
    if len(set_kinds) != 1:
        found = ", ".join(set_kinds) if set_kinds else "none"
        raise BadRequest(f"{PARAM} must set exactly one of {', '.join(KINDS)} (found: {found})", PARAM)
    kind = set_kinds[0]
    if so.whitespace_pattern is not None:
        # vLLM's xgrammar backend has no whitespace_pattern either (guidance/outlines only).
        raise BadRequest(f"{PARAM}.whitespace_pattern is not supported by the xgrammar backend", PARAM)
    _check_marker(so.reasoning_end, "reasoning_end", vocab_size)
    _check_marker(so.reasoning_start, "reasoning_start", vocab_size)
    value = getattr(so, kind)
    if kind == "choice":
        if not isinstance(value, list) or not value or len(value) > MAX_CHOICES:
            raise BadRequest(f"{PARAM}.choice must list 1 to {MAX_CHOICES} strings", PARAM)
        if any(not isinstance(c, str) for c in value):
            raise BadRequest(f"{PARAM}.choice must list strings", PARAM)
        spec = json.dumps(value, ensure_ascii=False)
    elif kind == "json_object":
        spec = '{"type": "object"}'
    else:
        if not isinstance(value, str) or not value:
            raise BadRequest(f"{PARAM}.{kind} must be a non-empty string", PARAM)
        spec = value
    if len(spec) > MAX_SPEC_CHARS:
        raise BadRequest(f"{PARAM}.{kind} is {len(spec)} characters; at most {MAX_SPEC_CHARS} are accepted", PARAM)
    if "\x00" in spec and kind in ("regex", "grammar"):
        raise BadRequest(f"{PARAM}.{kind} must not contain a NUL character", PARAM)
    if kind == "json":
        unsupported = unsupported_json_feature(_load_json_object(spec, "json", MAX_JSON_NESTING))
        if unsupported:
            raise BadRequest(f"{PARAM}.json: the JSON schema uses {unsupported}, which the xgrammar backend does "
                             f"not support", PARAM)
    elif kind == "structural_tag":
        _load_json_object(spec, "structural_tag", MAX_JSON_NESTING + STRUCTURAL_TAG_WRAPPER_NESTING)
    return GrammarKey(kind, spec, any_whitespace=not (so.disable_any_whitespace or disable_any_whitespace))
