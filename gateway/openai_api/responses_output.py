"""``/v1/responses`` answers from the workers' deltas, the relay's formatters
(gateway/relay.py), shaped as vLLM 0.33's ``OpenAIServingResponses`` answers without
harmony: ``ResponsesCollector`` (``responses_full_generator``: one Response) and
``ResponsesStream`` (its simple streaming events, each with a ``sequence_number``).

The output text is parsed exactly as the chat route parses it (``ChatParsing`` through
``chat_message`` / ``ChatChoiceStream``): reasoning -> a ``reasoning`` item
(``reasoning_text`` content), content -> a ``message`` item (one ``output_text`` part,
with logprobs when ``include`` asks for ``message.output_text.logprobs``), tool calls ->
``function_call`` items; in that order.  A ``length`` stop makes the response
``incomplete`` (``incomplete_details.reason = "max_output_tokens"``).  Usage counts the
prompt's prefix-cache hits (``cached_tokens``) and the output tokens spent inside the
reasoning markers (``reasoning_tokens``, vLLM's ``count_reasoning_tokens``).

``on_done(response)`` is called with the finished Response (the store keeps it).
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import msgspec

from common.errors import ServingError
from common.protocol import CompletionDelta
from gateway.errors import stream_error_json
from gateway.generate_api.logprobs_format import chat_logprobs
from gateway.openai_api.chat_output import ChatChoiceStream, chat_message
from gateway.openai_api.protocol import json_encoder
from gateway.openai_api.render import RenderedChat
from gateway.openai_api.sampling import sent
from gateway.relay import Generation, StreamFormatter, sse_event

OnDone = Callable[[dict], None]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ReasoningCounter:
    """Output tokens inside the reasoning markers (vLLM's ``count_reasoning_tokens``):
    ``markers`` the (start, end) ids of a reasoning parser's tags, None without one;
    generation starts inside reasoning where the prompt left it open."""

    def __init__(self, markers: Optional[tuple[int, int]], starts_open: bool):
        self.markers = markers
        self.depth = 1 if markers is not None and starts_open else 0
        self.count = 0

    def add(self, token_ids: list[int]) -> None:
        if self.markers is None:
            return
        start, end = self.markers
        for t in token_ids:
            if t == start:
                self.depth += 1
            elif t == end:
                self.depth = max(self.depth - 1, 0)
            elif self.depth:
                self.count += 1


@dataclass
class ResponseContext:
    """What of the request and the server shapes the Response object."""

    request: Any  # responses_messages.ResponsesRequest
    response_id: str
    model: str
    rendered: RenderedChat
    markers: Optional[tuple[int, int]] = None  # reasoning start/end token ids
    # A counter of the reasoning tokens for output formats without markers (harmony's channels):
    # called once per choice; None: ReasoningCounter over ``markers``.
    reasoning_counter: Optional[Callable[[], Any]] = None
    top_logprobs: Optional[int] = None  # None: no logprobs in the output
    tokens_as_token_ids: bool = False
    created: int = 0

    def response(self, status: str, output: list, usage: Optional[dict],
                 messages: Optional[tuple[list, list]] = None) -> dict:
        """vLLM's ``ResponsesResponse.from_request``; ``messages``: the raw input and
        output messages (``enable_response_messages``)."""
        request, params = self.request, self.rendered.request.sampling_params
        return {
            "id": self.response_id, "object": "response", "created_at": self.created, "status": status,
            "background": bool(request.background), "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": sent(params.max_tokens),
            "max_tool_calls": None, "metadata": request.metadata, "model": self.model, "output": output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id, "prompt": None,
            "reasoning": request.reasoning, "service_tier": "auto", "store": bool(request.store),
            "temperature": sent(params.temperature), "text": request.text or {"format": {"type": "text"}},
            "tool_choice": request.tool_choice, "tools": request.tools, "top_logprobs": request.top_logprobs,
            "top_p": sent(params.top_p), "truncation": request.truncation or "disabled", "usage": usage,
            "user": request.user, "input_messages": messages[0] if messages else None,
            "output_messages": messages[1] if messages else None}

    def raw_messages(self, output_text: str, output_ids: list[int]) -> Optional[tuple[list, list]]:
        """vLLM's ``ResponseRawMessageAndToken`` pair for ``enable_response_messages``: the
        prompt as rendered and tokenized, the output as generated (tokens are the source
        of truth where text and tokens diverge)."""
        if not self.request.enable_response_messages:
            return None
        rendered = self.rendered
        return ([raw_message(rendered.prompt_text or "", list(rendered.token_ids))],
                [raw_message(output_text, output_ids)] if output_text or output_ids else [])


def raw_message(text: str, tokens: list[int]) -> dict:
    return {"message": text, "tokens": tokens, "type": "raw_message_tokens"}


def usage(num_prompt: int, num_generated: int, cached: int, reasoning: int) -> dict:
    return {"input_tokens": num_prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": num_generated, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": num_prompt + num_generated}


def _status(finish: Optional[str]) -> str:
    return "incomplete" if finish == "length" else "completed"


def reasoning_item(item_id: str, text: str) -> dict:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None, "status": None}


def message_item(item_id: str, text: str, logprobs: Optional[list], status: str = "completed") -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(text: str, rendered: RenderedChat, logprobs: Optional[list]) -> list[dict]:
    """vLLM's ``_make_response_output_items``: reasoning, message, function calls."""
    message = chat_message(text, rendered.parsing)
    items = []
    if message.reasoning:
        items.append(reasoning_item(_id("rs"), message.reasoning))
    if message.content:
        items.append(message_item(_id("msg"), message.content, logprobs))
    for call in message.tool_calls:
        items.append(call_item(_id("fc"), call.id, call.function.name, call.function.arguments))
    return items


class _Counts:
    def __init__(self, ctx: ResponseContext):
        self.ctx = ctx
        self.num_prompt = len(ctx.rendered.token_ids)
        self.num_generated = 0
        self.cached = 0
        self.reasoning = (ctx.reasoning_counter() if ctx.reasoning_counter is not None
                          else ReasoningCounter(ctx.markers, ctx.rendered.parsing.reasoning_open))
        self.logprobs: list = []
        self.finish: Optional[str] = None
        self.token_ids: list[int] = []  # the output's ids (enable_response_messages)
        self.text: list[str] = []

    def add(self, delta: CompletionDelta) -> Optional[list]:
        """Counts one delta; its logprob entries (as dicts) when asked for."""
        if delta.num_prompt_tokens:
            self.num_prompt = delta.num_prompt_tokens
        self.cached = delta.num_cached_tokens or self.cached
        self.num_generated += len(delta.token_ids)
        self.reasoning.add(delta.token_ids)
        if self.ctx.request.enable_response_messages:
            self.token_ids.extend(delta.token_ids)
            if delta.text:
                self.text.append(delta.text)
        if delta.finish_reason is not None:
            self.finish = delta.finish_reason
        lp = chat_logprobs(delta, self.ctx.top_logprobs, self.ctx.tokens_as_token_ids)
        if lp is None:
            return None
        entries = msgspec.to_builtins(lp)
        self.logprobs.extend(entries)
        return entries

    def usage(self) -> dict:
        return usage(self.num_prompt, self.num_generated, self.cached, self.reasoning.count)


class ResponsesCollector:
    """Non-stream (the relay's ``BodyFormatter``): the whole Response."""

    def __init__(self, run: Generation, ctx: ResponseContext, on_done: Optional[OnDone] = None):
        self.run, self.ctx, self.on_done = run, ctx, on_done
        self.counts = _Counts(ctx)
        self.texts: list[str] = []

    def add(self, delta: CompletionDelta, run: int = 0) -> None:
        self.counts.add(delta)
        if delta.text:
            self.texts.append(delta.text)

    def response(self) -> dict:
        counts = self.counts
        logprobs = counts.logprobs if self.ctx.top_logprobs is not None else None
        text = "".join(self.texts)
        response = self.ctx.response(_status(counts.finish), output_items(text, self.ctx.rendered, logprobs),
                                     counts.usage(), self.ctx.raw_messages(text, counts.token_ids))
        if self.on_done is not None:
            self.on_done(response)
        return response

    def body(self) -> bytes:
        return json_encoder.encode(self.response())


class ResponsesStream(StreamFormatter):
    """Stream: ``response.created``, ``response.in_progress``; per output item
    ``response.output_item.added``, its content (``response.content_part.added``, the
    ``response.reasoning_text.delta`` / ``response.output_text.delta`` /
    ``response.function_call_arguments.delta`` events and their ``.done``,
    ``response.content_part.done``), ``response.output_item.done``; then
    ``response.completed`` with the whole Response (the same item ids).  Every event
    has the next ``sequence_number``; named (``event: <type>``) as vLLM sends them.
    No ``[DONE]``: ``response.completed`` ends it (vLLM sends none either)."""

    done = b""

    def __init__(self, run: Generation, ctx: ResponseContext, on_done: Optional[OnDone] = None):
        self.run, self.ctx, self.on_done = run, ctx, on_done
        self.counts = _Counts(ctx)
        self.choice = ChatChoiceStream(ctx.rendered.parsing)
        self.sequence = 0
        self.output: list[dict] = []  # finished items
        self.item: Optional[dict] = None  # the open item
        self.text = ""  # the open item's text (reasoning, output text or arguments)
        self.item_logprobs: list = []
        # Logprob entries of tokens whose text has not reached an output_text delta yet (a
        # partial character, a held-back tag, reasoning): sent with the next one, so the
        # deltas carry every token's entry, as the non-streamed output_text does.
        self.pending_logprobs: list = []

    def _event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\n" + sse_event(json_encoder.encode(payload))

    def head(self) -> Iterator[bytes]:
        response = self.ctx.response("in_progress", [], None)
        yield self._event("response.created", response=response)
        yield self._event("response.in_progress", response=response)

    # ---- items
    def _index(self) -> int:
        return len(self.output)

    def _open(self, out: list[bytes], item: dict) -> None:
        self._close(out)
        self.item, self.text, self.item_logprobs = item, "", []
        index = self._index()
        out.append(self._event("response.output_item.added", output_index=index, item=item))
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                          "logprobs": []}))
        elif item["type"] == "reasoning":
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part={"type": "reasoning_text", "text": ""}))

    def _close(self, out: list[bytes]) -> None:
        item = self.item
        if item is None:
            return
        index, text = self._index(), self.text
        if item["type"] == "message":
            if self.pending_logprobs:  # tokens that added no text (yet): their entries still go out
                out.append(self._event("response.output_text.delta", item_id=item["id"], output_index=index,
                                       content_index=0, delta="", logprobs=self.pending_logprobs))
                self.item_logprobs.extend(self.pending_logprobs)
                self.pending_logprobs = []
            logprobs = self.item_logprobs if self.ctx.top_logprobs is not None else None
            done = message_item(item["id"], text, logprobs)
            out.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=text, logprobs=logprobs or []))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=done["content"][0]))
        elif item["type"] == "reasoning":
            done = reasoning_item(item["id"], text)
            out.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=text))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=done["content"][0]))
        else:
            done = call_item(item["id"], item["call_id"], item["name"], text)
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=text))
        out.append(self._event("response.output_item.done", output_index=index, item=done))
        self.output.append(done)
        self.item = None

    def _kind(self) -> Optional[str]:
        return None if self.item is None else self.item["type"]

    def chunk(self, delta: CompletionDelta, run: int = 0) -> Optional[bytes]:
        if self.counts.finish is not None:
            return None
        self.pending_logprobs.extend(self.counts.add(delta) or ())
        done = delta.finish_reason is not None
        message = self.choice.delta(delta.text or "", done)
        out: list[bytes] = []
        if message is not None:
            if isinstance(message.reasoning, str) and message.reasoning:
                if self._kind() != "reasoning":
                    self._open(out, {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [],
                                     "encrypted_content": None, "status": "in_progress"})
                self.text += message.reasoning
                out.append(self._event("response.reasoning_text.delta", item_id=self.item["id"],
                                       output_index=self._index(), content_index=0, delta=message.reasoning))
            if isinstance(message.content, str) and message.content:
                if self._kind() != "message":
                    self._open(out, message_item(_id("msg"), "", None, status="in_progress") | {"content": []})
                self.text += message.content
                entries, self.pending_logprobs = self.pending_logprobs, []
                self.item_logprobs.extend(entries)
                out.append(self._event("response.output_text.delta", item_id=self.item["id"],
                                       output_index=self._index(), content_index=0, delta=message.content,
                                       logprobs=entries))
            for call in message.tool_calls if isinstance(message.tool_calls, list) else ():
                arguments = getattr(call.function, "arguments", None)
                if isinstance(call.id, str):
                    self._open(out, call_item(_id("fc"), call.id, getattr(call.function, "name", "") or "", "",
                                              status="in_progress"))
                if isinstance(arguments, str) and arguments and self._kind() == "function_call":
                    self.text += arguments
                    out.append(self._event("response.function_call_arguments.delta", item_id=self.item["id"],
                                           output_index=self._index(), delta=arguments))
        if done:
            self._close(out)
        return b"".join(out) or None

    def final(self) -> Optional[bytes]:
        output = self.output
        if self.ctx.top_logprobs is not None:
            # The message's output_text carries every output token's entry (tool-call
            # tokens after it included), as the non-streamed Response's does.
            output = [message_item(i["id"], i["content"][0]["text"], list(self.counts.logprobs))
                      if i["type"] == "message" else i for i in output]
        response = self.ctx.response(_status(self.counts.finish), output, self.counts.usage(),
                                     self.ctx.raw_messages("".join(self.counts.text), self.counts.token_ids))
        if self.on_done is not None:
            self.on_done(response)
        return self._event("response.completed", response=response)

    def error_chunk(self, exc: Exception, what: str) -> tuple[int, bytes]:
        status, _ = stream_error_json(exc, what)
        message = exc.message if isinstance(exc, ServingError) else f"Internal server error: {type(exc).__name__}"
        code = exc.type if isinstance(exc, ServingError) else "server_error"
        return status, self._event("error", code=code, message=message, param=None)
