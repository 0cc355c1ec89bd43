"""``/v1/chat/completions/derender`` and ``/v1/completions/derender``: generate responses
(``output_mode: "tokens"``) -> OpenAI objects, decoded and parsed here (vLLM 0.32's
``ServingDerender`` / ``OnlineDerenderer``).

Non-stream takes a whole generate response; stream takes one generate chunk plus the
``stream_state`` the client carries between calls.  Plain streams carry the bounded
decode window; with a reasoning / tool-call parser the state carries every output id
and each call re-decodes and re-parses them (parsers keep no state across calls), as
vLLM does.  Text assembly is shared with the facade (gateway/openai_api/chat_output.py),
so a derendered response equals what ``/v1/chat/completions`` answers for the same tokens.
"""
from __future__ import annotations

from typing import Any, Optional

import msgspec

from common.errors import BadRequest
from gateway.generate_api.protocol import PerRequestMetrics, PromptLogprob
from gateway.openai_api.chat_output import (ChatChoiceStream, ChatParsing, chat_message,
                                          chat_parsing)
from gateway.openai_api.completion_facade import completion_logprobs
from gateway.openai_api.facade import now
from gateway.openai_api.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    DerenderRequest,
    DerenderStreamState,
    UsageInfo,
)
from gateway.openai_api.render import Renderer
from gateway.openai_api.token_text import (
    ChoiceDecoder,
    ends_on_stop_token,
    logprob_context_tail,
    resolve_token_logprobs,
)

MAX_CHOICES = 1024  # vLLM's VLLM_MAX_N_SEQUENCES default


class _Choice(msgspec.Struct):
    index: int
    token_ids: Optional[list[int]] = None
    finish_reason: Optional[str] = None
    stop_reason: Any = None
    logprobs: Optional[dict] = None


class _Generated(msgspec.Struct):
    """The parts of a tokens-mode generate response / chunk that derender reads."""

    request_id: str
    choices: list[_Choice]
    output_mode: str = "tokens"
    usage: Optional[dict] = None
    prompt_token_ids: Optional[list[int]] = None
    prompt_logprobs: Optional[list[Optional[dict[int, PromptLogprob]]]] = None
    metrics: Optional[PerRequestMetrics] = None
    kv_transfer_params: Optional[dict] = None
    ec_transfer_params: Optional[dict] = None


MAX_TOKEN_ID = 2**32 - 1  # the tokenizer's id type (u32): past it decoding cannot even start


def _bad_id(ids: Optional[list]) -> Optional[int]:
    """The first id no tokenizer has (negative, or past u32), if any."""
    return next((t for t in ids or () if not 0 <= t <= MAX_TOKEN_ID), None)


def _generated(raw: Optional[dict], name: str, where: Optional[str] = None) -> _Generated:
    """``where``: the payload's place in the body, vLLM's loc form (``generate_responses.0``)."""
    if raw is None:
        raise BadRequest(f"`{name}` is required", name)
    where = f"body.{where or name}"
    try:
        gen = msgspec.convert(raw, _Generated, strict=False)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"{name}: {exc}", name) from None
    if gen.output_mode != "tokens":
        raise BadRequest("Only output_mode='tokens' generate responses can be derendered: other modes are already "
                         "detokenized.", name)
    # vLLM's GenerateChoiceBase / NonNegativeInt validators: a 400, not a failed decode.
    for i, c in enumerate(gen.choices):
        bad = _bad_id(c.token_ids)
        if bad is not None:
            raise BadRequest(f"Value error, token_ids must not contain negative values (got {bad})" if bad < 0 else
                             f"token id {bad} is out of range", f"{where}.choices.{i}.token_ids")
    bad = _bad_id(gen.prompt_token_ids)
    if bad is not None:
        raise BadRequest(f"Input should be greater than or equal to 0 (got {bad})" if bad < 0 else
                         f"token id {bad} is out of range",
                         f"{where}.prompt_token_ids.{gen.prompt_token_ids.index(bad)}")
    return gen


