"""HTTP/JSON shapes of vLLM 0.32's OpenAI-compatible and render/derender/tokenize routes.

Requests are decoded with msgspec into these structs (types checked as vLLM's pydantic
models check them; unknown keys ignored, as OpenAI's ``extra="allow"`` models do).
Fields vLLM has but this server does not serve are typed and then refused by name when
set (gateway/openai/sampling.py).  Responses follow vLLM's field order; the non-stream
bodies are vLLM's full ``model_dump()`` (every field, ``null`` when unset), the stream
chunks its ``exclude_unset`` dumps (UNSET fields are left out).
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

import msgspec
from msgspec import UNSET, Meta, UnsetType
from typing_extensions import Annotated

from gateway.generate_api.protocol import PerRequestMetrics, PromptLogprob, StreamOptions, TextLogprobContent

Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
JsonObject = dict[str, Any]
StopParam = Union[str, list[str], None]


# ---------------------------------------------------------------- requests
class _SamplingFields(msgspec.Struct, kw_only=True):
    """What chat and completion requests share (vLLM's extra sampling params included)."""

    model: Optional[str] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    n: Optional[int] = 1
    presence_penalty: Optional[float] = None
    seed: Optional[Int64] = None
    stop: StopParam = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    user: Optional[str] = None
    use_beam_search: bool = False
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    length_penalty: float = 1.0
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Optional[Annotated[int, Meta(ge=-1)]] = None
    truncation_side: Optional[Literal["left", "right"]] = None
    allowed_token_ids: Optional[list[int]] = None
    prompt_logprobs: Optional[int] = None
    bad_words: Optional[list[str]] = None
    response_format: Optional[JsonObject] = None
    priority: Int64 = 0
    request_id: Optional[str] = None
    return_tokens_as_token_ids: Optional[bool] = None
    return_token_ids: Optional[bool] = None
    # /v1/{chat/,}completions/render: each prompt token's [start, end) in the text it was
    # tokenized from (a chat's rendered template); ignored by the generating routes.
    return_token_offsets: Optional[bool] = False
    cache_salt: Optional[Annotated[str, Meta(min_length=1, max_length=1024)]] = None
    kv_transfer_params: Optional[JsonObject] = None
    routed_experts_prompt_start: int = 0
    # vLLM's StructuredOutputsParams (gateway/structured_outputs/openai_mapping.py)
    structured_outputs: Optional[JsonObject] = None
    # vLLM fields not served here: refused by name when set (gateway/openai/sampling.py).
    watermarking: Optional[bool] = None
    logprob_token_ids: Optional[list[int]] = None
    vllm_xargs: Optional[JsonObject] = None
    repetition_detection: Optional[JsonObject] = None
    thinking_token_budget: Optional[int] = None
    stream_interval: Optional[int] = None
    ec_transfer_params: Optional[JsonObject] = None
    mm_processor_kwargs: Optional[JsonObject] = None
    media_io_kwargs: Optional[JsonObject] = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[Any]
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = 0
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Union[str, JsonObject, None] = None
    reasoning_effort: Optional[str] = None
    include_reasoning: bool = True
    parallel_tool_calls: Optional[bool] = True
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: Optional[list[dict[str, str]]] = None
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[JsonObject] = None
    return_prompt_text: Optional[bool] = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: Union[str, list[Any], None] = None  # str | list[str] | list[int] | list[list[int]], checked at render
    echo: Optional[bool] = False
    logprobs: Optional[int] = None
    max_tokens: Optional[int] = 16
    suffix: Optional[str] = None
    add_special_tokens: bool = True
    prompt_embeds: Union[str, list[str], None] = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's TokenizeCompletionRequest | TokenizeChatRequest (told apart by ``messages``)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[Any]] = None
    add_special_tokens: Optional[bool] = None  # True for a prompt, False for messages
    return_token_strs: Optional[bool] = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[JsonObject] = None
    tools: Optional[list[Any]] = None
    mm_processor_kwargs: Optional[JsonObject] = None
    media_io_kwargs: Optional[JsonObject] = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[Annotated[int, Meta(ge=0, le=2**63 - 1)]]
    model: Optional[str] = None


# ---------------------------------------------------------------- responses
class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class PromptTokenUsageInfo(msgspec.Struct):
    cached_tokens: Union[int, None, UnsetType] = None
    created_cache_tokens: Union[int, None, UnsetType] = None
    multimodal_tokens: Union[dict[str, int], None, UnsetType] = None


def prompt_tokens_details(enabled: bool, cached_tokens: Optional[int], *, stream: bool):
    """vLLM's ``--enable-prompt-tokens-details``: ``{"cached_tokens": N}`` in the usage, with
    the null fields a non-stream body carries (``model_dump``); off, null (stream: absent)."""
    if not enabled or cached_tokens is None:
        return msgspec.UNSET if stream else None
    if stream:
        return PromptTokenUsageInfo(cached_tokens=cached_tokens, created_cache_tokens=msgspec.UNSET,
                                    multimodal_tokens=msgspec.UNSET)
    return PromptTokenUsageInfo(cached_tokens=cached_tokens)


class UsageInfo(msgspec.Struct):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: Optional[int] = 0
    prompt_tokens_details: Union[PromptTokenUsageInfo, None, UnsetType] = None
    completion_tokens_details: Union[None, UnsetType] = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatLogprobs(msgspec.Struct):
    """Chat logprobs: generate's text-mode entries (``token``, ``logprob``, ``bytes``, ``top_logprobs``)."""

    content: Optional[list[TextLogprobContent]] = None


class ChatMessage(msgspec.Struct):
    role: str
    content: Optional[str] = None
    refusal: Optional[str] = None
    annotations: Optional[Any] = None
    audio: Optional[Any] = None
    function_call: Optional[Any] = None
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    reasoning: Optional[str] = None


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = "stop"
    stop_reason: Union[int, str, None] = None
    token_ids: Optional[list[int]] = None
    routed_experts: Optional[str] = None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    service_tier: Optional[str] = None
    system_fingerprint: Optional[str] = None
    usage: UsageInfo
    prompt_logprobs: Optional[list[Optional[dict[int, PromptLogprob]]]] = None
    prompt_token_ids: Optional[list[int]] = None
    prompt_text: Optional[str] = None
    kv_transfer_params: Optional[JsonObject] = None
    ec_transfer_params: Optional[JsonObject] = None
    metrics: Optional[PerRequestMetrics] = None


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(msgspec.Struct):
    index: int
    id: Union[str, UnsetType] = UNSET
    type: Union[str, UnsetType] = UNSET
    function: Union[DeltaFunctionCall, UnsetType] = UNSET


class DeltaMessage(msgspec.Struct):
    """Only the keys a chunk sets are sent (vLLM dumps stream chunks with exclude_unset)."""

    role: Union[str, UnsetType] = UNSET
    content: Union[str, None, UnsetType] = UNSET
    reasoning: Union[str, None, UnsetType] = UNSET
    tool_calls: Union[list[DeltaToolCall], UnsetType] = UNSET


class ChatStreamChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None, UnsetType] = UNSET
    token_ids: Union[list[int], None, UnsetType] = UNSET


class ChatCompletionStreamResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Union[UsageInfo, None, UnsetType] = UNSET
    prompt_token_ids: Union[list[int], None, UnsetType] = UNSET
    prompt_text: Union[str, None, UnsetType] = UNSET
    metrics: Union[PerRequestMetrics, UnsetType] = UNSET


class CompletionLogProbs(msgspec.Struct):
    text_offset: list[int] = msgspec.field(default_factory=list)
    token_logprobs: list[Optional[float]] = msgspec.field(default_factory=list)
    tokens: list[str] = msgspec.field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = msgspec.field(default_factory=list)


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    token_ids: Optional[list[int]] = None
    prompt_logprobs: Optional[list[Optional[dict[int, PromptLogprob]]]] = None
    prompt_token_ids: Optional[list[int]] = None
    routed_experts: Optional[str] = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    service_tier: Optional[str] = None
    system_fingerprint: Optional[str] = None
    usage: UsageInfo
    kv_transfer_params: Optional[JsonObject] = None
    ec_transfer_params: Optional[JsonObject] = None
    metrics: Optional[PerRequestMetrics] = None


class CompletionStreamChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    prompt_token_ids: Union[list[int], None, UnsetType] = UNSET
    token_ids: Union[list[int], None, UnsetType] = UNSET


class CompletionStreamResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: Union[UsageInfo, None, UnsetType] = UNSET
    metrics: Union[PerRequestMetrics, UnsetType] = UNSET


# ---------------------------------------------------------------- derender
_TokenId = Annotated[int, Meta(ge=0, le=2**32 - 1)]  # ids the tokenizer can decode (a 400 otherwise, not a 500)


class DerenderStreamState(msgspec.Struct, kw_only=True):
    """vLLM's client-carried streaming derender state (field names and bounds as vLLM's)."""

    prev_tokens: Annotated[list[str], Meta(max_length=1024)] = msgspec.field(default_factory=list)
    prefix_offset: Annotated[int, Meta(ge=0)] = 0
    read_offset: Annotated[int, Meta(ge=0)] = 0
    role_sent: bool = False
    logprob_context_token_ids: Annotated[list[_TokenId], Meta(max_length=4)] = msgspec.field(default_factory=list)
    logprob_text_offset: Annotated[int, Meta(ge=0)] = 0
    output_token_ids: list[_TokenId] = msgspec.field(default_factory=list)
    output_chunk_lens: list[Annotated[int, Meta(gt=0)]] = msgspec.field(default_factory=list)
    tools_streamed: bool = False
    last_tool_call_ids: list[str] = msgspec.field(default_factory=list)


class DerenderRequest(msgspec.Struct, kw_only=True):
    """Both derender routes, stream and not (vLLM tells them apart by ``stream``).

    Chat: ``generate_response`` (non-stream) or ``generate_chunk`` + ``stream_state``.
    Completions: ``generate_responses`` (one per prompt) or ``generate_chunk``.
    The generate payloads are kept as JSON objects and read with
    gateway/openai/derender.py's accessors (only ``output_mode: "tokens"`` is accepted).
    """

    stream: bool = False
    model: Optional[str] = None
    generate_response: Optional[JsonObject] = None
    generate_responses: Optional[list[JsonObject]] = None
    generate_chunk: Optional[JsonObject] = None
    stream_state: Optional[DerenderStreamState] = None
    prompt_tokens: Union[int, list[int], None] = None
    # Chat / stream: list[int]; completions: one list[int] | None per response (checked by the route).
    prompt_token_ids: Optional[list[Any]] = None
    chat_request: Optional[JsonObject] = None
    completion_request: Optional[JsonObject] = None


json_encoder = msgspec.json.Encoder()
chat_request_decoder = msgspec.json.Decoder(ChatCompletionRequest)
completion_request_decoder = msgspec.json.Decoder(CompletionRequest)
tokenize_request_decoder = msgspec.json.Decoder(TokenizeRequest)
detokenize_request_decoder = msgspec.json.Decoder(DetokenizeRequest)
derender_request_decoder = msgspec.json.Decoder(DerenderRequest)
