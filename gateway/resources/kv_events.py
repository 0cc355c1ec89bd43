"""What an outside router reads to route by cached prefix across cells.

vllm-router's ``--policy kv_aware`` treats each backend URL (here: one cell's gateway)
as one cache: it asks ``GET /get_server_info`` for the cache identity (model, KV block
size, instance id) and ``GET /kv_event_sources`` for the ZeroMQ KV-event publisher to
subscribe to (vllm-router src/kv_index/discovery.py), then matches each request's token
ids against the blocks the cell announced.  The publisher is the broker's
(broker/kv_publisher.py, ``tokserve broker --kv-events-endpoint``): it speaks for every
worker of the cell, so the map has one entry, rank 0.

``/kv_event_sources`` is vLLM's ``{dp_rank: KVEventsConfig}`` (``asdict`` of
vllm/config/kv_events.py) plus the two wire declarations vllm-router requires of HTTP
backends (``encoding: "msgpack"``, ``schema_version: 1``); ``{}`` while the broker
publishes nothing, as vLLM without ``--kv-events-config``.  ``/get_server_info`` is the
shape vllm-router reads (SGLang's route name; vLLM has no such route).  Both need the
API key like every route but the probes.
"""
from __future__ import annotations

import falcon

from common.errors import Overloaded
from gateway.generate_api.protocol import json_encoder
from gateway.state import GatewayState

PUB_HWM = 10_000  # broker/kv_publisher.py PUB_HWM (not imported: the gateway never imports the broker)


def _json(resp, body) -> None:
    resp.status = falcon.HTTP_200
    resp.content_type = falcon.MEDIA_JSON
    resp.data = json_encoder.encode(body)


def kv_events_config(endpoint: str) -> dict:
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "replay_endpoint": None,  # no replay socket: a subscriber that misses a batch resets this cell
        "buffer_steps": 0,
        "hwm": PUB_HWM,
        "max_queue_size": PUB_HWM,
        "topic": "",
        "encoding": "msgpack",
        "schema_version": 1,
    }


class KvEventSources:
    def __init__(self, state: GatewayState, has_broker: bool = True):
        self.state = state
        self.has_broker = has_broker  # a render-only gateway has no engines: {} as vLLM's

    async def on_get(self, req, resp):
        endpoint = (await self.state.cluster.get()).kv_events_endpoint if self.has_broker else None
        _json(resp, {"0": kv_events_config(endpoint)} if endpoint else {})


class GetServerInfo:
    def __init__(self, state: GatewayState):
        self.state = state

    async def on_get(self, req, resp):
        cluster = await self.state.cluster.fresh()
        model = cluster.model
        if model is None:
            raise Overloaded("No inference worker is available yet.")
        # The cache identity is the weights (vLLM's model_config.model), not a served alias:
        # cells serving one model under different names still share one prefix index.
        _json(resp, {"model_id": model.name, "model_path": model.name, "instance_id": cluster.instance_id or None,
                     "kv_block_size": model.kv_block_size, "worker_type": "regular"})


def add_routes(app, state: GatewayState) -> None:
    app.add_route("/kv_event_sources", KvEventSources(state))
    app.add_route("/get_server_info", GetServerInfo(state))
