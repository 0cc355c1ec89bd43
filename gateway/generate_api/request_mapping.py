"""HTTP request (body + headers) -> internal wire ``GenerateRequest``.

Value checks live in ``common.validation.validate_request`` (shared with the engine);
this module owns what only the HTTP layer knows: which keys were sent, headers, the
served model name, and the stream/usage options that shape the response.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Mapping, Optional

import msgspec

from common.errors import BadRequest, NotFound, Overloaded, ServingError
from common.prefix_hash import prompt_routing_hashes
from common.protocol import ClusterInfo, GenerateRequest, ModelInfo, SamplingParams
from gateway.generate_api import parse_context as parse_ctx
from gateway.generate_api import unserved_fields
from gateway.generate_api.protocol import HttpGenerateRequest, HttpSamplingParams
from gateway.structured_outputs.policy import StructuredOutputsPolicy

_DEFAULT_POLICY = StructuredOutputsPolicy()

REQUEST_ID_PREFIX = "generate-tokens-"
_wire_encoder = msgspec.msgpack.Encoder()
TRACE_HEADERS = ("traceparent", "tracestate")
_SAMPLING_FIELDS = tuple(f for f in HttpSamplingParams.__struct_fields__
                         if f not in unserved_fields.SAMPLING_FIELDS and f not in unserved_fields.INERT_SAMPLING_FIELDS
                         and f != "structured_outputs")  # mapped by the structured-outputs policy


@dataclass
class MappedRequest:
    """What the generate route needs: the wire request plus the response-shaping options."""

    wire: GenerateRequest
    http: HttpGenerateRequest
    model_name: str
    text_mode: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    # {"image": [{"offset", "length"}, ...]} for a request with images (gateway/multimodal.py)
    mm_placeholders: Optional[dict] = None
    kv_block_size: int = 16  # the workers' block size: image prompts' routing keys are recomputed with it
    # output_mode "derender": the request's parse_context (None when it sent none)
    parse_context: Optional[parse_ctx.ParseContext] = None

    @property
    def derender(self) -> bool:
        return self.http.output_mode == "derender"


def base_model_names(info: ModelInfo, served_model_names: list[str]) -> list[str]:
    """The names the base model answers to (--served-model-name, else its own)."""
    return served_model_names or [info.name]


def served_name(info: ModelInfo, served_model_names: list[str]) -> str:
    return base_model_names(info, served_model_names)[0]


def knows_model(requested: str, cluster: ClusterInfo, served_model_names: list[str]) -> bool:
    """``requested`` is a served name of the base model or a LoRA adapter of the pool."""
    return requested in base_model_names(cluster.model, served_model_names) or \
        requested in (cluster.lora_adapters or {})


def check_model(requested: Optional[str], names: list[str],
                lora_adapters: Optional[dict[str, str]] = None) -> Optional[str]:
    """The LoRA adapter ``requested`` names (None: the base model: no name, or one of
    ``names``, the base model's served names); vLLM's 404 for an unknown name.  The one
    model check of every API (/generate here; the OpenAI and agent routes through
    gateway/resources/openai.py's ``TextRoutes.resolve_model``)."""
    if not requested or requested in names:
        return None
    if lora_adapters and requested in lora_adapters:
        return requested
    raise NotFound(f"The model `{requested}` does not exist. Valid aliases: {', '.join(names)}.", "model")


def to_sampling_params(sp: HttpSamplingParams) -> SamplingParams:
    """Copy the keys the client sent; absent keys keep the wire defaults."""
    sent = {name: getattr(sp, name) for name in _SAMPLING_FIELDS if getattr(sp, name) is not msgspec.UNSET}
    if isinstance(sent.get("stop"), str):
        sent["stop"] = [sent["stop"]]
    # Omitted max_tokens: the engine applies min(max_model_len - prompt, generation_config);
    # explicit null: up to max_model_len - prompt.  Both travel as None, told apart by a flag.
    sent["max_tokens_is_default"] = "max_tokens" not in sent
    return SamplingParams(**sent)


def data_parallel_rank(headers: Mapping[str, str], cluster: ClusterInfo) -> Optional[int]:
    raw = headers.get("x-data-parallel-rank")
    if raw is None:
        return None
    try:
        rank = int(raw)
    except ValueError:
        return None  # vLLM ignores a rank that is not an integer
    live = sorted(w.rank for w in cluster.workers if w.alive)
    if rank not in live:
        num_ranks = (max(w.rank for w in cluster.workers) + 1) if cluster.workers else 0
        raise BadRequest(
            f"data_parallel_rank {rank} is out of range [0, {num_ranks}) "
            f"or has no live worker (live ranks: {live}).",
            "X-data-parallel-rank",
        )
    return rank


def routing_hashes(http: HttpGenerateRequest, cluster: ClusterInfo, info: ModelInfo,
                   lora_name: Optional[str]) -> Optional[list[bytes]]:
    """The prompt's block keys for the broker's cache-aware dispatch: only where a choice
    between workers exists and their caches can match (base model, prefix caching on;
    adapter blocks are keyed per worker)."""
    if lora_name is not None or not info.enable_prefix_caching or \
            sum(1 for w in cluster.workers if w.alive) < 2:
        return None
    return prompt_routing_hashes(http.token_ids, info.kv_block_size, http.cache_salt) or None


def map_request(http: HttpGenerateRequest, headers: Mapping[str, str], cluster: ClusterInfo, info: ModelInfo,
                *, served_model_names: list[str], arrival_time: Optional[float] = None,
                structured_outputs: Optional[StructuredOutputsPolicy] = None) -> MappedRequest:
    """``headers`` must be a lower-case keyed mapping.  ``structured_outputs``: the server's
    policy (its config and reasoning markers); the constraint's grammar is checked after
    mapping, off the event loop (``StructuredOutputsPolicy.check``)."""
    # vLLM's GenerateRequest model validators, before anything else.
    if http.output_mode == "derender" and http.sampling_params.detokenize is False:
        raise BadRequest("output_mode='derender' requires sampling_params.detokenize to be true", "output_mode")
    context = parse_ctx.read(http.parse_context, http.output_mode)
    lora_name = check_model(http.model, base_model_names(info, served_model_names), cluster.lora_adapters)
    unserved_fields.refuse_unserved(http)
    params = to_sampling_params(http.sampling_params)
    params.structured_outputs = (structured_outputs or _DEFAULT_POLICY).wire(
        http.sampling_params.structured_outputs, reasoning_ended=http.reasoning_ended,
        has_tokenizer=info.has_tokenizer)
    base_id = headers.get("x-request-id") or http.request_id or uuid.uuid4().hex
    trace = {h: headers[h] for h in TRACE_HEADERS if h in headers} or None
    wire = GenerateRequest(
        request_id=REQUEST_ID_PREFIX + base_id,
        prompt_token_ids=http.token_ids,
        params=params,
        priority=http.priority,
        cache_salt=http.cache_salt,
        output_text=http.output_mode != "tokens",  # derender parses the workers' text
        data_parallel_rank=data_parallel_rank(headers, cluster),
        session_id=headers.get("x-session-id") or None,
        kv_transfer_params=http.kv_transfer_params,
        ec_transfer_params=http.ec_transfer_params,
        arrival_time=arrival_time if arrival_time is not None else time.time(),
        trace_headers=trace,
        lora_name=lora_name,
        prefix_hashes=routing_hashes(http, cluster, info, lora_name),
    )
    opts = http.stream_options
    include_usage = bool(opts and opts.include_usage)
    return MappedRequest(
        wire=wire,
        http=http,
        model_name=lora_name or served_name(info, served_model_names),
        text_mode=http.output_mode == "text",
        stream=bool(http.stream),
        include_usage=include_usage,
        continuous_usage=include_usage and bool(opts.continuous_usage_stats),
        kv_block_size=info.kv_block_size,
        parse_context=context,
    )


async def cluster_for(state, model: Optional[str]):
    """The cluster view a request is mapped against (503 while no worker has registered);
    ``state`` is the gateway's ``GatewayState``."""
    cluster = await state.cluster.get()
    if cluster.model is None:
        raise Overloaded("No inference worker is available yet.")
    if model and not knows_model(model, cluster, state.settings.served_model_names):
        # An adapter loaded through another gateway a moment ago: ask the broker
        # before answering 404.
        cluster = await state.cluster.fresh()
    return cluster


def check_encodable(wire) -> None:
    """Ints beyond 64 bits and the like cannot travel; vLLM answers 400 for these too."""
    try:
        _wire_encoder.encode(wire)
    except (OverflowError, TypeError, ValueError) as exc:
        raise ServingError(str(exc), status=400, type="BadRequestError") from None
