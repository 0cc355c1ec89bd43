"""One chat choice's output text -> OpenAI message (non-stream) or deltas (stream).

Shared by the chat facade (text from the workers) and the chat derender (text decoded
here from token ids), so both answer the same.  With a reasoning or tool-call parser the
choice's whole text is re-parsed at each chunk (gateway/parsers hold back partial tags so
parsed fields only grow) and the delta is what grew; a tool call is streamed whole, name
and arguments in one delta, once its closing delimiter has arrived.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from msgspec import UNSET

from gateway.openai_api.protocol import (
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from gateway.parsers import OutputParser, ParsedOutput, make_tool_call_id


@dataclass(frozen=True)
class ChatParsing:
    """How a request's output is parsed (None parser: plain content)."""

    parser: Optional[OutputParser] = None
    reasoning_open: bool = False  # the prompt left a reasoning block open
    tools_enabled: bool = False  # tools given, tool_choice not "none", auto tool choice on
    include_reasoning: bool = True
    parallel_tool_calls: bool = True  # False: only the first call is returned (vLLM's filter)

    def parse(self, text: str, final: bool) -> ParsedOutput:
        assert self.parser is not None
        parsed = self.parser.parse(text, reasoning_open=self.reasoning_open, tools_enabled=self.tools_enabled,
                                   final=final)
        if not self.include_reasoning and parsed.reasoning is not None:
            parsed = ParsedOutput(reasoning=None, content=parsed.content, tool_calls=parsed.tool_calls)
        if not self.parallel_tool_calls and len(parsed.tool_calls) > 1:
            parsed = ParsedOutput(reasoning=parsed.reasoning, content=parsed.content, tool_calls=parsed.tool_calls[:1])
        return parsed


def chat_message(text: str, parsing: ChatParsing, tool_call_ids: Optional[list[str]] = None) -> ChatMessage:
    """The assistant message of a finished choice (vLLM's chat_completion_full_generator)."""
    if parsing.parser is None:
        return ChatMessage(role="assistant", content=text)
    parsed = parsing.parse(text, final=True)
    ids = list(tool_call_ids or [])
    calls = []
    for i, call in enumerate(parsed.tool_calls):
        if i >= len(ids):
            ids.append(make_tool_call_id())
        calls.append(ToolCall(id=ids[i], function=FunctionCall(name=call.name, arguments=call.arguments)))
    return ChatMessage(role="assistant", content=parsed.content, tool_calls=calls, reasoning=parsed.reasoning)


def chat_finish_reason(engine_reason: Optional[str], tools_called: bool) -> str:
    """OpenAI's rule as vLLM applies it: a choice that called tools (auto) ends in "tool_calls"."""
    if tools_called:
        return "tool_calls"
    return engine_reason or "stop"


@dataclass
class ChatChoiceStream:
    """The streamed side of one choice: each new piece of text -> the delta to send (or None)."""

    parsing: ChatParsing
    text: str = ""
    previous: Optional[ParsedOutput] = None
    tool_call_ids: list[str] = field(default_factory=list)

    @property
    def tools_streamed(self) -> bool:
        return bool(self.tool_call_ids)

    def delta(self, new_text: str, finished: bool) -> Optional[DeltaMessage]:
        self.text += new_text
        if self.parsing.parser is None:
            return DeltaMessage(content=new_text)
        parsed = self.parsing.parse(self.text, final=finished)
        before = self.previous or ParsedOutput(reasoning=None, content=None, tool_calls=[])
        self.previous = parsed
        delta = DeltaMessage()
        reasoning = _grown(before.reasoning, parsed.reasoning)
        content = _grown(before.content, parsed.content)
        if reasoning:
            delta.reasoning = reasoning
        if content:
            delta.content = content
        new_calls = parsed.tool_calls[len(before.tool_calls):]
        if new_calls:
            delta.tool_calls = []
            for call in new_calls:
                index = len(self.tool_call_ids)
                self.tool_call_ids.append(make_tool_call_id())
                delta.tool_calls.append(DeltaToolCall(
                    index=index, id=self.tool_call_ids[index], type="function",
                    function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
        if delta.reasoning is UNSET and delta.content is UNSET and delta.tool_calls is UNSET:
            return None
        return delta


def _grown(before: Optional[str], after: Optional[str]) -> str:
    """The text ``after`` adds to ``before`` (nothing when the parse is not an extension)."""
    before, after = before or "", after or ""
    return after[len(before):] if after.startswith(before) else ""


def chat_parsing(renderer, chat, prompt_ids: Optional[list[int]]) -> ChatParsing:
    """How a chat request's output is parsed (reasoning, tool calls) by ``renderer``'s
    parser; no parsing without a parser or a chat request.  Shared by the derender routes
    and /generate's ``output_mode: "derender"``."""
    parser = renderer.parser
    if parser is None or chat is None:
        return ChatParsing()
    tools_enabled = bool(chat.tools) and chat.tool_choice in (None, "auto") and \
        renderer.options.enable_auto_tool_choice and bool(renderer.options.tool_call_parser)
    prompt_text = renderer.model.tokenizer.decode(prompt_ids or [], skip_special_tokens=False)
    kwargs = renderer.chat_template_kwargs(chat)
    return ChatParsing(parser, reasoning_open=parser.reasoning_open_at_start(prompt_text, kwargs),
                       tools_enabled=tools_enabled, include_reasoning=chat.include_reasoning,
                       parallel_tool_calls=chat.parallel_tool_calls is not False)
