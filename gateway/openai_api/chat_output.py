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
from gateway.parsers import forced_tool_calls as forced
from gateway.structured_outputs.tool_schema import forced_tool_choice


@dataclass(frozen=True)
class ChatParsing:
    """How a request's output is parsed (None parser: plain content)."""

    parser: Optional[OutputParser] = None
    reasoning_open: bool = False  # the prompt left a reasoning block open
    tools_enabled: bool = False  # tools given, tool_choice not "none", auto tool choice on
    include_reasoning: bool = True
    parallel_tool_calls: bool = True  # False: only the first call is returned (vLLM's filter)
    # A forced tool choice, whose output the grammar shapes as JSON (parsers/forced_tool_calls.py):
    # "required" (an array of calls) or "named" (the arguments of named_tool).
    forced_tool_choice: Optional[str] = None
    named_tool: Optional[str] = None

    @property
    def named(self) -> bool:
        return self.forced_tool_choice == "named"

    def finish_reason(self, engine_reason: Optional[str], tools_called: bool) -> str:
        """The choice's finish_reason; a forced choice follows vLLM 0.33's
        ``resolve_finish_reason`` ("tool_calls" only when the engine stopped on its own)."""
        if self.forced_tool_choice is not None:
            tools_called = tools_called and engine_reason == "stop"
        return chat_finish_reason(engine_reason, tools_called, self.named)

    @property
    def plain(self) -> bool:
        """Nothing to parse: the text is the content."""
        return self.parser is None and self.forced_tool_choice is None

    def split(self, text: str, final: bool) -> ParsedOutput:
        """Reasoning and content, and the tool parser's calls unless the tool choice is forced."""
        if self.parser is None:
            return ParsedOutput(reasoning=None, content=text, tool_calls=[])
        return self.parser.parse(text, reasoning_open=self.reasoning_open,
                                 tools_enabled=self.tools_enabled and self.forced_tool_choice is None, final=final)

    def parse(self, text: str, final: bool) -> ParsedOutput:
        parsed = self.split(text, final)
        if self.forced_tool_choice is not None:  # vLLM's _extract_tool_calls, required / named
            calls = (forced.parse_named(parsed.content, self.named_tool) if self.forced_tool_choice == "named"
                     else forced.parse_required(parsed.content))
            # What does not parse as calls (a "length" cut, a grammar failure) is still the
            # model's output: answered as content, where vLLM drops it.
            unparsed = parsed.content if not calls and parsed.content and parsed.content.strip() else None
            parsed = ParsedOutput(reasoning=parsed.reasoning, content=unparsed, tool_calls=calls)
        if not self.include_reasoning and parsed.reasoning is not None:
            parsed = ParsedOutput(reasoning=None, content=parsed.content, tool_calls=parsed.tool_calls)
        if not self.parallel_tool_calls and len(parsed.tool_calls) > 1:
            parsed = ParsedOutput(reasoning=parsed.reasoning, content=parsed.content, tool_calls=parsed.tool_calls[:1])
        return parsed


def chat_message(text: str, parsing: ChatParsing, tool_call_ids: Optional[list[str]] = None) -> ChatMessage:
    """The assistant message of a finished choice (vLLM's chat_completion_full_generator)."""
    if parsing.plain:
        return ChatMessage(role="assistant", content=text)
    parsed = parsing.parse(text, final=True)
    ids = list(tool_call_ids or [])
    calls = []
    for i, call in enumerate(parsed.tool_calls):
        if i >= len(ids):
            ids.append(make_tool_call_id())
        calls.append(ToolCall(id=ids[i], function=FunctionCall(name=call.name, arguments=call.arguments)))
    content = parsed.content
    if parsing.forced_tool_choice is not None:
        content = content or ""  # vLLM's assemble_chat_message_fields for a forced choice
    return ChatMessage(role="assistant", content=content, tool_calls=calls, reasoning=parsed.reasoning)


