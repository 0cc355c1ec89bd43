"""``GET /metrics``: Prometheus text format, scheduler gauges refreshed from the broker."""
from __future__ import annotations

import falcon

from common.errors import ServingError
from gateway.generate_api.request_mapping import served_name
from gateway.state import GatewayState


class MetricsResource:
    def __init__(self, state: GatewayState):
        self.state = state

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        try:
            # Not the request path's cached view: a scrape right after a change (a /sleep
            # answered by this gateway or another) must show it, and scrapes are rare.
            info = await self.state.cluster.fresh()
        except ServingError:
            info = None  # still expose the request metrics while the broker is away
        if info is not None and info.model is not None:
            self.state.metrics.update_cluster(info, served_name(info.model, self.state.settings.served_model_names))
        body, content_type = self.state.metrics.render()
        resp.content_type = content_type
        resp.data = body
