"""vLLM 0.33's RL and dev routes (``vllm/entrypoints/rl/online/api_router.py``,
``vllm/entrypoints/serve/dev/``), served across the whole worker pool.

Same paths, parameters and response bodies as vLLM.  Each route is one CONTROL
command through the broker (common/client.py ``control``), which fans it out to
every live worker and aggregates the replies; ``?rank=N`` (beyond vLLM) targets
one worker.  Refusals come back as vLLM-shaped 4xx errors naming the rank.
"""
from __future__ import annotations

from typing import Any, Optional

import falcon

from common.errors import BadRequest
from gateway.body import json_object_body
from gateway.generate_api.protocol import json_encoder
from gateway.state import GatewayState

PAUSE_MODES = ("abort", "wait", "keep")
WAKE_UP_TAGS = ("weights", "kv_cache", "scheduling")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _bool(req, name: str, default: bool) -> bool:
    raw = req.get_param(name)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise BadRequest(f"query parameter {name}={raw!r} is not a boolean", query(name))


def _int(req, name: str, default: Optional[int]) -> Optional[int]:
    raw = req.get_param(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise BadRequest(f"query parameter {name}={raw!r} is not an integer", query(name)) from None


def _mode(req) -> str:
    mode = req.get_param("mode") or "abort"
    if mode not in PAUSE_MODES:
        raise BadRequest(f"unknown pause mode {mode!r}: expected one of {', '.join(PAUSE_MODES)}", query("mode"))
    return mode


def query(name: str) -> str:
    """A query parameter's ``param``: FastAPI's location form, as vLLM's validation errors name it."""
    return f"query.{name}"


def body_field(name: str) -> str:
    """A body field's ``param`` on routes vLLM declares with ``Body(embed=True)``."""
    return f"body.{name}"


def _respond(resp, content: Any) -> None:
    resp.status = falcon.HTTP_200
    resp.content_type = falcon.MEDIA_JSON
    resp.data = json_encoder.encode(content)


class _Route:
    def __init__(self, state: GatewayState):
        self.state = state

    async def control(self, req, op: str, args: Optional[dict] = None):
        return await self.state.client.control(op, args or {}, rank=_int(req, "rank", None))


class Pause(_Route):
    async def on_post(self, req, resp):
        await self.control(req, "pause", {"mode": _mode(req), "clear_cache": _bool(req, "clear_cache", True)})
        _respond(resp, {"status": "paused"})


class Resume(_Route):
    async def on_post(self, req, resp):
        await self.control(req, "resume")
        _respond(resp, {"status": "resumed"})


class IsPaused(_Route):
    async def on_get(self, req, resp):
        _respond(resp, (await self.control(req, "is_paused")).result)


class AbortAll(_Route):
    """``POST /abort_requests``: the given request ids, or with none every request in flight."""

    async def on_post(self, req, resp):
        from gateway.resources.abort import ids_to_abort

        body = await json_object_body(req, self.state.settings.max_body_bytes)
        ids = body.get("request_ids")
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
            raise BadRequest("request_ids must be a list of strings", body_field("request_ids"))
        reply = await self.state.client.control("abort", {"request_ids": ids_to_abort(ids)} if ids else {})
        aborted = reply.result["aborted"]
        _respond(resp, {"status": "aborted", "aborted": len(ids) if ids else aborted})


class InitWeightTransfer(_Route):
    async def on_post(self, req, resp):
        body = await json_object_body(req, self.state.settings.max_body_bytes)
        if not isinstance(body.get("init_info"), dict):
            raise BadRequest("body needs an 'init_info' object", body_field("init_info"))
        await self.control(req, "init_weight_transfer_engine", {"init_info": body["init_info"]})
        _respond(resp, {"message": "Weight transfer initialized"})


class ShutdownWeightTransfer(_Route):
    async def on_post(self, req, resp):
        await self.control(req, "shutdown_weight_transfer_engine")
        _respond(resp, {"message": "Weight transfer shut down"})


class StartWeightUpdate(_Route):
    async def on_post(self, req, resp):
        await self.control(req, "start_weight_update")
        _respond(resp, {"message": "Weight update started"})


class UpdateWeights(_Route):
    async def on_post(self, req, resp):
        body = await json_object_body(req, self.state.settings.max_body_bytes)
        info = body.get("update_info")
        if not isinstance(info, (dict, list)):
            raise BadRequest("body needs an 'update_info' object", body_field("update_info"))
        await self.control(req, "update_weights", {"update_info": info})
        _respond(resp, {"message": "Weights updated"})


class FinishWeightUpdate(_Route):
    async def on_post(self, req, resp):
        body = await json_object_body(req, self.state.settings.max_body_bytes)
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            raise BadRequest("weight_version must be a string", body_field("weight_version"))
        reply = await self.control(req, "finish_weight_update", {"weight_version": version} if version else {})
        body = {"message": "Weight update finished"}
        result = reply.result if isinstance(reply.result, dict) else {}
        if result.get("lost_ranks") or result.get("failed_ranks"):
            # Committed without some ranks (they died): vLLM's body plus what the trainer needs
            # to know (which ranks, and whether the pool rebuilds them from disk by itself).
            body.update(result)
        _respond(resp, body)


class UpdateWeightVersion(_Route):
    async def on_post(self, req, resp):
        body = await json_object_body(req, self.state.settings.max_body_bytes)
        version = body.get("new_version")
        if not isinstance(version, str) or not version:
            raise BadRequest("body needs a non-empty 'new_version' string", body_field("new_version"))
        await self.control(req, "update_weight_version", {"new_version": version})
        _respond(resp, {"success": True, "new_version": version})


class WeightInfo(_Route):
    async def on_get(self, req, resp):
        _respond(resp, (await self.control(req, "weight_info")).result)


class WeightChecker(_Route):
    async def on_post(self, req, resp):
        body = await json_object_body(req, self.state.settings.max_body_bytes)
        action, baseline = body.get("action"), body.get("baseline")
        if action not in ("checksum", "reset", "compare"):
            raise BadRequest(f"unknown action {action!r}: expected checksum, reset or compare", body_field("action"))
        if action == "compare" and not isinstance(baseline, dict):
            # vLLM raises an HTTPException here: no param
            raise BadRequest("action='compare' requires a 'baseline' object", None)
        reply = await self.control(req, "weight_checker", {"action": action})
        if action == "reset":
            _respond(resp, {"status": "reset"})
            return
        checksums: dict[str, str] = {}
        for rank in reply.ranks:
            checksums.update(rank.result["checksums"])  # keys carry the rank (dp{r}:...), never collide
        if action == "checksum":
            _respond(resp, {"checksums": checksums})
            return
        mismatches = sorted(k for k in checksums.keys() | baseline.keys() if checksums.get(k) != baseline.get(k))
        _respond(resp, {"match": not mismatches, "mismatches": mismatches})


class WorldSize(_Route):
    async def on_get(self, req, resp):
        reply = await self.state.client.control("get_world_size", {"include_dp": _bool(req, "include_dp", True)})
        _respond(resp, reply.result)


class ResetPrefixCache(_Route):
    async def on_post(self, req, resp):
        if _bool(req, "reset_external", False):
            raise BadRequest("reset_external: no external (connector-managed) prefix cache is configured",
                             query("reset_external"))
        _bool(req, "reset_running_requests", False)  # validated; running requests never share stale blocks
        reply = await self.control(req, "reset_prefix_cache")
        _respond(resp, {"success": all(r.result.get("success") for r in reply.ranks)})


class Sleep(_Route):
    async def on_post(self, req, resp):
        level = _int(req, "level", 1)
        if not 0 <= level <= 2:
            raise BadRequest(f"level must be 0, 1 or 2, got {level}", query("level"))
        await self.control(req, "sleep", {"level": level, "mode": _mode(req)})
        _respond(resp, {"status": "sleeping", "level": level})


class WakeUp(_Route):
    async def on_post(self, req, resp):
        tags = req.get_param_as_list("tags") or None
        unknown = sorted(set(tags or ()) - set(WAKE_UP_TAGS))
        if unknown:
            raise BadRequest(f"unknown wake_up tag(s) {unknown}: expected weights, kv_cache", query("tags"))
        reply = await self.control(req, "wake_up", {"tags": tags} if tags else {})
        awake = all(r.result.get("fully_awake") for r in reply.ranks)
        _respond(resp, {"status": "awake" if awake else "sleeping", "tags": tags})


class IsSleeping(_Route):
    async def on_get(self, req, resp):
        reply = await self.control(req, "is_sleeping")
        _respond(resp, {"is_sleeping": any(r.result.get("is_sleeping") for r in reply.ranks)})


ROUTES = {
    "/pause": Pause, "/resume": Resume, "/is_paused": IsPaused, "/abort_requests": AbortAll,
    "/init_weight_transfer_engine": InitWeightTransfer, "/shutdown_weight_transfer_engine": ShutdownWeightTransfer,
    "/start_weight_update": StartWeightUpdate, "/update_weights": UpdateWeights,
    "/finish_weight_update": FinishWeightUpdate, "/update_weight_version": UpdateWeightVersion,
    "/weight_info": WeightInfo, "/weight_checker": WeightChecker, "/get_world_size": WorldSize,
    "/reset_prefix_cache": ResetPrefixCache, "/sleep": Sleep, "/wake_up": WakeUp, "/is_sleeping": IsSleeping,
}


def add_routes(app: falcon.asgi.App, state: GatewayState) -> None:
    for path, resource in ROUTES.items():
        app.add_route(path, resource(state))
