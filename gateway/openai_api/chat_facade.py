"""``/v1/chat/completions`` responses from the workers' deltas, the relay's formatters
(gateway/relay.py): vLLM 0.32's ``chat_completion_full_generator`` (``ChatCollector``:
one ChatCompletion) and ``chat_completion_stream_generator`` (``ChatStream``: a role
chunk per choice, then one chunk per delta, then the usage chunk)."""
from __future__ import annotations

from typing import Iterator, Optional

import msgspec

from common.protocol import CompletionDelta
from gateway.generate_api import logprobs_format
from gateway.generate_api.logprobs_format import chat_logprobs
from gateway.openai_api.chat_output import ChatChoiceStream, chat_message
from gateway.openai_api.facade import ResponseView, now, request_metrics
from gateway.openai_api.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
    json_encoder,
    prompt_tokens_details,
)
from gateway.openai_api.sampling import sent
from gateway.openai_api.render import RenderedChat
from gateway.generate_api.response_builder import routed_experts_b64, stream_metrics
from gateway.relay import Generation, StreamFormatter, sse_event


class ChatCollector:
    """Non-stream (the relay's ``BodyFormatter``): gathers every choice, then builds the ChatCompletion."""

    def __init__(self, run: Generation, view: ResponseView, rendered: RenderedChat, model: str):
        self.run, self.view, self.rendered, self.model = run, view, rendered, model
        self.kv_transfer_params = self.ec_transfer_params = None
        n = view.n
        self.texts = [[] for _ in range(n)]
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list] = [[] for _ in range(n)]
        self.finish: list[Optional[str]] = [None] * n
        self.stop: list = [None] * n
        self.routed: list[Optional[str]] = [None] * n
        self.num_prompt_tokens = len(rendered.token_ids)
        self.num_cached_tokens: Optional[int] = None
        self.prompt_logprobs = None

    def add(self, delta: CompletionDelta, run: int = 0) -> None:
        if delta.kv_transfer_params is not None:
            self.kv_transfer_params = delta.kv_transfer_params
        if delta.ec_transfer_params is not None:
            self.ec_transfer_params = delta.ec_transfer_params
        i = delta.index
        if delta.num_prompt_tokens:
            self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = logprobs_format.prompt_logprobs(
                delta.prompt_logprobs, sent(self.rendered.request.sampling_params.prompt_logprobs))
        self.ids[i].extend(delta.token_ids)
        if delta.text:
            self.texts[i].append(delta.text)
        lp = chat_logprobs(delta, self.view.top_logprobs, self.view.tokens_as_token_ids)
        if lp:
            self.logprobs[i].extend(lp)
        if self.view.routed_experts and delta.routed_experts is not None:  # on the finishing delta
            self.routed[i] = routed_experts_b64(delta)
        if delta.finish_reason is not None:
            self.finish[i], self.stop[i] = delta.finish_reason, delta.stop_reason

    @property
    def num_generated(self) -> int:
        return sum(len(ids) for ids in self.ids)

    def body(self) -> bytes:
        metrics = request_metrics([self.run], self.view, self.num_generated)
        choices = []
        for i in range(self.view.n):
            message = chat_message("".join(self.texts[i]), self.rendered.parsing)
            if self.view.echo and self.rendered.last_message_text:
                message.content = self.rendered.last_message_text + (message.content or "")
            choices.append(ChatChoice(
                index=i, message=message,
                logprobs=ChatLogprobs(content=self.logprobs[i]) if self.view.top_logprobs is not None else None,
                finish_reason=self.rendered.parsing.finish_reason(self.finish[i], bool(message.tool_calls)),
                stop_reason=self.stop[i],
                token_ids=self.ids[i] if self.view.return_token_ids else None,
                routed_experts=self.routed[i]))
        completion = self.num_generated
        body = ChatCompletionResponse(
            id=self.rendered.request.request_id, created=now(), model=self.model, choices=choices,
            usage=UsageInfo(prompt_tokens=self.num_prompt_tokens, total_tokens=self.num_prompt_tokens + completion,
                            completion_tokens=completion,
                            prompt_tokens_details=prompt_tokens_details(
                                self.view.prompt_tokens_details, self.num_cached_tokens, stream=False)),
            prompt_logprobs=self.prompt_logprobs,
            prompt_token_ids=self.rendered.token_ids if self.view.return_token_ids else None,
            prompt_text=self.rendered.prompt_text if self.view.return_prompt_text else None,
            kv_transfer_params=self.kv_transfer_params, ec_transfer_params=self.ec_transfer_params, metrics=metrics)
        return json_encoder.encode(body)


