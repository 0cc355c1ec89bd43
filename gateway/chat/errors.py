"""The one exception the chat-template code raises for anything a client sent."""
from __future__ import annotations

from typing import Optional

from common.errors import BadRequest


class ChatTemplateError(BadRequest, ValueError):
    """A request the chat template cannot render: a 400 whose message is vLLM's where
    vLLM has one.  It is a ``BadRequest`` so the gateway's ServingError handler turns
    it into vLLM's error JSON as is, and a ``ValueError`` for callers that only know
    the standard library."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message, param)
