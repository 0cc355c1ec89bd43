"""Read a request body with a size cap (413 instead of buffering an unbounded upload)
and decode it as JSON (400 for what does not decode, nesting too deep included)."""
from __future__ import annotations

import re
from typing import Any, Optional

import msgspec

from common.errors import BadRequest
from gateway.errors import PayloadTooLarge


def is_json(content_type: Optional[str]) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() == "application/json"


# An over-limit body is read on and thrown away, up to this many times the limit, before
# the 413 goes out: answered while the client still uploads, the connection closes under
# it and the client sees a reset (a 50 MB derender body) instead of the 413.  Past this
# the 413 is sent at once (the client may then see the reset): draining costs bandwidth
# and time (--body-read-timeout bounds that), not memory.
DRAIN_FACTOR = 4


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"Request body exceeds the limit of {limit} bytes.")


async def _discard_rest(stream, budget: int) -> None:
    async for chunk in stream:
        budget -= len(chunk)
        if budget < 0:
            return


async def read_body(req, limit: int) -> bytes:
    drain = DRAIN_FACTOR * limit
    if req.content_length is not None and req.content_length > limit:
        if req.content_length <= drain:
            await _discard_rest(req.stream, drain)
        raise _too_large(limit)
    chunks, size = [], 0
    # Chunked uploads carry no Content-Length: count as the body arrives.
    async for chunk in req.stream:
        size += len(chunk)
        if size > limit:
            chunks.clear()
            await _discard_rest(req.stream, drain - size)
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


TOO_DEEP = "The JSON body is nested too deeply."


def decode_json(decoder, body: bytes):
    """``decoder.decode(body)`` (a msgspec decoder or ``msgspec.json``); a 400 instead of
    msgspec's RecursionError for a body nested past its depth limit (a 200k-deep
    kv_transfer_params was a 500).  A field of the wrong type or shape is named as vLLM's
    validation handler names it: ``body.`` and the pydantic location (``body.token_ids.1``)."""
    try:
        return decoder.decode(body)
    except RecursionError:
        raise BadRequest(TOO_DEEP) from None
    except msgspec.ValidationError as exc:
        target = getattr(decoder, "type", None)
        if target is not None and _int_wanted(exc) is not None:
            return _decode_lax_ints(body, target, exc)
        raise _body_error(exc) from None
    except msgspec.MsgspecError as exc:
        raise _body_error(exc) from None


_AT = re.compile(r" - at `\$((?:\.\w+|\[\d+\])*)`$")
_MISSING = re.compile(r"^Object missing required field `(\w+)`")


def body_param(message: str) -> Optional[str]:
    """msgspec's path (``- at `$.token_ids[1]```) in vLLM's ``param`` form: ``body.token_ids.1``
    (FastAPI's loc joined by dots); a missing field is named after its object."""
    at, missing = _AT.search(message), _MISSING.match(message)
    if at is None and missing is None:
        return None
    steps = [name or index for name, index in _STEP.findall(at.group(1))] if at is not None else []
    return ".".join(["body", *steps, *([missing.group(1)] if missing else [])])


def _body_error(exc: msgspec.MsgspecError) -> BadRequest:
    from gateway.errors import bad_request_from_decode_error

    err = bad_request_from_decode_error(exc)
    if isinstance(exc, msgspec.ValidationError):
        err.param = body_param(str(exc))
    return err


# msgspec's "an int was expected, a float came" error, and the path it names.
_INT_GOT_FLOAT = re.compile(r"^Expected `([^`]*)`, got `float` - at `\$((?:\.\w+|\[\d+\])*)`$")
_STEP = re.compile(r"\.(\w+)|\[(\d+)\]")
_MAX_LAX_RETRIES = 32


def _int_wanted(exc: msgspec.ValidationError) -> Optional[list]:
    """The path (keys / indexes) of a float where an int was expected, else None."""
    m = _INT_GOT_FLOAT.match(str(exc))
    if m is None or not re.search(r"\bint\b", m.group(1)):
        return None
    return [name if name else int(index) for name, index in _STEP.findall(m.group(2))]


def _decode_lax_ints(body: bytes, target: Any, first: msgspec.ValidationError):
    """vLLM's pydantic models take an integral float for an int field (``"max_tokens": 1e18``
    is 10**18, then clamped as any int) and refuse a fractional one.  msgspec refuses both:
    the floats it names are made ints (the whole list at once for a list element) and the
    body converted again."""
    try:
        raw = msgspec.json.decode(body)
    except (msgspec.MsgspecError, RecursionError):  # e.g. a number past float range further on
        raise _body_error(first) from None
    exc = first
    for _ in range(_MAX_LAX_RETRIES):
        path = _int_wanted(exc)
        if path is None:
            break
        try:
            parent = raw
            for step in path[:-1]:
                parent = parent[step]
            value = parent[path[-1]]
        except (KeyError, IndexError, TypeError):  # not where the path says: keep msgspec's error
            break
        if not isinstance(value, float) or not value.is_integer():
            where = str(exc).rsplit(" - at `$.", 1)[-1].rstrip("`")
            raise BadRequest(f"Input should be a valid integer, got a number with a fractional part: {value!r} "
                             f"- at `$.{where}`", body_param(str(exc))) from None
        if isinstance(path[-1], int):  # a list of ids: all of its integral floats in one go
            parent[:] = [int(v) if isinstance(v, float) and v.is_integer() else v for v in parent]
        else:
            parent[path[-1]] = int(value)
        try:
            return msgspec.convert(raw, target)
        except msgspec.ValidationError as again:
            exc = again
        except RecursionError:
            raise BadRequest(TOO_DEEP) from None
    raise _body_error(exc) from None


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