def _request(raw: Optional[dict], kind: type, name: str):
    if raw is None:
        return None
    try:
        return msgspec.convert(raw, kind, strict=False)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"{name}: {exc}", name) from None


def _ids(raw: Any, name: str) -> Optional[list[int]]:
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID
                                            for t in raw):
        raise BadRequest(f"`{name}` must be a list of non-negative token ids", name)
    return raw


class Derenderer:
    def __init__(self, renderer: Renderer, max_model_len: int, max_logprobs: int = 20):
        self.renderer = renderer
        self.tokenizer = renderer.model.tokenizer
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs

    # ------------------------------------------------------------------ shared
    def _bounds(self, gens: list[_Generated]) -> None:
        if len(gens) > MAX_CHOICES:
            raise BadRequest(f"generate_responses count ({len(gens)}) exceeds server maximum ({MAX_CHOICES}).")
        for gen in gens:
            if len(gen.choices) > MAX_CHOICES:
                raise BadRequest(f"choices count ({len(gen.choices)}) in response '{gen.request_id}' exceeds "
                                 f"server maximum ({MAX_CHOICES}).")
            for c in gen.choices:
                if c.token_ids and len(c.token_ids) > self.max_model_len:
                    raise BadRequest(f"token_ids length ({len(c.token_ids)}) in choice {c.index} exceeds "
                                     f"max_model_len ({self.max_model_len}).")
                content = (c.logprobs or {}).get("content") or []
                if len(content) > self.max_model_len:
                    raise BadRequest(f"logprobs.content length ({len(content)}) in choice {c.index} exceeds "
                                     f"max_model_len ({self.max_model_len}).")
                for entry in content:
                    if len(entry.get("top_logprobs") or []) > self.max_logprobs:
                        raise BadRequest(f"top_logprobs count ({len(entry['top_logprobs'])}) in choice {c.index} "
                                         f"exceeds max_logprobs ({self.max_logprobs}).")

    def _prompt_ids(self, ids: Optional[list[int]]) -> Optional[list[int]]:
        if ids is not None and len(ids) > self.max_model_len:
            raise BadRequest(f"prompt_token_ids length ({len(ids)}) exceeds max_model_len ({self.max_model_len}).")
        return ids

    def _logprobs(self, choice: _Choice, context=()) -> Optional[list]:
        if choice.logprobs is None:
            return None
        content = choice.logprobs.get("content")
        if content is None:
            return []
        try:
            for entry in content:
                for tid in [entry["token_id"]] + [t["token_id"] for t in entry.get("top_logprobs") or ()]:
                    if not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid <= MAX_TOKEN_ID:
                        raise BadRequest(f"malformed logprobs in choice {choice.index}: token_id {tid!r} is not a "
                                         "token id", "logprobs")
            return resolve_token_logprobs(content, self.tokenizer, context)
        except (KeyError, TypeError) as exc:
            raise BadRequest(f"malformed logprobs in choice {choice.index}: {exc!r}", "logprobs") from None

    def _chat_parsing(self, chat: Optional[ChatCompletionRequest], prompt_ids: Optional[list[int]]) -> ChatParsing:
        return chat_parsing(self.renderer, chat, prompt_ids)

    def _decode_params(self, request, parsed: bool) -> tuple[bool, bool]:
        skip = False if parsed else (request.skip_special_tokens if request is not None else True)
        spaces = request.spaces_between_special_tokens if request is not None else True
        return skip, spaces or skip

    def _model(self, requested: Optional[str], served: str) -> str:
        return requested or served

    def _require_parser_inputs(self, chat, prompt_ids, stream: bool) -> None:
        if self.renderer.parser is None:
            return
        if chat is None:
            raise BadRequest("chat_request is required when a tool or reasoning parser is configured because plain "
                             "detokenization would leak raw parser markup into content.", "chat_request")
        if stream and prompt_ids is None:
            raise BadRequest("prompt_token_ids is required when a tool or reasoning parser is configured. Without "
                             "it parse_delta cannot tell whether the prompt left reasoning open (e.g. a chat "
                             "template that pre-opens <think>) and would misclassify reasoning content as plain "
                             "content.", "prompt_token_ids")

    # ------------------------------------------------------------------ chat
    def chat(self, body: DerenderRequest, served_model: str) -> bytes:
        gen = _generated(body.generate_response, "generate_response")
        self._bounds([gen])
        prompt_ids = self._prompt_ids(_ids(body.prompt_token_ids, "prompt_token_ids")) or gen.prompt_token_ids
        chat = _request(body.chat_request, ChatCompletionRequest, "chat_request")
        self._require_parser_inputs(chat, prompt_ids, stream=False)
        parsing = self._chat_parsing(chat, prompt_ids)
        skip, spaces = self._decode_params(chat, parsing.parser is not None)
        choices = []
        for c in gen.choices:
            if not c.token_ids:
                raise BadRequest(f"choice {c.index} has empty or null token_ids")
            decoder = ChoiceDecoder(self.tokenizer, prompt_ids, skip, spaces)
            text = decoder.feed(c.token_ids, stop_terminated=ends_on_stop_token(c.finish_reason, c.stop_reason))
            message = chat_message(text, parsing)
            lp = self._logprobs(c)
            return_ids = chat is not None and chat.return_token_ids
            choices.append(ChatChoice(
                index=c.index, message=message, logprobs=ChatLogprobs(content=lp) if lp is not None else None,
                finish_reason=parsing.finish_reason(c.finish_reason, bool(message.tool_calls)),
                stop_reason=c.stop_reason, token_ids=c.token_ids if return_ids else None))
        prompt_tokens = body.prompt_tokens if isinstance(body.prompt_tokens, int) else 0
        completion = sum(len(c.token_ids or []) for c in gen.choices)
        return msgspec.json.encode(ChatCompletionResponse(
            id=gen.request_id, created=now(), model=self._model(body.model, served_model), choices=choices,
            usage=UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                            total_tokens=prompt_tokens + completion),
            prompt_logprobs=gen.prompt_logprobs, kv_transfer_params=gen.kv_transfer_params,
            ec_transfer_params=gen.ec_transfer_params, metrics=gen.metrics))

    def chat_stream(self, body: DerenderRequest, served_model: str) -> bytes:
        gen = _generated(body.generate_chunk, "generate_chunk")
        chat = _request(body.chat_request, ChatCompletionRequest, "chat_request")
        prompt_ids = _ids(body.prompt_token_ids, "prompt_token_ids")
        self._require_parser_inputs(chat, prompt_ids, stream=True)
        if len(gen.choices) > 1:
            raise BadRequest(f"derender_chat_stream expects at most one choice per chunk (got {len(gen.choices)}).")
        state = body.stream_state
        if state is not None and sum(state.output_chunk_lens) != len(state.output_token_ids):
            raise BadRequest("stream_state: output_chunk_lens must sum to len(output_token_ids)", "stream_state")
        prior = len(state.output_token_ids) if state else 0
        delta_len = sum(len(c.token_ids or []) for c in gen.choices)
        if len(prompt_ids or []) + prior + delta_len > self.max_model_len:
            raise BadRequest(f"prompt_token_ids length ({len(prompt_ids or [])}) plus output_token_ids length "
                             f"({prior}) plus delta ({delta_len}) exceeds max_model_len ({self.max_model_len}).")
        prompt_ids = prompt_ids if prompt_ids is not None else gen.prompt_token_ids
        parsing = self._chat_parsing(chat, prompt_ids)
        skip, spaces = self._decode_params(chat, parsing.parser is not None)
        state = state or DerenderStreamState()
        choices = []
        for c in gen.choices:
            new_ids = c.token_ids or []
            finished = c.finish_reason is not None
            stop_terminated = finished and ends_on_stop_token(c.finish_reason, c.stop_reason)
            lp = self._logprobs(c, state.logprob_context_token_ids)
            decoder = ChoiceDecoder(self.tokenizer, prompt_ids, skip, spaces)
            if parsing.parser is None:
                if state.role_sent or state.prev_tokens:
                    decoder.restore_window(state.prev_tokens, state.prefix_offset, state.read_offset)
                text = decoder.feed(new_ids, stop_terminated=stop_terminated)
                delta = DeltaMessage(role="assistant" if not state.role_sent else None, content=text or None,
                                     reasoning=None)
                tools_streamed = False
                pieces, prefix, read = decoder.window_state()
                state.prev_tokens, state.prefix_offset, state.read_offset = pieces, prefix, read
            else:
                before = decoder.feed(state.output_token_ids)
                stream = ChatChoiceStream(parsing)
                stream.delta(before, False)
                known = state.last_tool_call_ids[:len(stream.tool_call_ids)]  # ids already sent stay
                stream.tool_call_ids[:len(known)] = known
                text = decoder.feed(new_ids, stop_terminated=stop_terminated)
                delta = stream.delta(text, finished) or DeltaMessage()
                if not state.role_sent:
                    delta.role = "assistant"
                tools_streamed = stream.tools_streamed
                state.last_tool_call_ids = list(stream.tool_call_ids)
                if new_ids:
                    state.output_token_ids = state.output_token_ids + list(new_ids)
                    state.output_chunk_lens = state.output_chunk_lens + [len(new_ids)]
            state.role_sent = True
            state.tools_streamed = state.tools_streamed or tools_streamed
            state.logprob_context_token_ids = logprob_context_tail(state.logprob_context_token_ids, new_ids)
            reason = c.finish_reason
            if finished:
                reason = parsing.finish_reason(c.finish_reason, state.tools_streamed and c.finish_reason == "stop")
            return_ids = chat is not None and chat.return_token_ids
            choices.append(ChatStreamChoice(index=c.index, delta=delta,
                                            logprobs=ChatLogprobs(content=lp) if lp is not None else None,
                                            finish_reason=reason, stop_reason=c.stop_reason,
                                            token_ids=c.token_ids if return_ids else None))
        chunk = ChatCompletionStreamResponse(id=gen.request_id, created=now(),
                                             model=self._model(body.model, served_model), choices=choices,
                                             usage=self._usage(gen, body.prompt_tokens), metrics=gen.metrics
                                             or msgspec.UNSET)
        return msgspec.json.encode({"chunk": chunk, "stream_state": state})

    @staticmethod
    def _usage(gen: _Generated, prompt_tokens) -> Optional[UsageInfo]:
        if gen.usage is None:
            return None
        pt = prompt_tokens if isinstance(prompt_tokens, int) else (gen.usage.get("prompt_tokens") or 0)
        ct = gen.usage.get("completion_tokens") or 0
        return UsageInfo(prompt_tokens=pt, completion_tokens=ct, total_tokens=pt + ct)

    # ------------------------------------------------------------------ completions
    def completion(self, body: DerenderRequest, served_model: str) -> bytes:
        raws = body.generate_responses
        if not raws:
            raise BadRequest("generate_responses must not be empty", "generate_responses")
        gens = [_generated(r, "generate_responses", f"generate_responses.{i}") for i, r in enumerate(raws)]
        self._bounds(gens)
        counts = body.prompt_tokens if isinstance(body.prompt_tokens, list) else None
        if counts is not None and len(counts) != len(gens):
            raise BadRequest(f"prompt_tokens length ({len(counts)}) must equal generate_responses length "
                             f"({len(gens)})", "prompt_tokens")
        seeds = body.prompt_token_ids
        if seeds is not None:
            if len(seeds) != len(gens):
                raise BadRequest(f"prompt_token_ids length ({len(seeds)}) must equal generate_responses length "
                                 f"({len(gens)})", "prompt_token_ids")
            seeds = [self._prompt_ids(_ids(s, "prompt_token_ids")) for s in seeds]
        request = _request(body.completion_request, CompletionRequest, "completion_request")
        skip, spaces = self._decode_params(request, False)
        choices, completion = [], 0
        for p, gen in enumerate(gens):
            prompt_ids = (seeds[p] if seeds else None) or gen.prompt_token_ids
            for c in gen.choices:
                ids = c.token_ids or []
                decoder = ChoiceDecoder(self.tokenizer, prompt_ids, skip, spaces)
                text = decoder.feed(ids, stop_terminated=ends_on_stop_token(c.finish_reason, c.stop_reason))
                lp = self._logprobs(c)
                completion += len(ids)
                return_ids = request is not None and request.return_token_ids
                choices.append(CompletionChoice(
                    index=len(choices), text=text, logprobs=completion_logprobs(lp) if lp is not None else None,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    token_ids=ids if return_ids else None))
        prompt_tokens = sum(counts) if counts else 0
        first = gens[0]
        kv = first.kv_transfer_params if all(g.kv_transfer_params == first.kv_transfer_params for g in gens) else None
        ec = first.ec_transfer_params if all(g.ec_transfer_params == first.ec_transfer_params for g in gens) else None
        return msgspec.json.encode(CompletionResponse(
            id=first.request_id, created=now(), model=self._model(body.model, served_model), choices=choices,
            usage=UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                            total_tokens=prompt_tokens + completion),
            kv_transfer_params=kv, ec_transfer_params=ec, metrics=first.metrics if len(gens) == 1 else None))

    def completion_stream(self, body: DerenderRequest, served_model: str) -> bytes:
        gen = _generated(body.generate_chunk, "generate_chunk")
        prompt_ids = self._prompt_ids(_ids(body.prompt_token_ids, "prompt_token_ids")) or gen.prompt_token_ids
        request = _request(body.completion_request, CompletionRequest, "completion_request")
        if len(gen.choices) > 1:
            raise BadRequest(f"derender_completion_stream expects at most one choice per chunk "
                             f"(got {len(gen.choices)}).")
        skip, spaces = self._decode_params(request, False)
        state = body.stream_state or DerenderStreamState()
        choices = []
        for c in gen.choices:
            new_ids = c.token_ids or []
            decoder = ChoiceDecoder(self.tokenizer, prompt_ids, skip, spaces)
            if state.role_sent or state.prev_tokens:
                decoder.restore_window(state.prev_tokens, state.prefix_offset, state.read_offset)
            text = decoder.feed(new_ids, stop_terminated=c.finish_reason is not None
                                and ends_on_stop_token(c.finish_reason, c.stop_reason))
            state.prev_tokens, state.prefix_offset, state.read_offset = decoder.window_state()
            state.role_sent = True
            lp = self._logprobs(c, state.logprob_context_token_ids)
            logprobs = None
            if lp is not None:
                logprobs = completion_logprobs(lp, state.logprob_text_offset)
                if logprobs.tokens:
                    state.logprob_text_offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
            state.logprob_context_token_ids = logprob_context_tail(state.logprob_context_token_ids, new_ids)
            return_ids = request is not None and request.return_token_ids
            choices.append(CompletionStreamChoice(index=c.index, text=text, logprobs=logprobs,
                                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                  token_ids=new_ids if return_ids else None))
        prompt_tokens = body.prompt_tokens if isinstance(body.prompt_tokens, int) else None
        chunk = CompletionStreamResponse(id=gen.request_id, created=now(), model=self._model(body.model, served_model),
                                         choices=choices, usage=self._usage(gen, prompt_tokens),
                                         metrics=gen.metrics or msgspec.UNSET)
        return msgspec.json.encode({"chunk": chunk, "stream_state": state})
