"""OpenAI request fields -> ``sampling_params.structured_outputs`` as vLLM 0.33's render emits it.

- ``structured_outputs`` (vLLM's extra field on chat and completion requests) as given;
- ``response_format`` overrides its constraint (``structured_outputs_from_response_format``):
  ``json_object`` -> ``json_object: true``, ``json_schema`` -> ``json: <its schema>``,
  ``structural_tag`` -> ``structural_tag: <the response_format serialised>``; ``text`` nothing;
- chat ``tool_choice`` ``"required"`` or a named function replaces both with the tools' schema
  (``ToolParser.adjust_request``; tool_schema.py) and drops ``response_format``;
- the Responses API's ``text.format`` (``ResponsesRequest.extract_structured_outputs``).

The checks vLLM's pydantic validators make on these fields are here, with its messages.
Structural tags are converted once here (vLLM validates them while parsing the request), so
this runs where the render runs: on the render pool.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from common.errors import BadRequest
from gateway.structured_outputs import grammar_check, params, tool_schema

_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")


def _invalid_tag(parameter: str) -> BadRequest:
    return BadRequest(f"Invalid {parameter} structural_tag specification.", parameter)


def _structural_tag_payload(fmt: dict) -> str:
    """The response_format as vLLM's pydantic models dump it (declared fields first), or 400."""
    extras = {k: v for k, v in fmt.items() if k not in ("type", "structures", "triggers", "format")}
    structures, triggers = fmt.get("structures"), fmt.get("triggers")
    legacy = (isinstance(structures, list) and isinstance(triggers, list) and all(isinstance(t, str) for t in triggers)
              and all(isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
                      and (s.get("schema") is None or isinstance(s.get("schema"), dict)) for s in structures))
    if legacy:
        items = [{"begin": s["begin"], "schema": s.get("schema"), "end": s["end"],
                  **{k: v for k, v in s.items() if k not in ("begin", "schema", "end")}} for s in structures]
        return json.dumps({"type": "structural_tag", "structures": items, "triggers": triggers, **extras})
    if "format" in fmt:
        return json.dumps({"type": "structural_tag", "format": fmt["format"], **extras})
    raise _invalid_tag("response_format")


def check_structural_tag(payload: Any, parameter: str) -> None:
    """vLLM's ``validate_structural_tag_payload``: the nesting bound (its own message), then the
    conversion; anything else wrong is "Invalid <parameter> structural_tag specification."."""
    if not isinstance(payload, str) or not payload:
        raise _invalid_tag(parameter)
    try:
        grammar_check.check_json_nesting(payload, structural_tag=True)
    except grammar_check.GrammarError as exc:
        raise BadRequest(str(exc), parameter) from None
    try:
        grammar_check.convert_structural_tag(payload)
    except Exception:
        raise _invalid_tag(parameter) from None


def _response_format_overrides(fmt: Any) -> Optional[dict]:
    """vLLM's validate_response_format + the override its render applies (None: no change)."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in _RESPONSE_FORMAT_TYPES:
        raise BadRequest("response_format.type: Input should be 'text', 'json_object', 'json_schema' or "
                         "'structural_tag'", "response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if spec is None:
            raise BadRequest("When response_format type is 'json_schema', the 'json_schema' field must be provided.",
                             "response_format")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise BadRequest("response_format.json_schema.name: Field required", "response_format")
        schema = spec.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise BadRequest("response_format.json_schema.schema: Input should be a valid dictionary",
                             "response_format")
        return {"json": schema}
    payload = _structural_tag_payload(fmt)
    check_structural_tag(payload, "response_format")
    return {"structural_tag": payload}


def _check_structured_outputs(raw: Any, tool_choice: Any, chat: bool) -> None:
    """vLLM's check_structured_outputs_count (before anything is built from the field)."""
    if raw is None:
        return
    if isinstance(raw, dict):
        count = sum(raw.get(k) is not None for k in ("json", "regex", "choice"))
        if count > 1:
            raise BadRequest("You can only use one kind of constraints for structured outputs ('json', 'regex' or "
                             "'choice').", "structured_outputs" if not chat else None)
        if chat and count > 0 and isinstance(tool_choice, dict):
            raise BadRequest("You can only either use constraints for structured outputs or tools, not both.")
        if raw.get("structural_tag") is not None:
            check_structural_tag(raw["structural_tag"], "structured_outputs")


def _merge(raw: Optional[dict], overrides: Optional[dict]) -> Optional[dict]:
    """``structured_outputs_from_response_format``: the override replaces its fields (vLLM's
    dataclass ``replace``, which checks the result again: two constraints are refused)."""
    if overrides is None:
        if raw is not None:
            params.parse_structured_outputs(raw)
        return raw
    merged = {**(raw or {}), **overrides}
    params.parse_structured_outputs(merged)
    return merged


def chat_structured_outputs(request) -> Optional[dict]:
    """A chat request's render ``structured_outputs`` (None: unconstrained).  Clears
    ``request.response_format`` where a forced tool choice replaces it, as vLLM."""
    overrides = _response_format_overrides(request.response_format)
    _check_structured_outputs(request.structured_outputs, request.tool_choice, chat=True)
    merged = _merge(request.structured_outputs, overrides)
    schema = tool_schema.json_schema_from_tools(request.tool_choice, request.tools, request.parallel_tool_calls) \
        if request.tools else None
    if schema is not None:
        request.response_format = None
        merged = {"json": schema}
    return None if merged is None else params.render_json(merged)


def completion_structured_outputs(request) -> Optional[dict]:
    overrides = _response_format_overrides(request.response_format)
    _check_structured_outputs(request.structured_outputs, None, chat=False)
    merged = _merge(request.structured_outputs, overrides)
    return None if merged is None else params.render_json(merged)


def responses_structured_outputs(text: Any, structured_outputs: Optional[dict]) -> Optional[dict]:
    """``ResponsesRequest.extract_structured_outputs``: ``text.format`` json_object / json_schema
    -> the chat request's ``structured_outputs`` (a raw dict); both given is a 400."""
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict):
        return structured_outputs
    if structured_outputs is not None:
        raise BadRequest("Cannot specify both structured_outputs and text.format", "structured_outputs")
    kind = fmt.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema" and fmt.get("schema") is not None:
        return {"json": fmt["schema"]}
    if kind not in ("text", "json_schema"):
        raise BadRequest("text.format.type: Input should be 'text', 'json_schema' or 'json_object'", "text")
    return None
