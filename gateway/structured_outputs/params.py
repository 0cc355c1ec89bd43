"""A request's ``structured_outputs`` JSON -> the wire ``StructuredOutputs`` (common/protocol.py).

vLLM types the field as its ``StructuredOutputsParams`` dataclass: ``json`` a JSON schema given
as an object or as a string, ``regex``/``grammar``/``structural_tag`` strings, ``choice`` a list
of strings, ``json_object`` a bool, and exactly one of those six set (``__post_init__``).  The
checks vLLM makes before any backend runs (``SamplingParams._validate_structured_outputs``) are
here, with its messages; converting the constraint to a grammar is ``grammar_check``'s job.

Bounds (ours, vLLM has none beyond the nesting depth): every string is at most
``MAX_SPEC_CHARS`` characters and ``choice`` holds at most ``MAX_CHOICES`` strings, so that what
the gateway converts, caches and sends to every worker compiling it stays small.
``whitespace_pattern`` is refused: the xgrammar backend has no such option (vLLM's xgrammar
backend ignores it silently; the workers refuse it, so the gateway says so before admission).
"""
from __future__ import annotations

from typing import Any, Optional

import msgspec

from common.errors import BadRequest
from common.protocol import StructuredOutputs
from common.structured_outputs_spec import MAX_CHOICES, MAX_SPEC_CHARS  # the workers' bounds too

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# vLLM's dataclass fields in order (its error messages print them, private ones included)
_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
           "disable_additional_properties", "whitespace_pattern", "structural_tag")
_PARAM = "structured_outputs"


def _type_error(field: str, expected: str) -> BadRequest:
    return BadRequest(f"structured_outputs.{field}: Input should be {expected}", f"{_PARAM}.{field}")


def _check_types(raw: dict) -> None:
    for field in ("regex", "grammar", "whitespace_pattern", "structural_tag"):
        if raw.get(field) is not None and not isinstance(raw[field], str):
            raise _type_error(field, "a valid string")
    value = raw.get("json")
    if value is not None and not isinstance(value, (str, dict)):
        raise _type_error("json", "a valid string or a valid dictionary")
    value = raw.get("choice")
    if value is not None and (not isinstance(value, list) or not all(isinstance(c, str) for c in value)):
        raise _type_error("choice", "a valid list of strings")
    if raw.get("json_object") is not None and not isinstance(raw["json_object"], bool):
        raise _type_error("json_object", "a valid boolean")
    for field in ("disable_any_whitespace", "disable_additional_properties"):
        if field in raw and not isinstance(raw[field], bool):
            raise _type_error(field, "a valid boolean")


def _fields_repr(raw: dict) -> str:
    """``StructuredOutputsParams.__dict__`` as vLLM's message prints it."""
    defaults = {"disable_any_whitespace": False, "disable_additional_properties": False}
    shown = {f: raw.get(f, defaults.get(f)) for f in _FIELDS}
    shown.update(_backend=None, _backend_was_auto=False)
    return repr(shown)


def _check_count(raw: dict) -> None:
    count = sum(raw.get(f) is not None for f in CONSTRAINTS)
    if count > 1:
        raise BadRequest("You can only use one kind of structured outputs constraint but multiple are specified: "
                         f"{_fields_repr(raw)}", _PARAM)
    if count < 1:
        raise BadRequest("You must use one kind of structured outputs constraint but none are specified: "
                         f"{_fields_repr(raw)}", _PARAM)


def _check_values(raw: dict) -> None:
    """vLLM's ``_validate_structured_outputs`` request-content checks, in its order (the
    nesting depth is checked with the grammar, off the event loop)."""
    choice, grammar, schema = raw.get("choice"), raw.get("grammar"), raw.get("json")
    if isinstance(choice, list) and not choice:
        raise BadRequest(f"Choice '{choice}' cannot be an empty list", _PARAM)
    if isinstance(grammar, str) and grammar.strip() == "":
        raise BadRequest("structured_outputs.grammar cannot be an empty string", _PARAM)
    if isinstance(schema, str) and schema.strip() == "":
        raise BadRequest("structured_outputs.json cannot be an empty string", _PARAM)
    if raw.get("json_object") is False:
        raise BadRequest("structured_outputs.json_object must be True if set; omit structured_outputs to disable "
                         "structured outputs", _PARAM)
    regex = raw.get("regex")
    if regex and "\x00" in regex:
        raise BadRequest("structured_outputs.regex must not contain a NUL character ('\\x00')", _PARAM)
    tag = raw.get("structural_tag")
    if isinstance(tag, str) and tag.strip() == "":
        raise BadRequest("structured_outputs.structural_tag cannot be an empty string", _PARAM)


def _check_bounds(raw: dict, schema_text: Optional[str]) -> None:
    sizes = {f: len(raw[f]) for f in ("regex", "grammar", "whitespace_pattern", "structural_tag")
             if isinstance(raw.get(f), str)}
    if schema_text is not None:
        sizes["json"] = len(schema_text)
    choice = raw.get("choice")
    if choice is not None:
        if len(choice) > MAX_CHOICES:
            raise BadRequest(f"structured_outputs.choice has {len(choice)} entries, more than the limit of "
                             f"{MAX_CHOICES}.", f"{_PARAM}.choice")
        sizes["choice"] = sum(len(c) for c in choice)
    for field, size in sizes.items():
        if size > MAX_SPEC_CHARS:
            raise BadRequest(f"structured_outputs.{field} has {size} characters, more than the limit of "
                             f"{MAX_SPEC_CHARS}.", f"{_PARAM}.{field}")


def schema_text(schema: Any) -> Optional[str]:
    """The JSON schema as it travels: a string as given, an object serialised (key order
    kept; msgspec's encoder, as fast as the body's decoding, since this runs on the event
    loop before the size bound can be checked)."""
    if schema is None or isinstance(schema, str):
        return schema
    return msgspec.json.encode(schema).decode()


def parse_structured_outputs(raw: Any) -> StructuredOutputs:
    """The request's ``structured_outputs`` object -> the wire struct (400 with vLLM's message
    for what vLLM refuses, and for what exceeds our bounds).  Unknown keys are ignored, as
    pydantic ignores them on vLLM's dataclass."""
    if not isinstance(raw, dict):
        raise BadRequest("structured_outputs: Input should be a valid dictionary", _PARAM)
    _check_types(raw)
    _check_count(raw)
    _check_values(raw)
    if raw.get("whitespace_pattern") is not None:
        raise BadRequest("structured_outputs.whitespace_pattern is not supported by the xgrammar backend",
                         f"{_PARAM}.whitespace_pattern")
    text = schema_text(raw.get("json"))
    _check_bounds(raw, text)
    return StructuredOutputs(
        json=text, regex=raw.get("regex"), choice=raw.get("choice"), grammar=raw.get("grammar"),
        json_object=raw.get("json_object"), structural_tag=raw.get("structural_tag"),
        disable_any_whitespace=bool(raw.get("disable_any_whitespace", False)),
        disable_additional_properties=bool(raw.get("disable_additional_properties", False)),
        whitespace_pattern=raw.get("whitespace_pattern"))


def render_json(raw: dict) -> dict:
    """vLLM's render output for ``sampling_params.structured_outputs``: its dataclass as
    ``msgspec.to_builtins`` writes it -- every public field, ``None`` included, ``json`` as
    given (an object stays an object)."""
    defaults = {"disable_any_whitespace": False, "disable_additional_properties": False}
    return {f: raw.get(f, defaults.get(f)) for f in _FIELDS}
