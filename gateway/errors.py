"""vLLM-shaped error bodies and the Falcon error handlers that emit them.

Every failure a client can see is ``{"error": {"message", "type", "param", "code"}}``
(vLLM's ``ErrorResponse``); an unexpected exception is logged and becomes a 500 with
the same shape, never a Falcon HTML/JSON page of another shape.
"""
from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Optional

import falcon
import msgspec

from common.errors import BadRequest, ServingError
from gateway.generate_api.protocol import ErrorInfo, ErrorResponse, json_encoder

log = logging.getLogger("tokserve.gateway")


class PayloadTooLarge(ServingError):
    status = 413
    type = "RequestEntityTooLarge"


# Error messages that quote the request (a bad value, a decoder's path) are cut here,
# whatever built them: a 400 must not be megabytes.
MAX_ERROR_MESSAGE_CHARS = 4096


def error_json(message: str, type: str, status: int, param: Optional[str] = None) -> bytes:
    if len(message) > MAX_ERROR_MESSAGE_CHARS:
        cut = len(message) - MAX_ERROR_MESSAGE_CHARS
        message = f"{message[:MAX_ERROR_MESSAGE_CHARS]}... ({cut} more characters)"
    return json_encoder.encode(ErrorResponse(ErrorInfo(message=message, type=type, param=param, code=status)))


def serving_error_json(err: ServingError) -> bytes:
    return error_json(err.message, err.type, err.status, err.param)


def stream_error_json(exc: Exception, what: str) -> tuple[int, bytes]:
    """A failure after an SSE stream began (the status line is sent): the status to
    account it under and the error body for its last event.  Broker, worker and
    validation errors keep their status and message; anything else is logged and
    becomes vLLM's 500 shape."""
    if isinstance(exc, ServingError):
        return exc.status, serving_error_json(exc)
    log.error("error while streaming %s", what, exc_info=exc)
    return 500, serving_error_json(ServingError(f"Internal server error: {type(exc).__name__}"))


def bad_request_from_decode_error(err: msgspec.MsgspecError) -> BadRequest:
    """msgspec's messages name the offending path (``... - at `$.sampling_params.n```)."""
    if isinstance(err, msgspec.DecodeError) and not isinstance(err, msgspec.ValidationError):
        return BadRequest(f"JSON decode error: {err}")
    message = str(err)
    param = None
    if " - at `$." in message:
        param = message.rsplit(" - at `$.", 1)[1].rstrip("`")
    return BadRequest(message, param)


def _write(resp: falcon.asgi.Response, status: int, body: bytes) -> None:
    resp.status = status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = body


async def handle_serving_error(req, resp, err: ServingError, params) -> None:
    _write(resp, err.status, serving_error_json(err))
    if err.status == 408:
        # The body timed out part-way: the rest of it may still trickle in, so the
        # connection cannot carry another request (uvicorn closes it after this response).
        resp.set_header("Connection", "close")


async def handle_recursion(req, resp, err: RecursionError, params) -> None:
    # Deeply nested input that got past the JSON decoder (whose own limit is a 400 in
    # gateway/body.py) and overflowed Python's stack further on: bad input, not a 500.
    _write(resp, 400, error_json("The request is nested too deeply.", "BadRequestError", 400))


async def handle_http_error(req, resp, err: falcon.HTTPError, params) -> None:
    # Routing errors (404 unknown path, 405 method) keep their status in vLLM's shape.
    status = err.status_code
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    message = f"{phrase}: {err.description}" if err.description else phrase
    _write(resp, status, error_json(message, phrase.replace(" ", "").replace("-", "") + "Error", status))


async def handle_unexpected(req, resp, err: Exception, params) -> None:
    log.exception("unhandled error on %s %s", req.method, req.path)
    _write(resp, 500, error_json(f"Internal server error: {type(err).__name__}", "InternalServerError", 500))


def install(app: falcon.asgi.App) -> None:
    # Falcon picks the most specific handler by MRO, so the order here does not matter.
    app.add_error_handler(Exception, handle_unexpected)
    app.add_error_handler(RecursionError, handle_recursion)
    app.add_error_handler(falcon.HTTPError, handle_http_error)
    app.add_error_handler(ServingError, handle_serving_error)
