"""Request fields vLLM 0.32's generate endpoint accepts that this server does not serve.

Silently dropping one would change what the client gets without telling it (a JSON
schema ignored, images never seen), so a request that sets one to anything but its
default is a 400 naming the field.  Defaults (what clients that serialise every field
send when they mean "off") pass.  The fields' types are checked at decode time
(gateway/generate_api/protocol.py), as vLLM's pydantic model checks them.

Not listed, so accepted: fields with no effect on what the client gets here
(``INERT_SAMPLING_FIELDS``), and ``structured_outputs`` with ``reasoning_ended`` /
``reasoning_parser_kwargs``, served by gateway/structured_outputs/.  Keys vLLM's model does not have
(``lora_request`` ...) are ignored, as pydantic's default ``extra="ignore"`` does in vLLM.
"""
from __future__ import annotations

from typing import Any

import msgspec

from common.errors import BadRequest
from gateway.generate_api.protocol import HttpGenerateRequest

# field -> values that mean "not used" (vLLM's defaults, and their equivalents)
REQUEST_FIELDS: dict[str, tuple[Any, ...]] = {}
# content_parts (raw multimodal input) and features (pre-processed tensors) are served for
# images: gateway/multimodal.py, gateway/mm_features.py.
_HINTS: dict[str, str] = {}
SAMPLING_FIELDS: dict[str, tuple[Any, ...]] = {
    "watermarking": (None, False),
    "prompt_logprob_start": (None, 0),  # 0: the first row, vLLM's default
    "logprob_token_ids": (None,),
    "stream_interval": (None, 1),
    "extra_args": (None, {}),
    "skip_reading_prefix_cache": (None, False),
    "thinking_token_budget": (None,),
    "repetition_detection": (None,),
    "trace_decode_token_ids": (None,),
}
# Decoded (type-checked) and dropped: nothing a client can observe depends on them here.
# output_text_buffer_length: vLLM derives it from the stop strings (render emits it so); it only
# holds streamed text back, which the workers do from the stop strings themselves.
INERT_SAMPLING_FIELDS = ("output_kind", "flat_logprobs", "skip_clone", "output_text_buffer_length")


def _unused(value: Any, defaults: tuple[Any, ...]) -> bool:
    # type() keeps True from passing for a default of 1 and 0 for False.
    return value is msgspec.UNSET or any(value is d or (type(value) is type(d) and value == d) for d in defaults)


def refuse_unserved(http: HttpGenerateRequest) -> None:
    for name, defaults in REQUEST_FIELDS.items():
        if not _unused(getattr(http, name), defaults):
            raise BadRequest(f"`{name}` is not supported by this server.{_HINTS.get(name, '')}", name)
    sp = http.sampling_params
    for name, defaults in SAMPLING_FIELDS.items():
        if not _unused(getattr(sp, name), defaults):
            raise BadRequest(f"`sampling_params.{name}` is not supported by this server.", f"sampling_params.{name}")
