"""``--api-key``: Bearer token on /v1 and /inference paths (vLLM's AuthenticationMiddleware).

/health, /metrics and /version stay open so probes and scrapers need no secret; the
RL control routes (``--enable-rl``) are guarded too.
"""
from __future__ import annotations

import hmac

import falcon

PROTECTED_PREFIXES = ("/v1", "/inference")
UNAUTHORIZED_BODY = b'{"error":"Unauthorized"}'


class ApiKeyMiddleware:
    def __init__(self, api_key: str, extra_paths: tuple[str, ...] = ()):
        self._expected = f"Bearer {api_key}".encode()
        self._extra = frozenset(extra_paths)

    def _authorized(self, header: str | None) -> bool:
        # compare_digest keeps the comparison time independent of where the strings differ.
        return header is not None and hmac.compare_digest(header.encode(), self._expected)

    async def process_request(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        if req.method == "OPTIONS" or not (req.path.startswith(PROTECTED_PREFIXES) or req.path in self._extra):
            return
        if not self._authorized(req.get_header("Authorization")):
            resp.status = falcon.HTTP_401
            resp.content_type = falcon.MEDIA_JSON
            resp.data = UNAUTHORIZED_BODY
            resp.complete = True
