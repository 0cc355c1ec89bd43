"""``POST /inference/v1/abort_requests`` (and the legacy ``/abort_requests`` of --tokens-only)."""
from __future__ import annotations

import asyncio
import logging

import falcon
import msgspec

from common.errors import BadRequest
from gateway.body import read_body
from gateway.generate_api.protocol import abort_request_decoder
from gateway.generate_api.request_mapping import REQUEST_ID_PREFIX
from gateway.state import GatewayState

log = logging.getLogger("tokserve.gateway")


def ids_to_abort(request_ids: list[str]) -> list[str]:
    """Responses carry ``generate-tokens-<id>``; accept that or the bare id the client chose."""
    out = []
    for rid in request_ids:
        out.append(rid)
        if not rid.startswith(REQUEST_ID_PREFIX):
            out.append(REQUEST_ID_PREFIX + rid)
    return out


class AbortResource:
    def __init__(self, state: GatewayState):
        self.state = state
        self._pending: set[asyncio.Task] = set()

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        body = await read_body(req, self.state.settings.max_body_bytes)
        try:
            parsed = abort_request_decoder.decode(body)
        except msgspec.ValidationError as exc:
            raise BadRequest(str(exc), "request_ids") from None
        except msgspec.DecodeError as exc:
            raise BadRequest(f"JSON decode error: {exc}") from None
        if parsed.request_ids is None:
            raise BadRequest("Missing 'request_ids' in request body", None)  # vLLM's HTTPException: no param
        # Like vLLM, answer at once and abort in the background.
        task = asyncio.ensure_future(self._abort(ids_to_abort(parsed.request_ids)))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        resp.status = falcon.HTTP_200
        resp.data = b""

    async def _abort(self, request_ids: list[str]) -> None:
        try:
            await self.state.client.abort(request_ids)
        except Exception:
            log.warning("abort of %s failed", request_ids, exc_info=True)
