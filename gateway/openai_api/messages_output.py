"""``/v1/messages`` answers from the workers' deltas, the relay's formatters
(gateway/relay.py), as vLLM 0.33's ``AnthropicServingMessages`` builds them from its chat
answer: ``MessagesCollector`` (``messages_full_converter``: one Message) and
``MessagesStream`` (``message_stream_converter``: Anthropic's event sequence).

The output text is parsed exactly as the chat route parses it (``ChatParsing``,
``chat_message`` / ``ChatChoiceStream`` of chat_output.py): reasoning -> a ``thinking``
block (its signature a random hex, as vLLM's: nothing here can verify one), content ->
a ``text`` block, tool calls -> ``tool_use`` blocks.  Stop reasons map as vLLM maps
them (stop -> ``end_turn``, length -> ``max_tokens``, tool_calls -> ``tool_use``), and a
stop on one of the request's ``stop_sequences`` is ``stop_sequence`` with the matched
string, as Anthropic answers (vLLM says ``end_turn`` there); a forced named call stops
with ``tool_use`` (vLLM: ``end_turn``).
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Iterator, Optional

from common.errors import ServingError
from common.protocol import CompletionDelta
from gateway.errors import MAX_ERROR_MESSAGE_CHARS, stream_error_json
from gateway.openai_api.chat_output import ChatChoiceStream, chat_message
from gateway.openai_api.protocol import json_encoder
from gateway.openai_api.render import RenderedChat
from gateway.relay import Generation, StreamFormatter, sse_event

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}

# Anthropic's error types by HTTP status (its SDK raises by status; the type names the case).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> bytes:
    """Anthropic's error body ``{"type": "error", "error": {"type", "message"}}``."""
    if len(message) > MAX_ERROR_MESSAGE_CHARS:
        message = message[:MAX_ERROR_MESSAGE_CHARS] + "..."
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return json_encoder.encode({"type": "error", "error": {"type": kind, "message": message}})


def anthropic_event(name: str, payload: Any) -> bytes:
    """One named SSE event (``event: <name>`` then its ``data:`` line)."""
    return b"event: " + name.encode() + b"\n" + sse_event(json_encoder.encode(payload))


def stop_reason(rendered: RenderedChat, engine_reason: Optional[str], stop: Any,
                tools_called: bool, stop_sequences: Optional[list[str]]) -> tuple[Optional[str], Optional[str]]:
    """(stop_reason, stop_sequence) of a finished message.  A message that ends in
    ``tool_use`` blocks stops with ``tool_use`` under a named tool choice too (``tool_choice:
    {"type": "tool"}``), as Anthropic answers and agents rely on to run the tool; vLLM's
    chat rule says ``stop`` there, which it maps to ``end_turn``."""
    if tools_called and engine_reason == "stop":
        return "tool_use", None
    reason = rendered.parsing.finish_reason(engine_reason, tools_called)
    if reason == "stop" and isinstance(stop, str) and stop in (stop_sequences or ()):
        return "stop_sequence", stop
    return _STOP_REASONS.get(reason), None


def _tool_input(arguments: str) -> Optional[dict]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def content_blocks(text: str, rendered: RenderedChat) -> tuple[list[dict], bool]:
    """The Message's content blocks from the whole output text, and whether it called tools.
    A call whose arguments are not a JSON object (a cut output) cannot be a ``tool_use``
    (its ``input`` is an object): it is answered as text, nothing the model wrote lost."""
    message = chat_message(text, rendered.parsing)
    blocks: list[dict] = []
    if message.reasoning:
        blocks.append({"type": "thinking", "thinking": message.reasoning, "signature": uuid.uuid4().hex})
    if message.content:
        blocks.append({"type": "text", "text": message.content})
    called = False
    for call in message.tool_calls:
        args = _tool_input(call.function.arguments)
        if args is None:
            blocks.append({"type": "text", "text": call.function.arguments})
            continue
        called = True
        blocks.append({"type": "tool_use", "id": call.id, "name": call.function.name, "input": args})
    return blocks, called


class MessagesCollector:
    """Non-stream (the relay's ``BodyFormatter``): the whole Message."""

    def __init__(self, run: Generation, rendered: RenderedChat, model: str, stop_sequences: Optional[list[str]]):
        self.run, self.rendered, self.model, self.stop_sequences = run, rendered, model, stop_sequences
        self.texts: list[str] = []
        self.num_generated = 0
        self.num_prompt = len(rendered.token_ids)
        self.finish: Optional[str] = None
        self.stop: Any = None

    def add(self, delta: CompletionDelta, run: int = 0) -> None:
        if delta.num_prompt_tokens:
            self.num_prompt = delta.num_prompt_tokens
        self.num_generated += len(delta.token_ids)
        if delta.text:
            self.texts.append(delta.text)
        if delta.finish_reason is not None:
            self.finish, self.stop = delta.finish_reason, delta.stop_reason

    def body(self) -> bytes:
        blocks, called = content_blocks("".join(self.texts), self.rendered)
        reason, sequence = stop_reason(self.rendered, self.finish, self.stop, called, self.stop_sequences)
        return json_encoder.encode({
            "id": self.rendered.request.request_id, "type": "message", "role": "assistant",
            "model": self.model, "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": self.num_prompt, "output_tokens": self.num_generated}})