class ChatStream(StreamFormatter):
    """Stream (the relay's ``StreamFormatter``): role chunks, a chunk per delta, the usage chunk."""

    def __init__(self, run: Generation, view: ResponseView, rendered: RenderedChat, model: str):
        self.run, self.view, self.rendered, self.model = run, view, rendered, model
        self.request_id = rendered.request.request_id
        self.created = 0
        self.num_prompt = len(rendered.token_ids)
        self.num_cached_tokens: Optional[int] = None
        self.streams = [ChatChoiceStream(rendered.parsing) for _ in range(view.n)]
        self.generated = [0] * view.n
        self.finished = [False] * view.n

    def _chunk(self, choice: ChatStreamChoice, usage=msgspec.UNSET, **extra) -> bytes:
        return sse_event(json_encoder.encode(ChatCompletionStreamResponse(
            id=self.request_id, created=self.created, model=self.model, choices=[choice], usage=usage, **extra)))

    def _running_usage(self, i: int):
        if not self.view.continuous_usage:
            return msgspec.UNSET
        return UsageInfo(prompt_tokens=self.num_prompt, completion_tokens=self.generated[i],
                         total_tokens=self.num_prompt + self.generated[i])

    def head(self) -> Iterator[bytes]:
        view, rendered = self.view, self.rendered
        self.created = now()
        for i in range(view.n):
            yield self._chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""),
                                               logprobs=None),
                              usage=self._running_usage(i),
                              prompt_token_ids=rendered.token_ids if view.return_token_ids else None,
                              prompt_text=rendered.prompt_text if view.return_prompt_text else None)
        if view.echo and rendered.last_message_text:
            for i in range(view.n):
                yield self._chunk(ChatStreamChoice(index=i, delta=DeltaMessage(content=rendered.last_message_text)),
                                  usage=self._running_usage(i))

    def chunk(self, delta: CompletionDelta, run: int = 0) -> Optional[bytes]:
        view = self.view
        i = delta.index
        if self.finished[i]:
            return None
        if delta.num_prompt_tokens:
            self.num_prompt = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        self.generated[i] += len(delta.token_ids)
        done = delta.finish_reason is not None
        stream = self.streams[i]
        message = stream.delta(delta.text or "", done)
        lp = chat_logprobs(delta, view.top_logprobs, view.tokens_as_token_ids)
        logprobs = ChatLogprobs(content=lp) if lp is not None else None
        token_ids = delta.token_ids if view.return_token_ids else None
        if message is None:
            if not done and logprobs is None and not view.return_token_ids:
                return None
            message = DeltaMessage()
        if not done:
            choice = ChatStreamChoice(index=i, delta=message, logprobs=logprobs, finish_reason=None,
                                      token_ids=token_ids)
        else:
            self.finished[i] = True
            reason = self.rendered.parsing.finish_reason(delta.finish_reason, stream.tools_streamed
                                                         and delta.finish_reason == "stop")
            choice = ChatStreamChoice(index=i, delta=message, logprobs=logprobs, finish_reason=reason,
                                      stop_reason=delta.stop_reason, token_ids=token_ids)
        return self._chunk(choice, usage=self._running_usage(i))

    def final(self) -> Optional[bytes]:
        if not self.view.include_usage:
            return None
        completion = sum(self.generated)
        usage = UsageInfo(prompt_tokens=self.num_prompt, completion_tokens=completion,
                          total_tokens=self.num_prompt + completion,
                          prompt_tokens_details=prompt_tokens_details(self.view.prompt_tokens_details,
                                                                      self.num_cached_tokens, stream=True),
                          completion_tokens_details=msgspec.UNSET)
        return sse_event(json_encoder.encode(ChatCompletionStreamResponse(
            id=self.request_id, created=self.created, model=self.model, choices=[], usage=usage,
            metrics=stream_metrics(request_metrics([self.run], self.view, completion)))))
