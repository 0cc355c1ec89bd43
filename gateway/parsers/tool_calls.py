"""Tool-call parsers (vLLM 0.32 ``--tool-call-parser hermes`` / ``llama3_json``) as pure functions.

Each extractor takes the content left by the reasoning parser (``None`` when there is none) and
returns ``(tool_calls, content)`` with vLLM's non-streaming semantics for ``final=True``
(``tool_parsers/{hermes,llama}_tool_parser.py`` ``extract_tool_calls`` plus what
``parser/abstract_parser.py`` ``DelegatingParser._extract_tool_calls`` does with the result):

* tool calls found -> their content; whitespace-only content becomes ``None``;
* no tool calls, or the parser failed (invalid JSON, a missing key, a non-string name) -> the
  content exactly as it came in (``None`` stays ``None``) and no tool calls.

With ``final=False`` the content is a streaming prefix.  A tool call is reported only once it is
complete (hermes: its ``</tool_call>`` arrived; llama3_json: its JSON object closed), whole;
content that could still be dropped is held back.  Where the final parse can still reject the
calls already reported (a LATER block turns out invalid: vLLM then returns the whole text as
content and no tool calls at all), the stream cannot take them back; see each function.
"""
from __future__ import annotations

import json
import re

from gateway.parsers.types import ParsedToolCall
from gateway.parsers.reasoning import partial_suffix_len

HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"
# Hermes2ProToolParser.tool_call_regex
_HERMES_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
LLAMA_BOT = "<|python_tag|>"
_JSON_DECODER = json.JSONDecoder()


class _Invalid(Exception):
    pass


def _call(obj: object, *, llama: bool) -> ParsedToolCall:
    """vLLM builds ``FunctionCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))``;
    a missing key, a non-object, or a name pydantic rejects as ``str`` is a parse failure."""
    if not isinstance(obj, dict) or "name" not in obj:
        raise _Invalid
    if llama:  # obj["arguments"] if "arguments" in obj else obj["parameters"]
        key = "arguments" if "arguments" in obj else "parameters"
    else:
        key = "arguments"
    if key not in obj or not isinstance(obj["name"], str):
        raise _Invalid
    return ParsedToolCall(name=obj["name"], arguments=json.dumps(obj[key], ensure_ascii=False))


def _content_with_tools(content: str) -> str | None:
    return content if content and content.strip() else None


# ---------------------------------------------------------------------------- hermes

def extract_hermes(content: str | None, *, final: bool) -> tuple[list[ParsedToolCall], str | None]:
    """``Hermes2ProToolParser.extract_tool_calls``: every ``<tool_call>...</tool_call>`` block (and an
    unterminated last one, up to the end) is ``json.loads``-ed into ``{"name", "arguments"}``; the
    content is the text before the first ``<tool_call>``; text between/after blocks is dropped.
    One bad block -> no tool calls, the whole text is content.

    Streaming: content before the first ``<tool_call>`` is released as it arrives except a suffix
    that could be the start of ``<tool_call>``, and except while it is whitespace only (vLLM drops
    whitespace-only content when tools are called, but keeps it when none are).  A block is
    reported when its ``</tool_call>`` arrives; an unterminated block only by the final parse.
    When a closed block is invalid the final result is known to be the whole text as content, so
    from then on the content streams as the whole text; calls reported before it stay in the
    stream (the final parse has none: the one non-prefix case, as in vLLM, whose own streaming
    would have sent them and garbage for the bad block).
    """
    text = content or ""
    if final:
        if HERMES_START not in text:
            return [], content
        try:
            calls = [_call(json.loads(m[0] if m[0] else m[1]), llama=False)
                     for m in _HERMES_RE.findall(text)]
        except Exception:  # vLLM: `except Exception` -> whole text as content
            return [], content
        return calls, _content_with_tools(text[:text.find(HERMES_START)])

    first = text.find(HERMES_START)
    if first < 0:
        released = text[:len(text) - partial_suffix_len(text, (HERMES_START,))]
        return [], _content_with_tools(released)
    calls: list[ParsedToolCall] = []
    pos = first
    while (start := text.find(HERMES_START, pos)) >= 0:
        body_start = start + len(HERMES_START)
        end = text.find(HERMES_END, body_start)
        if end < 0:
            break  # unterminated: only the final parse decides
        try:
            calls.append(_call(json.loads(text[body_start:end]), llama=False))
        except Exception:
            return calls, text  # the final result is the fallback: whole text as content
        pos = end + len(HERMES_END)
    return calls, _content_with_tools(text[:first])


# ---------------------------------------------------------------------------- llama3_json

def _llama_scan(text: str, *, final: bool) -> tuple[list[ParsedToolCall], bool]:
    """Llama3JsonToolParser.extract_tool_calls' loop: ``raw_decode`` at every ``{`` that is not
    inside (or, quirk kept: right at the end of) the previous object.  Returns (calls, failed);
    with ``final=False`` a ``{`` that does not decode yet stops the scan (it may be incomplete)."""
    calls: list[ParsedToolCall] = []
    end_index = -1
    for match in re.finditer(r"\{", text):
        start = match.start()
        if start <= end_index:
            continue
        try:
            obj, length = _JSON_DECODER.raw_decode(text[start:])
        except Exception:  # JSONDecodeError, RecursionError
            if final:
                return calls, True
            break
        end_index = start + length
        try:
            calls.append(_call(obj, llama=True))
        except _Invalid:
            return calls, True
    return calls, False


def extract_llama3_json(content: str | None, *, final: bool) -> tuple[list[ParsedToolCall], str | None]:
    """``Llama3JsonToolParser.extract_tool_calls``: JSON objects ``{"name", "arguments"|"parameters"}``
    anywhere in the text (``;``-separated or not, after an optional ``<|python_tag|>``); if all of
    them decode into calls the content is ``None``, any failure returns the whole text as content.

    vLLM's streaming only treats the output as tool calls when it STARTS with ``{`` or the python
    tag (else it streams everything as content) while its non-streaming parse finds calls
    anywhere.  Streaming here: while the text is whitespace (or a partial python tag) nothing is
    released; if it then starts with ``{``/the tag (leading whitespace allowed, unlike vLLM's
    stream, so ``"\\n{...}"`` streams as the tool call the final parse makes of it) each object is
    reported once it closes and the content held back (``None`` in the end), switching to the
    whole text as content when an object is not a valid call; otherwise everything streams as
    content -- and if such text turns out to hold nothing but valid call objects, the final
    parse reports the calls with content ``None`` (not an extension of the stream; vLLM's stream
    and non-stream disagree the same way).
    """
    text = content or ""
    if final:
        if LLAMA_BOT not in text and "{" not in text:
            return [], content
        calls, failed = _llama_scan(text, final=True)
        if failed or not calls:
            return [], content
        return calls, None

    head = text.lstrip()
    if len(head) < len(LLAMA_BOT) and LLAMA_BOT.startswith(head):
        return [], None  # empty/whitespace so far, or a partial "<|python_tag|>"
    if not (head.startswith("{") or head.startswith(LLAMA_BOT)):
        return [], content
    calls, failed = _llama_scan(text, final=False)
    return (calls, text) if failed else (calls, None)
