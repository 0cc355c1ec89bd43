"""Read a request body with a size cap (413 instead of buffering an unbounded upload)
and decode it as JSON (400 for what does not decode, nesting too deep included)."""
from __future__ import annotations

from typing import Optional

import msgspec

from common.errors import BadRequest
from gateway.errors import PayloadTooLarge


def is_json(content_type: Optional[str]) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() == "application/json"


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"Request body exceeds the limit of {limit} bytes.")


async def read_body(req, limit: int) -> bytes:
    if req.content_length is not None and req.content_length > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    # Chunked uploads carry no Content-Length: count as the body arrives.
    async for chunk in req.stream:
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


TOO_DEEP = "The JSON body is nested too deeply."


def decode_json(decoder, body: bytes):
    """``decoder.decode(body)`` (a msgspec decoder or ``msgspec.json``); a 400 instead of
    msgspec's RecursionError for a body nested past its depth limit (a 200k-deep
    kv_transfer_params was a 500)."""
    from gateway.errors import bad_request_from_decode_error

    try:
        return decoder.decode(body)
    except RecursionError:
        raise BadRequest(TOO_DEEP) from None
    except msgspec.MsgspecError as exc:
        raise bad_request_from_decode_error(exc) from None


async def json_object_body(req, limit: int) -> dict:
    """A JSON object body (an empty body is ``{}``); 400 for anything else."""
    body = await read_body(req, limit)
    if not body.strip():
        return {}
    try:
        parsed = msgspec.json.decode(body)
    except RecursionError:
        raise BadRequest(TOO_DEEP) from None
    except msgspec.DecodeError:
        raise BadRequest("Invalid JSON format") from None
    if not isinstance(parsed, dict):
        raise BadRequest("Request body must be a JSON object")
    return parsed
