"""GPT-OSS's harmony output format: vLLM 0.33's ``--reasoning-parser openai_gptoss`` with
``--tool-call-parser openai`` (``parser/harmony.py`` ``HarmonyParser`` over openai_harmony's
``StreamableParser``), as a pure function of the decoded text.

The output of a harmony model is a sequence of messages.  The prompt ends with
``<|start|>assistant`` (the template's generation prompt), so the first message starts with
its header directly; later ones with ``<|start|>ROLE``::

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
        {"city": "Paris"}<|call|>      (one line; broken here)
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

Each message is classified as vLLM's ``_SegmentType.from_channel_and_recipient`` does:

* a recipient ``functions.NAME`` (any channel): a tool call of NAME -- its text is the
  arguments, re-serialized as ``json.dumps(json.loads(text))`` unless the content type says it
  is not JSON (or it does not parse: then the text as is); reported only with the tool parser
  (and tools enabled for the request), else dropped;
* channel ``analysis`` (another recipient included, e.g. ``python``): reasoning -- only with
  the reasoning parser, else dropped;
* channel ``final``, or ``commentary`` without a recipient (a preamble): content;
* anything else (built-in tools such as ``browser.search``): dropped.

Reasoning and content are the non-empty message texts joined with ``"\\n"`` (``None`` when
there are none); only assistant messages count.

Why not the ``openai_harmony`` library, as vLLM does: it parses token ids of its own
``o200k_harmony`` tiktoken encoding, which it downloads at run time unless
``TIKTOKEN_ENCODINGS_BASE`` points at the vocabulary files.  Our gateway works with the
model's own HF tokenizer and decodes the output with special tokens kept
(``keeps_special_tokens``), so the harmony control tokens reach this parser as their text
(``<|channel|>`` ...): parsing that text needs no download and works for any tokenizer that
carries the tokens -- the tiny test tokenizers included.  The header grammar is a port of
openai_harmony's ``parse_header_from_string``.

Streaming (``final=False``): the fields only grow.  A message contributes nothing until its
header is complete (``<|message|>``); then reasoning and content grow with its text (a suffix
that could be the start of an end token is held back); a tool call is reported whole once its
message ended (``<|call|>``/``<|end|>``/``<|return|>``, or the end of the output for the final
parse -- the stop token is usually not part of the text).  vLLM streams a call's arguments
as they come and joins streamed messages without the ``"\\n"``; here the stream adds up to
the non-streamed answer exactly.

Malformed output: vLLM's strict parser raises and ``HarmonyParser.flush`` answers the raw
text of the unfinished message as content.  Here: a header that never reaches
``<|message|>`` (e.g. a model that ignored the format) is content at the end; text between a
message's end and the next ``<|start|>`` is dropped.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from gateway.parsers.reasoning import partial_suffix_len
from gateway.parsers.types import ParsedToolCall

START = "<|start|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
RETURN = "<|return|>"
CALL = "<|call|>"
# What ends a message: harmony's stop formatting tokens.
MESSAGE_ENDS = (END, RETURN, CALL)
# vLLM's GptOssReasoningParser.reasoning_end_token_ids, as text: the final channel's header.
REASONING_END = "<|start|>assistant<|channel|>final<|message|>"
FUNCTIONS_PREFIX = "functions."
# openai_harmony's Role values; a header naming another role is a tool's message.
_ROLES = ("user", "assistant", "system", "developer", "tool")


class HeaderError(ValueError):
    """A header openai_harmony refuses (strict parsing)."""


@dataclass(frozen=True)
class Header:
    role: str
    channel: Optional[str]
    recipient: Optional[str]
    content_type: Optional[str]


@dataclass(frozen=True)
class Message:
    header: Header
    text: str
    complete: bool  # ended by an end token or by the end of the output (final)


def parse_header(header: str, role: Optional[str]) -> Header:
    """openai_harmony's ``parse_header_from_string`` (``parse_recipient_and_type``): the
    channel after ``<|channel|>``, then whitespace-separated parts: the role (unless given:
    the first message follows the prompt's ``<|start|>assistant``), and at the end the
    content type and/or ``to=RECIPIENT``."""
    channel = None
    at = header.find(CHANNEL)
    if at >= 0:
        after = header[at + len(CHANNEL):]
        end = next((i for i, c in enumerate(after) if c.isspace() or c == "<"), len(after))
        if end == 0:
            raise HeaderError("channel marker present but no channel value found in header")
        channel = after[:end]
        header = header[:at] + after[end:]
    header = header.strip()
    if CONSTRAIN in header:  # "to=foo<|constrain|>json": the content type is its own part
        header = header.replace(CONSTRAIN, " " + CONSTRAIN).strip()
    parts = header.split()
    if role is None:
        if not parts:
            raise HeaderError("message header did not contain a role")
        role = parts[0]
        if role not in _ROLES:
            if len(parts) > 1 or parts[0].startswith("to="):
                parts.pop(0)
                role = "tool"
            else:
                raise HeaderError(f"Unknown role: {role}")
    if parts and parts[0] == role:
        parts.pop(0)
    recipient = content_type = None
    if parts:
        count = len(parts)
        last = parts.pop()
        if last.startswith("to="):
            recipient = last[3:]
        elif count == 1:
            recipient = last
        else:
            content_type = last
            if parts:
                raw = parts.pop()
                recipient = raw[3:] if raw.startswith("to=") else raw
        if parts:
            raise HeaderError(f"unexpected tokens remaining in message header: {' '.join(parts)!r}")
    return Header(role=role, channel=channel, recipient=_normalize_recipient(recipient), content_type=content_type)


def _normalize_recipient(recipient: Optional[str]) -> Optional[str]:
    """vLLM's ``HarmonyParser._normalize_recipient``: a constrained format misparsed into
    the recipient is cut off."""
    if recipient is None:
        return None
    at = recipient.find(CONSTRAIN)
    if at < 0:
        return recipient
    return recipient[:at].rstrip() or None


def split_messages(text: str, *, final: bool) -> tuple[list[Message], Optional[str]]:
    """The messages of ``text`` (the output after the prompt's ``<|start|>assistant``), and
    the raw text of a malformed tail, which vLLM's recovery answers as content (``None``
    when there is none).  With ``final=False`` the last message may be incomplete: its text
    is what can be released (held back: a possible partial end token)."""
    messages: list[Message] = []
    pos, role, n = 0, "assistant", len(text)
    while pos < n or (role is not None and not final):
        if role is None:  # between messages: the next one starts at <|start|>
            start = text.find(START, pos)
            if start < 0:
                break  # the rest is not a message: dropped (see the module doc)
            pos, role = start + len(START), ""
            continue
        body = text.find(MESSAGE, pos)
        if body < 0:
            if final and pos < n:
                return messages, text[pos - (len(START) if role == "" else 0):] or None
            break  # the header is still arriving
        try:
            header = parse_header(text[pos:body], role or None)
        except HeaderError:
            if not final:
                return messages, None  # vLLM fails the request's parse here; nothing more is released
            return messages, text[pos - (len(START) if role == "" else 0):] or None
        pos = body + len(MESSAGE)
        ends = [(i, m) for m in MESSAGE_ENDS if (i := text.find(m, pos)) >= 0]
        if ends:
            at, marker = min(ends)
            messages.append(Message(header, text[pos:at], complete=True))
            pos, role = at + len(marker), None
            continue
        rest = text[pos:]
        if not final:
            rest = rest[:len(rest) - partial_suffix_len(rest, MESSAGE_ENDS)]
        messages.append(Message(header, rest, complete=final))
        break
    return messages, None


def _arguments(message: Message) -> str:
    """vLLM's ``HarmonyParser.parse``: JSON arguments re-serialized (``json.dumps`` defaults),
    a non-JSON content type or unparsable text as written."""
    content_type = message.header.content_type
    if content_type is not None and "json" not in content_type:
        return message.text
    try:
        return json.dumps(json.loads(message.text))
    except (ValueError, RecursionError):
        return message.text


def parse(text: str, *, final: bool, reasoning: bool,
          tools: bool) -> tuple[Optional[str], Optional[str], list[ParsedToolCall]]:
    """(reasoning, content, tool calls) of a harmony output.  ``reasoning``: the reasoning
    parser is on (analysis messages become reasoning; else they are dropped); ``tools``: the
    tool parser is on and the request's tools are enabled (else tool-call messages are
    dropped)."""
    messages, malformed = split_messages(text, final=final)
    reasoning_parts: list[str] = []
    content_parts: list[str] = []
    calls: list[ParsedToolCall] = []
    for message in messages:
        header = message.header
        if header.role != "assistant":
            continue
        recipient, channel = header.recipient, header.channel
        if recipient and recipient.startswith(FUNCTIONS_PREFIX):
            if tools and message.complete:
                calls.append(ParsedToolCall(name=recipient[len(FUNCTIONS_PREFIX):], arguments=_arguments(message)))
        elif channel == "analysis":
            if reasoning and message.text:
                reasoning_parts.append(message.text)
        elif channel == "final" or (channel == "commentary" and recipient is None):
            if message.text:
                content_parts.append(message.text)
    if malformed:
        content_parts.append(malformed)
    return "\n".join(reasoning_parts) or None, "\n".join(content_parts) or None, calls


def reasoning_open(prompt_text: str) -> bool:
    """Whether generation starts before the final channel: unless the prompt's last assistant
    message already opened its final channel (``continue_final_message``).  vLLM's
    ``GptOssReasoningParser.is_reasoning_end`` finds the final-channel header anywhere in the
    prompt, so an earlier turn's answer would end reasoning before the model wrote a token
    (and constrain structured outputs from the first one); only the last turn counts here."""
    last = prompt_text.rfind(START + "assistant")
    return last < 0 or not prompt_text.startswith(REASONING_END, last)


class ReasoningTokenCounter:
    """Output tokens vLLM's ``HarmonyParser`` counts as reasoning for usage
    (``count_reasoning_tokens``): every token read while the current message is on the
    ``analysis`` channel, or on ``commentary`` with a recipient (tool calls) -- its
    ``<|message|>`` token and its content, not its header or end token.  Counted on token ids
    as they arrive: ``control_ids`` maps harmony's control tokens to the tokenizer's ids,
    ``decode`` turns a header's ids into its text."""

    def __init__(self, control_ids: dict[str, int], decode):
        self._start, self._message = control_ids[START], control_ids[MESSAGE]
        self._ends = {control_ids[t] for t in MESSAGE_ENDS}
        self._decode = decode
        self._state = "header"  # the first message's header follows the prompt's <|start|>assistant
        self._role: Optional[str] = "assistant"
        self._header: list[int] = []
        self._counting = False
        self.count = 0

    @classmethod
    def for_tokenizer(cls, tokenizer) -> Optional["ReasoningTokenCounter"]:
        """None when the tokenizer lacks one of harmony's control tokens."""
        ids = {t: tokenizer.token_to_id(t) for t in (START, MESSAGE) + MESSAGE_ENDS}
        if None in ids.values():
            return None
        return cls(ids, lambda header: tokenizer.decode(header, skip_special_tokens=False))

    def add(self, token_ids) -> None:
        for token in token_ids:
            if self._state == "content":
                if token in self._ends:
                    self._state, self._counting = "between", False
                elif self._counting:
                    self.count += 1
            elif self._state == "header":
                if token != self._message:
                    self._header.append(token)
                    continue
                try:
                    header = parse_header(self._decode(self._header), self._role)
                except HeaderError:
                    header = None
                self._counting = header is not None and (
                    header.channel == "analysis" or (header.channel == "commentary" and header.recipient is not None))
                self.count += self._counting
                self._state, self._header = "content", []
            elif token == self._start:
                self._state, self._role = "header", None
