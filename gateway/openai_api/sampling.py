"""OpenAI request -> vLLM ``SamplingParams``, as vLLM's ``to_sampling_params`` builds it.

The result is typed: the generate API's ``HttpSamplingParams`` with the keys vLLM's
render endpoints put in ``GenerateRequest.sampling_params`` set (its SamplingParams
serialised with ``omit_defaults``, after ``__post_init__``, so ``stop`` /
``stop_token_ids`` / ``bad_words`` are lists and greedy requests have their
top-p/k/min-p reset) and the rest UNSET.  The facade's generate path consumes that
struct as built (no JSON round trip); the render routes dump it with
:func:`sampling_params_json`.  ``max_tokens`` is decided here once, by
:func:`max_tokens_for` (the generation-config default and the room left).
Request checks vLLM makes in its pydantic validators live here too (400 with vLLM's
messages); value ranges are left to common.validation, shared with /generate.
"""
from __future__ import annotations

from typing import Any, Optional, Union

from msgspec import UNSET

from common.errors import BadRequest
from common.validation import summarize
from gateway.generate_api.protocol import HttpSamplingParams
from gateway.openai_api.protocol import ChatCompletionRequest, CompletionRequest

# vLLM's RequestOutputKind values.
OUTPUT_KIND_DELTA = 1
OUTPUT_KIND_FINAL_ONLY = 2

# vLLM SamplingParams field order and defaults (what omit_defaults compares against).
_SAMPLING_DEFAULTS: tuple[tuple[str, Any], ...] = (
    ("n", 1), ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
    ("temperature", 1.0), ("watermarking", None), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
    ("seed", None), ("stop", None), ("stop_token_ids", None), ("ignore_eos", False), ("max_tokens", 16),
    ("min_tokens", 0), ("logprobs", None), ("prompt_logprobs", None), ("detokenize", True),
    ("skip_special_tokens", True), ("spaces_between_special_tokens", True),
    ("include_stop_str_in_output", False), ("output_kind", 0), ("stream_interval", None),
    ("skip_clone", False), ("output_text_buffer_length", 0), ("structured_outputs", None), ("logit_bias", None),
    ("allowed_token_ids", None), ("bad_words", None), ("routed_experts_prompt_start", 0),
)
# OpenAI defaults under the server's generation_config defaults (vLLM's _DEFAULT_SAMPLING_PARAMS).
_OPENAI_DEFAULTS = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
_SAMPLING_EPS = 1e-5

# Request fields vLLM serves that this server does not: refused by name when set.
_UNSERVED = ("watermarking", "logprob_token_ids", "vllm_xargs", "repetition_detection",
             "thinking_token_budget", "mm_processor_kwargs", "media_io_kwargs")


def refuse_unserved(request: Union[ChatCompletionRequest, CompletionRequest]) -> None:
    if request.use_beam_search:
        raise BadRequest("Beam search is not supported by this server.", "use_beam_search")
    kwargs = request.mm_processor_kwargs
    if isinstance(kwargs, dict) and kwargs.get("do_pan_and_scan"):
        # Gemma 3's crops: vLLM serves them (off by default); here an image is always encoded whole
        raise BadRequest("`mm_processor_kwargs.do_pan_and_scan` is not supported by this server: pan-and-scan crops "
                         "are not served, each image is encoded whole at the model's image size.",
                         "mm_processor_kwargs")
    for name in _UNSERVED:
        value = getattr(request, name)
        if value not in (None, False, {}):
            raise BadRequest(f"`{name}` is not supported by this server.", name)
    if request.stream_interval not in (None, 1):
        raise BadRequest("`stream_interval` is not supported by this server.", "stream_interval")
    if isinstance(request, CompletionRequest):
        if request.suffix is not None:
            raise BadRequest("suffix is not currently supported", "suffix")
        if request.prompt_embeds is not None:
            raise BadRequest("`prompt_embeds` is not supported by this server.", "prompt_embeds")


