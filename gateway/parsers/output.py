"""Reasoning + tool-call parsing of a chat completion's output text, as vLLM 0.32 does it.

One pure function of the decoded text serves the non-streaming response, the stream (each delta
is the difference between the parses of successive prefixes) and a stateless derender that
replays from the token list.  vLLM composes a ``--reasoning-parser`` and a ``--tool-call-parser``
in ``parser/abstract_parser.py`` (``DelegatingParser``): the reasoning parser splits the output
into ``(reasoning, content)``, then -- only when the request has tools and ``tool_choice`` is not
``"none"`` -- the tool parser extracts tool calls from that content.
GPT-OSS's harmony format (``openai_gptoss`` / ``openai``, vLLM's ``HarmonyParser``) is one grammar
of channel messages instead: :mod:`gateway.parsers.harmony` reads reasoning, content and tool calls
in one pass, under the same streaming contract.

Streaming contract of :meth:`OutputParser.parse`: for prefixes ``p1 <= p2`` of a text ``t``,
``parse(p1, final=False)`` is field-wise a prefix of ``parse(p2, final=False)`` and of
``parse(t, final=True)`` (``None`` counting as ``""``; ``tool_calls`` a list prefix, each call
complete), except in these cases, where the final parse is vLLM's non-streaming result and that
result takes back what a stream had to send already (vLLM's own stream differs there too):

* deepseek_r1: a ``<think>`` appearing after the output has started (see
  :func:`gateway.parsers.reasoning.split_deepseek_r1`);
* hermes / llama3_json: a tool-call block that turns out invalid after valid ones were reported
  (vLLM then returns no tool calls and the whole text as content; the content still extends);
* llama3_json: text not starting with ``{`` that ends up holding only valid call objects
  (streamed as content, as vLLM streams it; the final parse makes tool calls of it).

Where this streaming deliberately differs from vLLM's streaming (not from its non-streaming
result, which it matches): whitespace-only content before a tool call is never sent (vLLM's
stream sends it, its non-stream drops it); a tool call is sent whole when complete instead of as
name + argument fragments (a hermes block without ``</tool_call>`` and an llama object that does
not parse yet are only settled by the final parse); invalid hermes/llama JSON becomes content
as in the non-stream result; llama3_json output starting with whitespace then ``{`` is treated as
tool calls; tags written as plain text are parsed like vLLM's non-stream (vLLM's stream
matches some of them by special-token id only).

What the caller does around it (vLLM's serving layer, ``entrypoints/openai/chat_completion/
serving.py``): ``include_reasoning=False`` drops the reasoning; ``parallel_tool_calls=False``
keeps the first tool call; tool_choice ``"required"``/named answers ``content or ""``; ids per
call index from :func:`make_tool_call_id`; the field is ``reasoning`` in both ``message`` and
stream ``delta`` (0.32 no longer emits ``reasoning_content``; it accepts it only on input
messages, renamed to ``reasoning``).

Cost: a parse is linear in the text (about 1 ms for 200k characters), so re-parsing the whole
text for every chunk is quadratic over a stream -- parse once per engine step, not per token.
"""
from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gateway.parsers.types import ParsedToolCall

REASONING_PARSERS: tuple[str, ...] = ("deepseek_r1", "qwen3", "openai_gptoss")
# llama4_json and qwen3_json are vLLM aliases of the same two parser classes
TOOL_CALL_PARSERS: tuple[str, ...] = ("hermes", "llama3_json", "llama4_json", "qwen3_json", "openai")
# GPT-OSS's harmony format (gateway/parsers/harmony.py): reasoning, content and tool calls are
# messages of one grammar, parsed in one pass; vLLM's HarmonyParser refuses any other parser
# next to these two, and so does OutputParser.
HARMONY_REASONING_PARSER = "openai_gptoss"
HARMONY_TOOL_CALL_PARSER = "openai"


@dataclass(frozen=True)
class ParsedOutput:
    reasoning: str | None  # None without a reasoning parser / reasoning (deepseek_r1 may give "")
    content: str | None    # vLLM's non-stream None vs ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)


def make_tool_call_id() -> str:
    """vLLM ``renderers/chat_utils.make_tool_call_id`` (id_type "random"):
    ``"chatcmpl-tool-"`` + 16 hex digits (the low 64 bits of a uuid4) -- 30 characters."""
    return f"chatcmpl-tool-{uuid.uuid4().int & 0xFFFF_FFFF_FFFF_FFFF:016x}"


