"""vLLM's runtime LoRA routes (``vllm/entrypoints/serve/lora/api_router.py``):
``POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}`` and
``POST /v1/unload_lora_adapter {"lora_name"}``, served across the pool.

Each is one CONTROL command the broker fans out to every live worker; a worker
reads and validates the adapter before it answers, so a bad path or a refused
adapter comes back as a 400 and an unknown name as a 404, in vLLM's error shape
and words.  Success is vLLM's plain-text line.  Enabled by --allow-runtime-lora or
VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, as in vLLM.
"""
from __future__ import annotations

import re

import falcon

from common.client import RequestError
from common.errors import BadRequest
from gateway.body import json_object_body
from gateway.generate_api.request_mapping import base_model_names
from gateway.state import GatewayState

_RANK_PREFIX = re.compile(r"^rank \d+: ")


def _worker_message(exc: RequestError) -> RequestError:
    """The workers' own words: every refusing rank says the same, so drop the rank prefixes."""
    parts = {_RANK_PREFIX.sub("", p) for p in exc.message.split("; ")}
    if len(parts) == 1:
        return RequestError(parts.pop(), exc.status, exc.type)
    return exc


def _invalid(message: str) -> BadRequest:
    """vLLM's error for the request checks of these routes: 400 InvalidUserInput, no param."""
    return BadRequest(message, type="InvalidUserInput")


def _string(body: dict, name: str) -> str:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"'{name}' must be a string", f"body.{name}")  # vLLM's pydantic body location
    return value or ""


class _LoRARoute:
    op = ""

    def __init__(self, state: GatewayState):
        self.state = state

    async def on_post(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        body = await json_object_body(req, self.state.settings.max_body_bytes)
        args, message = self.args(body)
        await self.check(args)
        try:
            await self.state.client.control(self.op, args)
        except RequestError as exc:
            raise _worker_message(exc) from None
        finally:
            self.state.cluster.invalidate()  # /v1/models and `model` resolution see the change at once
        resp.status = falcon.HTTP_200
        resp.content_type = falcon.MEDIA_TEXT
        resp.text = message


    async def check(self, args: dict) -> None:
        pass


class LoadLoRAAdapter(_LoRARoute):
    op = "load_lora_adapter"

    async def check(self, args: dict) -> None:
        model = await self.state.cluster.model()
        if args["lora_name"] in base_model_names(model, self.state.settings.served_model_names):
            raise _invalid(f"The lora adapter '{args['lora_name']}' conflicts with a served base model.")

    def args(self, body: dict):
        name, path = _string(body, "lora_name"), _string(body, "lora_path")
        if not name or not path:
            raise _invalid("Both 'lora_name' and 'lora_path' must be provided.")
        inplace = body.get("load_inplace", False)
        if not isinstance(inplace, bool):
            raise BadRequest("'load_inplace' must be a boolean", "body.load_inplace")
        if body.get("is_3d_lora_weight"):
            raise BadRequest("is_3d_lora_weight: LoRA on mixture-of-experts expert weights is not supported",
                             "is_3d_lora_weight")
        return ({"lora_name": name, "lora_path": path, "load_inplace": inplace},
                f"Success: LoRA adapter '{name}' added successfully.")


class UnloadLoRAAdapter(_LoRARoute):
    op = "unload_lora_adapter"

    def args(self, body: dict):
        name = _string(body, "lora_name")
        if not name:
            raise _invalid("'lora_name' needs to be provided to unload a LoRA adapter.")
        return {"lora_name": name}, f"Success: LoRA adapter '{name}' removed successfully."


def add_routes(app: falcon.asgi.App, state: GatewayState) -> None:
    app.add_route("/v1/load_lora_adapter", LoadLoRAAdapter(state))
    app.add_route("/v1/unload_lora_adapter", UnloadLoRAAdapter(state))