def check_common(request: Union[ChatCompletionRequest, CompletionRequest]) -> None:
    """vLLM's model validators shared by both request kinds."""
    if request.stream_options is not None and not request.stream:
        raise BadRequest("Stream options can only be defined when `stream=True`.", "stream_options")
    pl = request.prompt_logprobs
    if pl is not None:
        if request.stream and (pl > 0 or pl == -1):
            raise BadRequest("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if pl < 0 and pl != -1:
            raise BadRequest("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs")


def check_chat(request: ChatCompletionRequest) -> None:
    """vLLM ChatCompletionRequest's model validators."""
    check_common(request)
    top = request.top_logprobs
    if top is not None:
        if top < 0 and top != -1:
            raise BadRequest("`top_logprobs` must be a positive value or -1.", "top_logprobs")
        if (top == -1 or top > 0) and not request.logprobs:
            raise BadRequest("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    if request.continue_final_message and request.add_generation_prompt:
        raise BadRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    check_tool_choice(request)


def check_tool_choice(request: ChatCompletionRequest) -> None:
    if request.tools == []:
        raise BadRequest("`tools` must not be an empty array. Either provide at least one tool or omit the "
                         "field entirely.", "tools")
    if request.tool_choice is None and request.tools:
        request.tool_choice = "auto"
    choice = request.tool_choice
    if choice is None or choice == "none":
        return
    if request.tools is None:
        raise BadRequest("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if not isinstance(choice, dict):
        if choice not in ("auto", "required"):
            raise BadRequest(f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" "
                             "or \"required\" are supported.", "tool_choice")
        return
    usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
    function = choice.get("function")
    if not isinstance(function, dict):
        raise BadRequest(f"Invalid value for `function`: `{function}` in `tool_choice`! {usage}",
                         "tool_choice.function")
    if "name" not in function:
        raise BadRequest(f"Expected field `name` in `function` in `tool_choice`! {usage}",
                         "tool_choice.function.name")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise BadRequest(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}",
                         "tool_choice.function.name")
    names = [(t.get("function") or {}).get("name") for t in request.tools if isinstance(t, dict)]
    if name not in names:
        raise BadRequest("The tool specified in `tool_choice` does not match any of the specified `tools`",
                         "tool_choice")


def check_completion(request: CompletionRequest) -> None:
    check_common(request)
    if request.logprobs is not None and request.logprobs < 0 and request.logprobs != -1:
        raise BadRequest("`logprobs` must be a positive value or -1.", "logprobs")


def max_tokens_for(max_model_len: int, requested: Optional[int], input_length: int, defaults: dict,
                   truncate_prompt_tokens: Optional[int] = None, param: str = "max_tokens") -> int:
    """The one place a chat / completion request's max_tokens is checked and decided
    (``requested``: the request's, ``param`` naming it in the 400s): vLLM 0.33's
    TokenizeParams checks (:func:`check_prompt_length`), then its ``get_max_tokens``: the
    room left in the context, capped by the request or the generation_config default."""
    check_prompt_length(input_length, max_model_len, requested, param)
    if truncate_prompt_tokens is not None:
        input_length = min(input_length, max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens)
    if max_model_len < input_length:
        raise BadRequest(f"Input length ({input_length}) exceeds model's maximum context length ({max_model_len}).")
    fallback = requested if requested is not None else defaults.get("max_tokens")
    return min(v for v in (max_model_len - input_length, fallback) if v is not None)


def check_prompt_length(num_tokens: int, max_model_len: int, requested_output: Optional[int],
                        output_param: str = "max_tokens") -> None:
    """vLLM 0.33's TokenizeParams checks: no more output asked for than the whole context,
    and a prompt that fits the context (the output is not reserved here: ``max_tokens_for``
    then clamps it to the room left, as ``get_max_tokens``)."""
    if requested_output and requested_output > max_model_len:
        raise BadRequest(f"{output_param}={requested_output} cannot be greater than max_model_len={max_model_len}. "
                         "Please request fewer output tokens.", output_param)
    if num_tokens > max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{num_tokens} input tokens, which exceeds this limit even without any output tokens. "
            "Please reduce the length of the input prompt.", "input_tokens")


def _logit_bias(raw: Optional[dict[str, float]]) -> Optional[dict[int, float]]:
    if raw is None:
        return None
    out, bad = {}, []
    for key, bias in raw.items():
        try:
            out[int(key)] = min(100.0, max(-100.0, bias))
        except (TypeError, ValueError):
            bad.append(key)
    if bad:
        raise BadRequest("logit_bias contains key(s) that cannot be converted to integer token IDs: "
                         f"{summarize(bad)}", "logit_bias")
    return out


def sampling_params(request: Union[ChatCompletionRequest, CompletionRequest], max_tokens: int,
                    defaults: dict, *, logprobs: Optional[int], prompt_logprobs: Optional[int],
                    structured_outputs: Optional[dict] = None) -> HttpSamplingParams:
    """vLLM ``SamplingParams.from_optional(...)``: the keys its omit_defaults dump keeps
    set, the others UNSET; ``max_tokens``: :func:`max_tokens_for`'s, always set;
    ``structured_outputs``: gateway/structured_outputs/openai_mapping.py's render JSON."""
    values: dict[str, Any] = {}
    for name, openai_default in _OPENAI_DEFAULTS.items():
        value = getattr(request, name)
        values[name] = value if value is not None else defaults.get(name, openai_default)
    stop = request.stop
    stop = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
    stop_token_ids = list(dict.fromkeys(request.stop_token_ids or []))
    values.update(
        n=1 if request.n is None else request.n,
        seed=None if request.seed == -1 else request.seed,
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=request.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        output_kind=OUTPUT_KIND_DELTA if request.stream else OUTPUT_KIND_FINAL_ONLY,
        skip_clone=True,
        logit_bias=_logit_bias(request.logit_bias),
        allowed_token_ids=request.allowed_token_ids,
        bad_words=list(dict.fromkeys(request.bad_words or [])),
        routed_experts_prompt_start=request.routed_experts_prompt_start,
        structured_outputs=structured_outputs,
    )
    if stop and not request.include_stop_str_in_output:
        values["output_text_buffer_length"] = max(len(s) for s in stop) - 1
    if 0 <= values["temperature"] < _SAMPLING_EPS:  # greedy: vLLM resets the filters
        values.update(top_p=1.0, top_k=0, min_p=0.0)
    out = {}
    for name, default in _SAMPLING_DEFAULTS:
        if name in values:
            value = values[name]
            # max_tokens is always sent, 16 included: omitted, /generate would read it as "not
            # given" and fill the context (vLLM's render drops it there, a round-trip bug).
            if name == "max_tokens" or not (value == default and isinstance(value, bool) == isinstance(default, bool)):
                out[name] = value
    return HttpSamplingParams(**out)


def sampling_params_json(params: HttpSamplingParams) -> dict:
    """The render routes' ``sampling_params``: the set keys, in vLLM's SamplingParams order."""
    out = {}
    for name, _ in _SAMPLING_DEFAULTS:
        value = getattr(params, name)
        if value is not UNSET:
            out[name] = value
    return out


def sent(value: Any) -> Any:
    """A sampling field as the omit_defaults dump reads back: None where it was left at
    vLLM's default (UNSET)."""
    return None if value is UNSET else value
