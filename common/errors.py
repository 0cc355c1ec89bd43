"""Errors that cross process boundaries carry an HTTP status so each hop maps them
without guessing (vLLM's error JSON: {"error": {"message", "type", "param", "code"}})."""
from __future__ import annotations

from typing import Optional


class ServingError(Exception):
    status: int = 500
    type: str = "InternalServerError"

    def __init__(self, message: str, param: Optional[str] = None, *, status: Optional[int] = None,
                 type: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type

    def to_json(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class BadRequest(ServingError):
    """Invalid input (400). Raised by validation in the gateway and, for direct ZMQ
    clients, again in the engine's add_request."""

    status = 400
    type = "BadRequestError"


class NotFound(ServingError):
    status = 404
    type = "NotFoundError"


class Overloaded(ServingError):
    """Queue full, or no live worker (503)."""

    status = 503
    type = "ServiceUnavailableError"


class RequestFailed(ServingError):
    """A started request was lost to an engine/worker failure (500)."""

    status = 500
    type = "InternalServerError"
