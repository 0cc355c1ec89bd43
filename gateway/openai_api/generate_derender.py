"""``/inference/v1/generate`` with ``output_mode: "derender"`` (vLLM 0.33): the choices carry
the parsed assistant ``message`` (``GenerateDerenderChoice``) instead of ``text``.

The workers detokenize as in text mode; the text is parsed with the chat facade's code
(gateway/openai_api/chat_output.py, the reasoning / tool-call parsers of gateway/parsers),
set up from the request's ``parse_context`` as the chat derender route sets it up from a
chat request (gateway/openai_api/derender.py), so the message equals what
``/v1/chat/completions`` answers for the same output.  Logprobs are in chat form (decoded
tokens with ``bytes``, ``top_logprobs`` cut to the requested count).  When a parser hides
the reasoning (``include_reasoning: false``) the per-token metadata that would leak it --
logprobs, token_ids, sampling_mask -- is dropped, as vLLM does.  No streaming.

It lives with the OpenAI facades, not in gateway/generate_api, because it is chat parsing:
the generate API's answer builder (generate_api/response_builder.py) receives a
:class:`DerenderSetup` from the route and calls its ``choice``, so imports run one way
(openai_api -> generate_api, never back; tests/unit/common/test_import_layers.py).
"""
from __future__ import annotations

from typing import Optional, Union

import msgspec

from common.errors import BadRequest
from gateway.generate_api.parse_context import ParseContext, check_tool_choice
from gateway.generate_api.protocol import WeightVersionSpan
from gateway.openai_api.chat_output import ChatParsing, chat_message, chat_parsing
from gateway.openai_api.protocol import ChatCompletionRequest, ChatLogprobs, ChatMessage


class DerenderChoice(msgspec.Struct):
    """vLLM's ``GenerateDerenderChoice``: the choice fields of every mode, then ``message``."""

    index: int
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None]
    token_ids: Optional[list[int]]
    routed_experts: Optional[str] = None
    sampling_mask: Optional[list[list[int]]] = None
    weight_versions: Optional[list[WeightVersionSpan]] = None
    message: ChatMessage = msgspec.field(default_factory=lambda: ChatMessage(role="assistant"))
    logprobs: Optional[ChatLogprobs] = None


class DerenderSetup(msgspec.Struct):
    """How a derender request's output is parsed, and whether its metadata is hidden."""

    parsing: ChatParsing
    hide_metadata: bool = False

    def choice(self, fields: dict, text: str, logprobs: Optional[list]) -> DerenderChoice:
        """The response builder's hook (generate_api.response_builder.DerenderChoices)."""
        return choice(fields, text, logprobs, self)


STREAM_ERROR = "output_mode='derender' does not support stream=true."
NEEDS_CONTEXT = ("output_mode='derender' requires parse_context on a server with a tool or reasoning parser. "
                 "Use the one returned by /render.")


def check(stream: bool, context: Optional[ParseContext], renderer) -> None:
    """vLLM's derender checks before generating, in its order (``renderer``: the gateway's
    text side, None without --tokenizer, i.e. no parser)."""
    if stream:
        raise BadRequest(STREAM_ERROR, "stream")
    if renderer is not None and renderer.parser is not None:
        if context is None:
            raise BadRequest(NEEDS_CONTEXT, "parse_context")
        check_tool_choice(context)


def to_chat_request(ctx: ParseContext) -> ChatCompletionRequest:
    """The message-less chat request the chat parsing reads (vLLM's ``to_chat_request``)."""
    tools = msgspec.to_builtins(ctx.tools) if ctx.tools is not None else None
    return ChatCompletionRequest(messages=[], tools=tools, tool_choice=ctx.tool_choice,
                                 parallel_tool_calls=ctx.parallel_tool_calls,
                                 include_reasoning=ctx.include_reasoning,
                                 chat_template_kwargs=ctx.chat_template_kwargs)


def setup(context: Optional[ParseContext], renderer, prompt_ids: list[int], max_model_len: int) -> DerenderSetup:
    """The parsing of a request that passed :func:`check`.  Without a parser the message's
    content is the text (and nothing is hidden), as in vLLM."""
    if renderer is None or context is None:
        return DerenderSetup(ChatParsing())
    parsing = chat_parsing(renderer, to_chat_request(context), prompt_ids)
    return DerenderSetup(parsing, hide_metadata=renderer.parser is not None and not context.include_reasoning)


def choice(fields: dict, text: str, logprobs: Optional[list], setup: DerenderSetup) -> DerenderChoice:
    """One finished choice: ``fields`` are the mode-independent choice fields."""
    message = chat_message(text, setup.parsing)
    engine_reason = fields.pop("finish_reason")
    # vLLM 0.33's resolve_finish_reason: "tool_calls" only when the engine stopped on its own.
    fields["finish_reason"] = setup.parsing.finish_reason(engine_reason, bool(message.tool_calls)
                                                          and (engine_reason or "stop") == "stop")
    lp = ChatLogprobs(content=logprobs) if logprobs is not None else None
    if setup.hide_metadata:
        lp = None
        fields["token_ids"] = None
        fields["sampling_mask"] = None
    return DerenderChoice(message=message, logprobs=lp, **fields)
