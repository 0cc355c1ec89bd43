"""``--api-key``: a Bearer token on every route but the probes (vLLM's AuthenticationMiddleware, wider).

vLLM checks only paths starting with ``/v1``; here every route the gateway serves needs
the key except :data:`OPEN_ROUTES` (``/health``, ``/metrics``, ``/version``), so that
probes and scrapers need no secret while the RL, LoRA, tokenize and generate routes
all do.

Protection is decided from the route Falcon actually matched (``req.uri_template``,
in ``process_resource``), never from the raw path: the router ignores empty
segments and decodes percent-escapes, so ``//pause``, ``///v1/models`` and
``/%70ause`` reach the same resources as their plain spellings and must get the same
answer.  A path that matches no route is a 404 whatever the key, so nothing is
served without it.

Anthropic's clients send the key as ``x-api-key``: the Messages routes
(:data:`X_API_KEY_ROUTES`) take it there as well as a Bearer token, and answer a 401 in
Anthropic's error shape.  :func:`key_scope` names the key a request presented, so
per-key state (stored Responses) is never readable with another key.
"""
from __future__ import annotations

import hashlib
import hmac
from typing import Iterable

import falcon

OPEN_ROUTES = frozenset({"/health", "/metrics", "/version"})
X_API_KEY_ROUTES = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
UNAUTHORIZED_BODY = b'{"error":"Unauthorized"}'
ANTHROPIC_UNAUTHORIZED_BODY = (b'{"type":"error","error":{"type":"authentication_error",'
                               b'"message":"invalid x-api-key"}}')


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class ApiKeyMiddleware:
    def __init__(self, api_keys: str | Iterable[str]):
        keys = [api_keys] if isinstance(api_keys, str) else list(api_keys)
        if not keys or not all(keys):
            raise ValueError("--api-key needs a non-empty key")
        # Hashes of equal length: compare_digest's time depends on neither the key's
        # length nor where a guess differs.
        self._digests = [_digest(k) for k in keys]

    def authorized(self, header: str | None) -> bool:
        token = bearer_token(header)
        return token is not None and self.known(token)

    def known(self, token: str) -> bool:
        presented = _digest(token)
        match = False
        for expected in self._digests:  # no early exit: every key is compared
            match |= hmac.compare_digest(presented, expected)
        return match

    async def process_resource(self, req: falcon.asgi.Request, resp: falcon.asgi.Response, resource,
                               params) -> None:
        # OPTIONS too: CORS preflights, when configured, are answered before this
        # (gateway/cors.py); any other OPTIONS is a method like the rest.
        if req.uri_template in OPEN_ROUTES:
            return
        if self.authorized(req.get_header("Authorization")):
            return
        anthropic = req.uri_template in X_API_KEY_ROUTES
        if anthropic and self.known(req.get_header("x-api-key") or ""):
            return
        resp.status = falcon.HTTP_401
        resp.content_type = falcon.MEDIA_JSON
        resp.data = ANTHROPIC_UNAUTHORIZED_BODY if anthropic else UNAUTHORIZED_BODY
        resp.complete = True


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":  # RFC 7235: the scheme is case-insensitive
        return None
    return token


def key_scope(req) -> str:
    """Who owns per-key state made by ``req``: the SHA-256 of the key it presented (the
    Bearer token, else Anthropic's ``x-api-key``), hex; "" when it presented none (a
    server without --api-key: one shared scope).  Only a digest is kept, never the key."""
    token = bearer_token(req.get_header("Authorization"))
    if token is None:
        token = req.get_header("x-api-key") or ""
    return _digest(token).hex() if token else ""
