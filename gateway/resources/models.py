"""``GET /v1/models`` (OpenAI list shape) and ``GET /version``."""
from __future__ import annotations

import time

import falcon

from gateway.generate_api.protocol import ModelCard, ModelList, json_encoder
from gateway.generate_api.request_mapping import base_model_names
from gateway.state import GatewayState

_STARTED = int(time.time())


def package_version() -> str:
    try:
        from importlib.metadata import version
        return version("tokserve")
    except Exception:  # running from a source tree that was never installed
        return "0.0.0+unknown"


class ModelsResource:
    def __init__(self, state: GatewayState):
        self.state = state

    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        info = await self.state.cluster.get()
        model = await self.state.cluster.model()
        names = base_model_names(model, self.state.settings.served_model_names)
        cards = [ModelCard(id=name, created=_STARTED, root=model.name, max_model_len=model.max_model_len)
                 for name in names]
        # vLLM's LoRA cards: root = the adapter's path, parent = the base model.
        cards += [ModelCard(id=name, created=_STARTED, root=path, parent=names[0])
                  for name, path in (info.lora_adapters or {}).items()]
        resp.content_type = falcon.MEDIA_JSON
        resp.data = json_encoder.encode(ModelList(data=cards))


class VersionResource:
    async def on_get(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        resp.content_type = falcon.MEDIA_JSON
        resp.data = json_encoder.encode({"version": package_version()})