def final_finish_reason(engine_reason: str | None, parsed: ParsedOutput, *, stream: bool = False,
                        tool_choice: str | Mapping[str, Any] | None = "auto") -> str | None:
    """The choice's finish_reason as vLLM's chat serving sets it (``serving.py``).

    * non-streaming, tool_choice auto: ``"tool_calls"`` whenever tool calls were parsed, even
      when the engine stopped for ``"length"`` (``is_finish_reason_tool_calls = auto_tools_called``);
    * streaming: ``"tool_calls"`` only when tool calls were sent and the engine reason is
      ``"stop"`` (a ``"length"`` stays ``"length"``);
    * tool_choice ``"required"``: non-streaming ``"tool_calls"`` whenever the engine reason is
      ``"stop"`` (parsed or not), streaming as for auto;
    * a named tool_choice (a mapping): never ``"tool_calls"`` (OpenAI answers ``"stop"``);
    * an explicit ``tool_choice: null`` with tools, non-streaming: vLLM's message has no tool
      calls (its ``not request.tool_choice`` branch) and the engine's reason;
    * otherwise the engine's reason.  ``None`` (not finished) stays ``None``; vLLM would
      write ``"stop"`` for a finished choice without a reason.

    ``parsed`` is the final parse; for a stream whose final parse took tool calls back (see the
    module doc) vLLM decides on what was streamed -- pass a parse that has them.
    """
    if engine_reason is None:
        return None
    if isinstance(tool_choice, Mapping) or tool_choice == "none":
        return engine_reason
    if tool_choice == "required" and not stream:
        return "tool_calls" if engine_reason == "stop" else engine_reason
    if tool_choice is None and not stream:
        return engine_reason  # explicit null with tools: vLLM's message branch drops the calls
    if parsed.tool_calls and (engine_reason == "stop" or not stream):
        return "tool_calls"
    return engine_reason


def _choices_error(kind: str, name: str, choices: Iterable[str]) -> ValueError:
    return ValueError(f"unknown {kind} {name!r}; choices: {', '.join(choices)}")


