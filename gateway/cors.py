"""``OPTIONS`` and CORS: vLLM's ``--allowed-origins`` family, off unless configured.

Falcon answers ``OPTIONS`` on every route by itself (200 and an ``Allow`` header), and the
API-key check let ``OPTIONS`` through for the sake of CORS preflights: any client got a
keyless 200 on every route, CORS configured or not.  Here

- ``CorsMiddleware`` (only with ``--allowed-origins``): answers browsers' preflights
  (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) before routing and
  before the key check, as vLLM's Starlette ``CORSMiddleware`` does (a browser never sends
  credentials on a preflight), and adds ``Access-Control-Allow-Origin`` to the answers to
  allowed origins.  Its rules are Starlette's, so a browser sees what vLLM would send;
- ``RefuseBareOptions``: any other ``OPTIONS`` is a method like the rest: 401 without the
  key where one is needed (gateway/auth.py decides first), else 405 in vLLM's error shape.

vLLM turns CORS on for every origin by default; tokserve leaves it off until the operator
names origins (docs/differences.md, "Differences from vLLM").
"""
from __future__ import annotations

from dataclasses import dataclass, field

import falcon

ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")  # Starlette's for "*"
PREFLIGHT_MAX_AGE_S = 600  # Starlette's default, so vLLM's


@dataclass
class CorsPolicy:
    allowed_origins: list[str]
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


class CorsMiddleware:
    def __init__(self, policy: CorsPolicy):
        self.allow_all_origins = "*" in policy.allowed_origins
        self.origins = frozenset(policy.allowed_origins)
        self.allow_all_headers = "*" in policy.allowed_headers
        self.headers = frozenset(h.lower() for h in policy.allowed_headers) | {
            "accept", "accept-language", "content-language", "content-type"}  # CORS-safelisted
        self.methods = ALL_METHODS if "*" in policy.allowed_methods else tuple(m.upper()
                                                                                for m in policy.allowed_methods)
        self.credentials = policy.allow_credentials

    def _origin_allowed(self, origin: str) -> bool:
        return self.allow_all_origins or origin in self.origins

    def _allow_origin_headers(self, resp, origin: str) -> None:
        if self.allow_all_origins and not self.credentials:
            resp.set_header("Access-Control-Allow-Origin", "*")
        else:
            # One origin echoed: caches must key the answer on it.
            resp.set_header("Access-Control-Allow-Origin", origin)
            resp.append_header("Vary", "Origin")
        if self.credentials:
            resp.set_header("Access-Control-Allow-Credentials", "true")

    async def process_request(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        origin = req.get_header("Origin")
        method = req.get_header("Access-Control-Request-Method")
        if req.method != "OPTIONS" or not origin or not method:
            return
        requested = [h.strip().lower() for h in (req.get_header("Access-Control-Request-Headers") or "").split(",")
                     if h.strip()]
        failures = []
        if not self._origin_allowed(origin):
            failures.append("origin")
        if method.upper() not in self.methods:
            failures.append("method")
        if not self.allow_all_headers and any(h not in self.headers for h in requested):
            failures.append("headers")
        resp.complete = True  # no routing, no key check: the preflight is answered here
        req.context.cors_preflight = True
        # Starlette's headers, sent on a refusal too (the browser refuses a non-2xx anyway).
        if "origin" not in failures:
            self._allow_origin_headers(resp, origin)
        resp.set_header("Access-Control-Allow-Methods", ", ".join(self.methods))
        resp.set_header("Access-Control-Max-Age", str(PREFLIGHT_MAX_AGE_S))
        if self.allow_all_headers:
            if requested:
                resp.set_header("Access-Control-Allow-Headers", ", ".join(requested))
        else:
            resp.set_header("Access-Control-Allow-Headers", ", ".join(sorted(self.headers)))
        resp.content_type = falcon.MEDIA_TEXT
        if failures:
            # Starlette's answer to a refused preflight: 400, plain text.
            resp.status = falcon.HTTP_400
            resp.text = "Disallowed CORS " + ", ".join(failures)
        else:
            resp.status = falcon.HTTP_200
            resp.text = "OK"

    async def process_response(self, req, resp, resource, req_succeeded: bool) -> None:
        origin = req.get_header("Origin")
        if origin and self._origin_allowed(origin) and not getattr(req.context, "cors_preflight", False):
            self._allow_origin_headers(resp, origin)


class RefuseBareOptions:
    """Falcon's default ``OPTIONS`` responder (a keyless 200 on every route) turned into
    405; placed after the key check, which answers 401 first where a key is needed."""

    async def process_resource(self, req, resp, resource, params) -> None:
        if req.method != "OPTIONS" or resp.complete or hasattr(resource, "on_options"):
            return
        allowed = sorted(m for m in ALL_METHODS if m != "OPTIONS" and hasattr(resource, f"on_{m.lower()}"))
        raise falcon.HTTPMethodNotAllowed(allowed)


def http_middleware(cors: CorsPolicy | None, auth) -> list:
    """The request middleware in order: preflights, then the key, then bare OPTIONS."""
    return [*([CorsMiddleware(cors)] if cors is not None else []), *([auth] if auth is not None else []),
            RefuseBareOptions()]
