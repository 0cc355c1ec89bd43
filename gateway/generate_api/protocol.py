"""HTTP/JSON shapes of vLLM's token-in/token-out endpoint (``/inference/v1/generate``).

These are the *HTTP* shapes, decoded and encoded with msgspec; the internal ZeroMQ wire
lives in ``common/protocol.py``.  Field order follows vLLM's pydantic models so that the
JSON a client sees is byte-for-byte in the same order.

Request side: every ``sampling_params`` field defaults to ``UNSET`` so that the gateway
knows which keys the client actually sent (``max_tokens`` defaulting depends on it).
Response side: fields that vLLM always serialises (``null`` when unset) are plain
``Optional`` fields; fields that vLLM drops when ``None`` in stream chunks are typed with
``UnsetType`` so that msgspec omits them.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

import msgspec
from msgspec import UNSET, Meta, UnsetType
from typing_extensions import Annotated

Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
NonNegInt = Annotated[int, Meta(ge=0)]
# Any JSON object kept opaque (kv_transfer_params and friends are passed through).
JsonObject = dict[str, Any]


# ---------------------------------------------------------------- request side
class HttpSamplingParams(msgspec.Struct):
    """``sampling_params`` as sent by the client; UNSET marks keys that were absent."""

    n: Union[int, UnsetType] = UNSET
    temperature: Union[float, UnsetType] = UNSET  # null is a type error, as in vLLM
    top_p: Union[float, UnsetType] = UNSET
    top_k: Union[int, UnsetType] = UNSET
    min_p: Union[float, UnsetType] = UNSET
    seed: Union[Int64, None, UnsetType] = UNSET
    presence_penalty: Union[float, UnsetType] = UNSET
    frequency_penalty: Union[float, UnsetType] = UNSET
    repetition_penalty: Union[float, UnsetType] = UNSET
    stop: Union[str, list[str], None, UnsetType] = UNSET
    stop_token_ids: Union[list[int], None, UnsetType] = UNSET
    ignore_eos: Union[bool, UnsetType] = UNSET
    max_tokens: Union[int, None, UnsetType] = UNSET
    min_tokens: Union[int, UnsetType] = UNSET
    logprobs: Union[int, None, UnsetType] = UNSET
    prompt_logprobs: Union[int, None, UnsetType] = UNSET
    prompt_logprob_token_ids: Union[list[list[int]], None, UnsetType] = UNSET
    detokenize: Union[bool, UnsetType] = UNSET
    skip_special_tokens: Union[bool, UnsetType] = UNSET
    spaces_between_special_tokens: Union[bool, UnsetType] = UNSET
    include_stop_str_in_output: Union[bool, UnsetType] = UNSET
    logit_bias: Union[dict[int, float], None, UnsetType] = UNSET
    allowed_token_ids: Union[list[int], None, UnsetType] = UNSET
    bad_words: Union[list[str], None, UnsetType] = UNSET
    # vLLM fields with no effect here, typed as vLLM types them and then ignored: vLLM's
    # generate endpoint overwrites output_kind (DELTA when streaming, else FINAL_ONLY);
    # flat_logprobs only changes the engine's in-memory logprob layout; skip_clone is a
    # copy-avoidance hint.
    output_kind: Union[Literal[0, 1, 2], UnsetType] = UNSET  # RequestOutputKind
    flat_logprobs: Union[bool, UnsetType] = UNSET
    skip_clone: Union[bool, UnsetType] = UNSET
    # vLLM fields this server does not serve: typed as vLLM types them, then refused by
    # name when set to anything but a default (gateway/generate_api/unserved_fields.py).
    watermarking: Union[bool, None, UnsetType] = UNSET
    prompt_logprob_start: Union[int, None, UnsetType] = UNSET
    logprob_token_ids: Union[list[int], None, UnsetType] = UNSET
    stream_interval: Union[int, None, UnsetType] = UNSET
    output_text_buffer_length: Union[int, UnsetType] = UNSET
    # vLLM's StructuredOutputsParams, checked by gateway/structured_outputs/params.py
    structured_outputs: Union[JsonObject, None, UnsetType] = UNSET
    extra_args: Union[JsonObject, None, UnsetType] = UNSET
    skip_reading_prefix_cache: Union[bool, None, UnsetType] = UNSET
    thinking_token_budget: Union[int, None, UnsetType] = UNSET
    repetition_detection: Union[JsonObject, None, UnsetType] = UNSET
    routed_experts_prompt_start: Union[int, UnsetType] = UNSET
    trace_decode_token_ids: Union[list[int], None, UnsetType] = UNSET


class ReasoningParserKwargs(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's ``ReasoningParserKwargs`` (``extra="forbid"``)."""

    chat_template_kwargs: JsonObject = msgspec.field(default_factory=dict)


