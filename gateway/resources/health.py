"""``GET /health``: 200 while at least one worker is alive, else 503."""
from __future__ import annotations

import falcon

from common.errors import ServingError
from gateway.state import GatewayState


class HealthResource:
    def __init__(self, state: GatewayState):
        self.state = state

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        try:
            info = await self.state.cluster.get()
            alive = any(w.alive for w in info.workers) and info.model is not None
        except ServingError:
            alive = False
        resp.status = falcon.HTTP_200 if alive else falcon.HTTP_503
        resp.data = b""