class OutputParser:
    """``--reasoning-parser`` / ``--tool-call-parser`` by vLLM's CLI names (``None``/"" for none).

    ``special_tokens``: the tokenizer's ``all_special_tokens``; vLLM's qwen3 parser engine drops
    those it does not use from reasoning and content (they only appear in the text when it is
    decoded with special tokens, which :meth:`keeps_special_tokens` says vLLM does).
    """

    REASONING_PARSERS: ClassVar[tuple[str, ...]] = REASONING_PARSERS
    TOOL_CALL_PARSERS: ClassVar[tuple[str, ...]] = TOOL_CALL_PARSERS

    def __init__(self, reasoning_parser: str | None, tool_call_parser: str | None, *,
                 special_tokens: Iterable[str] = ()) -> None:
        from gateway.parsers import harmony as h
        from gateway.parsers import reasoning as r
        from gateway.parsers import tool_calls as t

        self.reasoning_parser = reasoning_parser or None
        self.tool_call_parser = tool_call_parser or None
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise _choices_error("reasoning parser", self.reasoning_parser, REASONING_PARSERS)
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise _choices_error("tool call parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        self.harmony = (self.reasoning_parser == HARMONY_REASONING_PARSER
                        or self.tool_call_parser == HARMONY_TOOL_CALL_PARSER)
        if self.harmony and self.reasoning_parser not in (None, HARMONY_REASONING_PARSER):
            raise ValueError(f"Harmony requires the {HARMONY_REASONING_PARSER} reasoning parser, "
                             f"got {self.reasoning_parser!r}")
        if self.harmony and self.tool_call_parser not in (None, HARMONY_TOOL_CALL_PARSER):
            raise ValueError(f"Harmony requires the {HARMONY_TOOL_CALL_PARSER} tool call parser, "
                             f"got {self.tool_call_parser!r}")
        drop_tokens = tuple(special_tokens)
        self._split: Callable[..., tuple[str | None, str | None]] | None = None
        if self.reasoning_parser == "deepseek_r1":
            self._split = r.split_deepseek_r1
        elif self.reasoning_parser == "qwen3":
            self._split = lambda text, *, final: r.split_qwen3(text, final=final, drop_tokens=drop_tokens)
        self._extract: Callable[..., tuple[list[ParsedToolCall], str | None]] | None = None
        if self.tool_call_parser in ("hermes", "qwen3_json"):
            self._extract = t.extract_hermes
        elif self.tool_call_parser in ("llama3_json", "llama4_json"):
            self._extract = t.extract_llama3_json
        self._r = r
        self._h = h

    def reasoning_open_at_start(self, prompt_text: str, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
        """Whether generation starts inside reasoning -- vLLM's ``not parser.is_reasoning_end(
        prompt_token_ids)``, which its streaming path (and the engine's structured-output gate,
        ``reasoning_ended``) uses.  deepseek_r1: open unless the prompt's last think marker is
        ``</think>``.  qwen3: ``enable_thinking`` (default true) and the last turn not already
        past ``</think>``/``<tool_call>``.  Pass the effective ``chat_template_kwargs`` (request
        kwargs + ``enable_thinking`` derived from ``reasoning_effort`` + server defaults).

        vLLM's NON-streaming parse ignores the prompt: it always starts inside reasoning for
        deepseek_r1 and for qwen3 with thinking enabled (:meth:`reasoning_open_default`).  The two
        differ only for a prompt that already closed the think block (e.g. Qwen3 with
        ``enable_thinking=False`` served with ``deepseek_r1``): vLLM streams the output as
        content but answers it non-streamed as reasoning.  Using this method for both keeps our
        stream and non-stream results equal (vLLM's streaming behaviour)."""
        if self.reasoning_parser == "deepseek_r1":
            return self._r.deepseek_r1_reasoning_open(prompt_text)
        if self.reasoning_parser == "qwen3":
            return self._r.qwen3_reasoning_open(prompt_text, chat_template_kwargs)
        if self.reasoning_parser == HARMONY_REASONING_PARSER:
            # Only reported (reasoning_ended); the harmony parse reads the channels instead.
            return self._h.reasoning_open(prompt_text)
        return False

    def reasoning_open_default(self, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
        """What vLLM's non-streaming parse assumes regardless of the prompt (see above)."""
        if self.reasoning_parser == "deepseek_r1":
            return True
        if self.reasoning_parser == "qwen3":
            return self._r.qwen3_thinking_enabled(chat_template_kwargs)
        return self.reasoning_parser == HARMONY_REASONING_PARSER

    def keeps_special_tokens(self, *, tools_enabled: bool) -> bool:
        """Whether vLLM's ``adjust_request`` forces ``skip_special_tokens=False`` for the request
        (decode the output that way so the tags reach the parser): the qwen3 reasoning parser
        always does (``ParserEngine.adjust_request``), hermes when tools are enabled;
        deepseek_r1 and llama3_json leave the request's setting alone.  Harmony always: its
        channels and headers are special tokens (vLLM parses its token ids instead)."""
        return self.harmony or self.reasoning_parser == "qwen3" or (
            tools_enabled and self.tool_call_parser in ("hermes", "qwen3_json"))

    def parse(self, text: str, *, reasoning_open: bool, tools_enabled: bool, final: bool) -> ParsedOutput:
        """Split ``text`` (the whole output so far) into reasoning, content and tool calls.

        ``reasoning_open``: from :meth:`reasoning_open_at_start`; when false the reasoning
        parser is skipped and the text is content (vLLM: reasoning ended in the prompt, or qwen3
        with thinking disabled).  ``tools_enabled``: the request has tools and tool_choice is
        not ``"none"`` (and the server runs a tool parser, i.e. ``--enable-auto-tool-choice``).
        ``final=False``: ``text`` is a streaming prefix -- see the module doc for the contract.
        Harmony output is read by its channels whatever ``reasoning_open`` says.
        """
        if self.harmony:
            reasoning, content, calls = self._h.parse(
                text, final=final, reasoning=self.reasoning_parser is not None,
                tools=tools_enabled and self.tool_call_parser is not None)
            return ParsedOutput(reasoning=reasoning, content=content, tool_calls=calls)
        if self._split is not None and reasoning_open:
            reasoning, content = self._split(text, final=final)
        else:
            reasoning, content = None, text
        tool_calls: list[ParsedToolCall] = []
        if self._extract is not None and tools_enabled:
            tool_calls, content = self._extract(content, final=final)
        return ParsedOutput(reasoning=reasoning, content=content, tool_calls=tool_calls)