class StreamOptions(msgspec.Struct):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class HttpGenerateRequest(msgspec.Struct):
    token_ids: Annotated[list[int], Meta(min_length=1)]
    sampling_params: HttpSamplingParams
    request_id: Optional[str] = None
    model: Optional[str] = None
    return_token_ids: Optional[bool] = None
    output_mode: Literal["tokens", "text", "derender"] = "tokens"
    # vLLM 0.33: the chat context /v1/chat/completions/render returns, read only in derender
    # mode; kept as JSON and checked by gateway/generate_api/parse_context.py.
    parse_context: Optional[JsonObject] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    cache_salt: Optional[str] = None
    priority: Int64 = 0
    kv_transfer_params: Optional[JsonObject] = None
    ec_transfer_params: Optional[JsonObject] = None
    token_offsets: Optional[list[tuple[int, int]]] = None  # render's char offsets: informational, unused by vLLM too
    # Multimodal input, images only: gateway/multimodal.py, gateway/mm_features.py.
    features: Optional[JsonObject] = None
    content_parts: Optional[list[JsonObject]] = None
    # Filled in by vLLM's /render from the chat request (reasoning_ended is true when
    # include_reasoning is off or the prompt closed reasoning).  They gate structured
    # outputs: true constrains from the first token, else the grammar starts after the
    # reasoning parser's end marker (gateway/structured_outputs/policy.py).
    reasoning_ended: Optional[bool] = None
    reasoning_parser_kwargs: Optional[ReasoningParserKwargs] = None


class HttpAbortRequest(msgspec.Struct):
    request_ids: Optional[list[str]] = None


# ---------------------------------------------------------------- response side
class PromptTokensDetails(msgspec.Struct):
    cached_tokens: Union[int, None, UnsetType] = None
    created_cache_tokens: Union[int, None, UnsetType] = None
    multimodal_tokens: Union[dict[str, int], None, UnsetType] = None


class Usage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: Optional[int]
    prompt_tokens_details: Union[PromptTokensDetails, None, UnsetType] = None
    completion_tokens_details: Union[None, UnsetType] = None


class TokenLogprob(msgspec.Struct):
    """One candidate in tokens mode (``GenerateLogProb``)."""

    token_id: int
    logprob: float
    rank: Optional[int] = None


class TokenLogprobContent(msgspec.Struct):
    """The sampled token at one position plus its candidates (``GenerateLogProbsContent``)."""

    token_id: int
    logprob: float
    rank: Optional[int]
    top_logprobs: list[TokenLogprob]


class TextLogprob(msgspec.Struct):
    """One candidate in text mode (``ChatCompletionLogProb``)."""

    token: str
    logprob: float = -9999.0
    bytes: Optional[list[int]] = None


class TextLogprobContent(msgspec.Struct):
    token: str
    logprob: float
    bytes: Optional[list[int]]
    top_logprobs: list[TextLogprob]


class Logprobs(msgspec.Struct):
    content: Optional[list[Union[TokenLogprobContent, TextLogprobContent]]] = None