def chat_finish_reason(engine_reason: Optional[str], tools_called: bool, named: bool = False) -> str:
    """OpenAI's rule as vLLM applies it: a choice that called tools ends in "tool_calls" --
    except under a named tool_choice (vLLM 0.33's ``resolve_finish_reason``: OpenAI answers
    "stop" there; a "length" cut of a named call stays "length")."""
    if tools_called and not named:
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
        if self.parsing.plain:
            return DeltaMessage(content=new_text)
        if self.parsing.forced_tool_choice is not None:
            return self._forced_delta(finished)
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


    def _forced_delta(self, finished: bool) -> Optional[DeltaMessage]:
        """A forced tool choice streams its calls as the JSON grows (vLLM's
        ``extract_named_tool_call_streaming`` / ``extract_required_tool_call_streaming``):
        a call's first piece carries its id and name, later ones argument text only."""
        parsing = self.parsing
        parsed = parsing.split(self.text, finished)
        before = self.previous or ParsedOutput(reasoning=None, content=None, tool_calls=[])
        self.previous = parsed
        delta = DeltaMessage()
        reasoning = _grown(before.reasoning, parsed.reasoning)
        if reasoning and parsing.include_reasoning:
            delta.reasoning = reasoning
        old, new = before.content or "", parsed.content or ""
        if parsing.forced_tool_choice == "named":
            grown = _grown(old, new)
            pieces = [forced.ToolCallPiece(0, None if self.tool_call_ids else parsing.named_tool, grown)] \
                if grown else []
        else:
            pieces = forced.required_stream_pieces(old, new)
        if not parsing.parallel_tool_calls:
            pieces = [p for p in pieces if p.index == 0]
        calls = []
        for piece in pieces:
            if piece.name is not None:
                self.tool_call_ids.append(make_tool_call_id())
                calls.append(DeltaToolCall(index=piece.index, id=self.tool_call_ids[-1], type="function",
                                           function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments)))
            else:
                calls.append(DeltaToolCall(index=piece.index, function=DeltaFunctionCall(arguments=piece.arguments)))
        if calls:
            delta.tool_calls = calls
        if finished and not self.tool_call_ids and new.strip():
            # The output never became a call (the non-streamed answer's rule): its text is the content.
            delta.content = new
        if delta.reasoning is UNSET and delta.tool_calls is UNSET and delta.content is UNSET:
            return None
        return delta


def _grown(before: Optional[str], after: Optional[str]) -> str:
    """The text ``after`` adds to ``before`` (nothing when the parse is not an extension)."""
    before, after = before or "", after or ""
    return after[len(before):] if after.startswith(before) else ""


def chat_parsing(renderer, chat, prompt_ids: Optional[list[int]]) -> ChatParsing:
    """How a chat request's output is parsed (reasoning, tool calls) by ``renderer``'s
    parser and its forced tool choice; no parsing without either, or without a chat request.  Shared by the derender routes
    and /generate's ``output_mode: "derender"``."""
    parser = renderer.parser
    if chat is None:
        return ChatParsing()
    forced_choice, named = forced_tool_choice(chat.tools, chat.tool_choice)
    if parser is None:
        return ChatParsing(forced_tool_choice=forced_choice, named_tool=named,
                           parallel_tool_calls=chat.parallel_tool_calls is not False)
    tools_enabled = bool(chat.tools) and chat.tool_choice in (None, "auto") and \
        renderer.options.enable_auto_tool_choice and bool(renderer.options.tool_call_parser)
    prompt_text = renderer.model.tokenizer.decode(prompt_ids or [], skip_special_tokens=False)
    kwargs = renderer.chat_template_kwargs(chat)
    return ChatParsing(parser, reasoning_open=parser.reasoning_open_at_start(prompt_text, kwargs),
                       tools_enabled=tools_enabled, include_reasoning=chat.include_reasoning,
                       parallel_tool_calls=chat.parallel_tool_calls is not False,
                       forced_tool_choice=forced_choice, named_tool=named)
