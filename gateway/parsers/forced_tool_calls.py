"""Tool calls of a forced ``tool_choice`` (``"required"`` or a named function), whose output the
grammar has shaped into JSON (gateway/structured_outputs/tool_schema.py): vLLM 0.33's
``Parser._extract_tool_calls`` / ``_extract_tool_calls_streaming`` for tool parsers that support
required and named choices (parser/abstract_parser.py, tool_parsers/streaming.py).

- named: the whole content is the call's ``arguments`` (no call for empty or blank content);
- required: the content is a JSON array of ``{"name", "parameters"}`` objects, each a call
  with ``arguments = json.dumps(parameters)``; anything that does not validate gives no calls
  (the caller then answers the text as content: vLLM drops it).  A JSON string the grammar
  shaped may hold raw control characters (xgrammar, like vLLM's, admits U+0000-U+001F in
  strings), which a strict JSON parse -- vLLM's pydantic ``validate_json`` too -- refuses: the
  array is read with ``strict=False`` and the arguments re-encoded, so they are strict JSON.

Streaming (pure functions of the text before and after a delta): a named call is announced
(id, name) with its first argument text, then each delta's text is more arguments; required
calls are found by one prefix-stable scan of the array (``scan_required``), a call is announced
once its name is complete and its parameters have started, then its new argument text follows,
with raw control characters inside its strings escaped (``escape_control_characters``), so the
concatenated arguments are strict JSON too.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from gateway.parsers.types import ParsedToolCall


def parse_named(content: Optional[str], name: str) -> list[ParsedToolCall]:
    if content is None or not content.strip():
        return []
    return [ParsedToolCall(name=name, arguments=content)]


def _valid_definition(item) -> bool:
    """vLLM's ``FunctionDefinition`` (pydantic, extra fields allowed)."""
    return (isinstance(item, dict) and isinstance(item.get("name"), str)
            and (item.get("parameters") is None or isinstance(item.get("parameters"), dict))
            and (item.get("description") is None or isinstance(item.get("description"), str))
            and all(item.get(k) is None or isinstance(item.get(k), bool) for k in ("strict", "defer_loading")))


def parse_required(content: Optional[str]) -> list[ParsedToolCall]:
    try:
        items = json.loads(content or "", strict=False)
    except (ValueError, RecursionError):
        return []
    if not isinstance(items, list) or not all(_valid_definition(item) for item in items):
        return []
    return [ParsedToolCall(name=item["name"], arguments=json.dumps(item.get("parameters"), ensure_ascii=False))
            for item in items]


def escape_control_characters(json_text: str) -> str:
    """``json_text`` with each raw control character inside a string escaped as ``json.dumps``
    writes it (``\\n``, ``\\u001e``); the rest unchanged.  Character by character on the string
    state of what precedes it, so it is prefix-stable: the escape of a prefix of a JSON value
    that starts outside a string is a prefix of the escape of the whole value."""
    if not any(ch < " " for ch in json_text):
        return json_text
    out = []
    in_string = escaped = False
    for ch in json_text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            elif ch < " ":
                ch = json.dumps(ch)[1:-1]
        elif ch == '"':
            in_string = True
        out.append(ch)
    return "".join(out)


@dataclass
class RequiredSpan:
    """One element of the required-call array: its name once complete (``name_end`` just past
    the closing quote) and the character span of its ``parameters`` value (``args_end`` None
    while it is still being generated).  Prefix-stable: scanning a prefix gives the same spans
    cut to that prefix."""

    name: Optional[str] = None
    name_end: Optional[int] = None
    args_start: Optional[int] = None
    args_end: Optional[int] = None

    @property
    def ready(self) -> bool:
        return self.name is not None and self.args_start is not None

    def ready_at(self, length: int) -> bool:
        return (self.ready and self.name_end is not None and self.name_end <= length
                and self.args_start is not None and self.args_start < length)


_KEY, _COLON, _VALUE, _IN_STRING, _IN_CONTAINER, _IN_SCALAR, _AFTER = range(7)


def scan_required(text: str) -> list[RequiredSpan]:
    """Every call of a (possibly partial) required-call array, in one string- and nesting-aware
    pass (element objects sit at depth 2; text after the array's ``]`` is ignored)."""
    spans: list[RequiredSpan] = []
    depth = 0
    in_string = escaped = False
    string_start = value_start = 0
    cur: Optional[RequiredSpan] = None
    expect, key = _KEY, None

    def end_value(pos: int) -> None:
        nonlocal expect
        if key == "parameters":
            cur.args_end = pos
        elif key == "name" and expect == _IN_STRING:
            try:
                cur.name, cur.name_end = json.loads(text[value_start:pos]), pos
            except ValueError:
                cur.name = None  # never ready, as the non-streaming parse refuses the array
        expect = _AFTER

    def start_value(pos: int, state: int) -> None:
        nonlocal expect, value_start
        value_start = pos
        if key == "parameters":
            cur.args_start = pos
        expect = state

    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 2 and cur is not None:
                    if expect == _KEY:
                        key, expect = text[string_start + 1:i], _COLON
                    elif expect == _IN_STRING:
                        end_value(i + 1)
            continue
        if ch == '"':
            in_string, string_start = True, i
            if depth == 2 and cur is not None and expect == _VALUE:
                start_value(i, _IN_STRING)
            continue
        if ch in "{[":
            if depth == 0 and ch != "[":
                return spans
            if depth == 1:
                if ch != "{":
                    return spans
                cur = RequiredSpan()
                spans.append(cur)
                expect, key = _KEY, None
            elif depth == 2 and cur is not None and expect == _VALUE:
                start_value(i, _IN_CONTAINER)
            depth += 1
            continue
        if ch in "}]":
            if depth == 2 and cur is not None and expect == _IN_SCALAR:
                end_value(i)
            depth -= 1
            if depth == 2 and cur is not None and expect == _IN_CONTAINER:
                end_value(i + 1)
            elif depth == 1:
                cur = None
            elif depth <= 0:
                return spans
            continue
        if depth != 2 or cur is None:
            continue
        if ch == ":":
            if expect == _COLON:
                expect = _VALUE
        elif ch == ",":
            if expect == _IN_SCALAR:
                end_value(i)
            expect, key = _KEY, None
        elif ch.isspace():
            if expect == _IN_SCALAR:
                end_value(i)
        elif expect == _VALUE:
            start_value(i, _IN_SCALAR)
    return spans


@dataclass(frozen=True)
class ToolCallPiece:
    """What a stream delta says about one call: ``name`` set on its first piece only."""

    index: int
    name: Optional[str]
    arguments: str


def required_stream_pieces(previous: str, current: str) -> list[ToolCallPiece]:
    """The pieces of a required-call array that ``current`` reveals beyond ``previous``
    (vLLM's ``extract_required_tool_call_streaming``)."""
    if not current:
        return []
    sent = len(previous)
    pieces = []
    for index, span in enumerate(scan_required(current)):
        if not span.ready:
            break  # calls are generated in order: nothing later can be ready
        end = span.args_end if span.args_end is not None else len(current)
        arguments = escape_control_characters(current[span.args_start:end])
        if span.ready_at(sent):
            new = arguments[len(escape_control_characters(current[span.args_start:min(end, sent)])):]
            if new:
                pieces.append(ToolCallPiece(index, None, new))
            continue
        pieces.append(ToolCallPiece(index, span.name, arguments))
    return pieces