class PromptLogprob(msgspec.Struct):
    """vLLM's ``Logprob`` dataclass as serialised inside ``prompt_logprobs``."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


class SpeculativeDecodingMetrics(msgspec.Struct):
    """vLLM's per-request speculative decoding acceptance (n == 1 only)."""

    mean_acceptance_length: float
    draft_acceptance_rate: float
    acceptance_histogram: list[int]  # [k + 1]: verify steps that accepted exactly j drafts
    num_spec_steps: int
    num_accepted_draft_tokens: int
    num_draft_tokens: int
    num_spec_tokens: int
    per_step_accepted: Optional[list[int]] = None  # --per-request-spec-decode-metrics detailed
    per_step_drafted: Optional[list[int]] = None


class PerRequestMetrics(msgspec.Struct):
    time_to_first_token_ms: Optional[float] = None
    generation_time_ms: Optional[float] = None
    queue_time_ms: Optional[float] = None
    mean_itl_ms: Optional[float] = None
    tokens_per_second: Optional[float] = None
    speculative_decoding: Optional[SpeculativeDecodingMetrics] = None


class WeightVersionSpan(msgspec.Struct):
    """Output tokens ``[start, end)`` were sampled by the weights labelled ``version``."""

    version: str
    start: int
    end: int


class TokensChoice(msgspec.Struct):
    index: int
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None]
    token_ids: Optional[list[int]]
    routed_experts: Optional[str] = None  # base64 of the .npy array [positions, moe layers, top_k]
    sampling_mask: Optional[list[list[int]]] = None
    weight_versions: Optional[list[WeightVersionSpan]] = None
    logprobs: Optional[Logprobs] = None


class TextChoice(msgspec.Struct):
    index: int
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None]
    token_ids: Optional[list[int]]
    routed_experts: Optional[str] = None  # base64 of the .npy array [positions, moe layers, top_k]
    sampling_mask: Optional[list[list[int]]] = None
    weight_versions: Optional[list[WeightVersionSpan]] = None
    text: str = ""
    logprobs: Optional[Logprobs] = None


class GenerateResponse(msgspec.Struct):
    """Non-stream response: every field present, ``null`` when unset (vLLM's model_dump)."""

    request_id: str
    model: Optional[str]
    created: int
    usage: Usage
    prompt_logprobs: Optional[list[Optional[dict[int, PromptLogprob]]]]
    prompt_token_id_logprobs: Optional[str]
    prompt_token_ids: Optional[list[int]]
    mm_placeholders: Optional[dict[str, list[dict[str, int]]]]  # {"image": [{"offset", "length"}]}
    metrics: Optional[PerRequestMetrics]
    kv_transfer_params: Optional[Any]
    ec_transfer_params: Optional[Any]
    output_mode: str
    # TokensChoice, TextChoice or (derender) gateway/openai_api/generate_derender.py's DerenderChoice
    choices: list[Union[TokensChoice, TextChoice]]


class StreamChunk(msgspec.Struct):
    """One SSE ``data:`` payload. ``prompt_token_ids`` / ``metrics`` are dropped when unset,
    as vLLM excludes them from token-bearing chunks when ``None``."""

    request_id: str
    usage: Union[Usage, None, UnsetType]
    prompt_token_ids: Union[list[int], UnsetType] = UNSET
    mm_placeholders: Union[dict[str, list[dict[str, int]]], UnsetType] = UNSET
    metrics: Union[PerRequestMetrics, UnsetType] = UNSET
    output_mode: str = "tokens"
    choices: list[Union[TokensChoice, TextChoice]] = msgspec.field(default_factory=list)


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: Optional[str]
    code: int


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class ModelCard(msgspec.Struct):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "tokserve"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


json_encoder = msgspec.json.Encoder()
generate_request_decoder = msgspec.json.Decoder(HttpGenerateRequest)
abort_request_decoder = msgspec.json.Decoder(HttpAbortRequest)
