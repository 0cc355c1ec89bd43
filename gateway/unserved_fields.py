"""Request fields vLLM 0.32's generate endpoint accepts that this server does not serve.

Silently dropping one would change what the client gets without telling it (a JSON
schema ignored, images never seen), so a request that sets one to anything but its
default is a 400 naming the field.  Defaults (what clients send when they mean
"off") pass.
"""
from __future__ import annotations

from typing import Any

import msgspec

from common.errors import BadRequest
from gateway.http_protocol import HttpGenerateRequest

# field -> values that mean "not used" (vLLM's defaults)
REQUEST_FIELDS: dict[str, tuple[Any, ...]] = {
    "features": (None,),  # multimodal features
    "content_parts": (None, []),  # raw multimodal input
    "reasoning_ended": (None,),
    "reasoning_parser_kwargs": (None,),
}
SAMPLING_FIELDS: dict[str, tuple[Any, ...]] = {
    "watermarking": (None, False),
    "prompt_logprob_start": (None, 0),
    "logprob_token_ids": (None,),
    "flat_logprobs": (False,),
    "output_kind": (0,),
    "stream_interval": (None, 1),
    "output_text_buffer_length": (0,),
    "structured_outputs": (None,),
    "extra_args": (None, {}),
    "skip_reading_prefix_cache": (None, False),
    "thinking_token_budget": (None,),
    "repetition_detection": (None,),
    "routed_experts_prompt_start": (0,),
    "trace_decode_token_ids": (None,),
}


def _unused(value: Any, defaults: tuple[Any, ...]) -> bool:
    return value is msgspec.UNSET or any(value is d or (type(value) is type(d) and value == d) for d in defaults)


def refuse_unserved(http: HttpGenerateRequest) -> None:
    for name, defaults in REQUEST_FIELDS.items():
        if not _unused(getattr(http, name), defaults):
            raise BadRequest(f"`{name}` is not supported by this server.", name)
    sp = http.sampling_params
    for name, defaults in SAMPLING_FIELDS.items():
        if not _unused(getattr(sp, name), defaults):
            raise BadRequest(f"`sampling_params.{name}` is not supported by this server.", f"sampling_params.{name}")