class MessagesStream(StreamFormatter):
    """Stream: ``message_start``, ``ping``, then per block ``content_block_start``,
    its ``content_block_delta``s (``thinking_delta`` + a closing ``signature_delta``,
    ``text_delta``, ``input_json_delta``) and ``content_block_stop``; then
    ``message_delta`` (stop reason, usage) and ``message_stop``.  No ``[DONE]``."""

    done = b""

    def __init__(self, run: Generation, rendered: RenderedChat, model: str, stop_sequences: Optional[list[str]]):
        self.run, self.rendered, self.model, self.stop_sequences = run, rendered, model, stop_sequences
        self.choice = ChatChoiceStream(rendered.parsing)
        self.num_prompt = len(rendered.token_ids)
        self.num_generated = 0
        self.index = -1  # the open block's index
        self.block: Optional[str] = None  # the open block's type
        self.signature: Optional[str] = None
        self.tool_ids: dict[int, str] = {}
        self.tools_called = False
        self.finish: Optional[str] = None
        self.stop: Any = None

    def head(self) -> Iterator[bytes]:
        yield anthropic_event("message_start", {"type": "message_start", "message": {
            "id": self.rendered.request.request_id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.num_prompt, "output_tokens": 0}}})
        yield anthropic_event("ping", {"type": "ping"})

    def _close(self, out: list[bytes]) -> None:
        if self.block is None:
            return
        if self.block == "thinking":
            out.append(anthropic_event("content_block_delta", {
                "type": "content_block_delta", "index": self.index,
                "delta": {"type": "signature_delta", "signature": self.signature}}))
        out.append(anthropic_event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.block = None

    def _open(self, out: list[bytes], block: dict) -> None:
        self._close(out)
        self.index += 1
        self.block = block["type"]
        self.signature = uuid.uuid4().hex if self.block == "thinking" else None
        out.append(anthropic_event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                           "content_block": block}))

    def _delta(self, out: list[bytes], delta: dict) -> None:
        out.append(anthropic_event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                           "delta": delta}))

    def chunk(self, delta: CompletionDelta, run: int = 0) -> Optional[bytes]:
        if self.finish is not None:
            return None
        if delta.num_prompt_tokens:
            self.num_prompt = delta.num_prompt_tokens
        self.num_generated += len(delta.token_ids)
        done = delta.finish_reason is not None
        message = self.choice.delta(delta.text or "", done)
        out: list[bytes] = []
        if message is not None:
            if isinstance(message.reasoning, str) and message.reasoning:
                if self.block != "thinking":
                    self._open(out, {"type": "thinking", "thinking": ""})
                self._delta(out, {"type": "thinking_delta", "thinking": message.reasoning})
            if isinstance(message.content, str) and message.content:
                if self.block != "text":
                    self._open(out, {"type": "text", "text": ""})
                self._delta(out, {"type": "text_delta", "text": message.content})
            for call in message.tool_calls if isinstance(message.tool_calls, list) else ():
                arguments = getattr(call.function, "arguments", None)
                if isinstance(call.id, str):
                    self.tool_ids[call.index] = call.id
                    self.tools_called = True
                    self._open(out, {"type": "tool_use", "id": call.id, "name": getattr(call.function, "name", ""),
                                     "input": {}})
                if isinstance(arguments, str) and arguments and self.tool_ids.get(call.index) is not None:
                    self._delta(out, {"type": "input_json_delta", "partial_json": arguments})
        if done:
            self.finish, self.stop = delta.finish_reason, delta.stop_reason
            self._close(out)
        return b"".join(out) or None

    def final(self) -> Optional[bytes]:
        reason, sequence = stop_reason(self.rendered, self.finish, self.stop,
                                       self.tools_called and self.finish == "stop", self.stop_sequences)
        return anthropic_event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"input_tokens": self.num_prompt, "output_tokens": self.num_generated}}) + \
            anthropic_event("message_stop", {"type": "message_stop"})

    def error_chunk(self, exc: Exception, what: str) -> tuple[int, bytes]:
        status, _ = stream_error_json(exc, what)  # logs the unexpected ones
        message = exc.message if isinstance(exc, ServingError) else f"Internal server error: {type(exc).__name__}"
        return status, b"event: error\n" + sse_event(anthropic_error(status, message))
