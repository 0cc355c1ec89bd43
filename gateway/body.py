"""Read a request body with a size cap (413 instead of buffering an unbounded upload)."""
from __future__ import annotations

import msgspec

from common.errors import BadRequest
from gateway.errors import PayloadTooLarge


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


async def json_object_body(req, limit: int) -> dict:
    """A JSON object body (an empty body is ``{}``); 400 for anything else."""
    body = await read_body(req, limit)
    if not body.strip():
        return {}
    try:
        parsed = msgspec.json.decode(body)
    except msgspec.DecodeError:
        raise BadRequest("Invalid JSON format") from None
    if not isinstance(parsed, dict):
        raise BadRequest("Request body must be a JSON object")
    return parsed
