"""vLLM's development routes that RL clients use: ``GET /server_info``
(``vllm/entrypoints/serve/dev/server_info``) and ``POST /collective_rpc``
(``vllm/entrypoints/serve/dev/rpc``).  The router-facing ``GET /kv_event_sources`` is in
gateway/resources/kv_events.py.

vLLM registers the first two only in dev mode (``VLLM_SERVER_DEV_MODE=1``); here they
come with ``--enable-rl`` like the other RL and dev routes (gateway/resources/rl.py),
and like every route but the probes they need the API key.

``/server_info`` answers ``{"vllm_config", "vllm_env", "system_env"}``.  ``vllm_config``
holds the fields of vLLM's ``VllmConfig`` that describe this deployment, built from what
the broker reports (the workers' ModelInfo, the live ranks) and the gateway's settings,
never constants: ``model_config`` (model, dtype, max_model_len, max_logprobs,
logprobs_mode, ...), ``cache_config``, ``parallel_config`` (``data_parallel_size`` is the
number of live workers, each one a data-parallel rank), ``scheduler_config``,
``lora_config`` (null without LoRA, as vLLM) and ``weight_transfer_config``.

``/collective_rpc`` runs a worker method by name in vLLM.  Here no code is called by
name: an allow-list maps vLLM's worker methods and SkyRL's worker-extension methods
onto the control plane's commands (``COLLECTIVE_RPC_METHODS``); any other method is a
400 naming it.  The answer is vLLM's: ``{"results": [...]}``, one entry per worker.
"""
from __future__ import annotations

import os
import platform
import sys
from typing import Any, Callable, Optional


from common.errors import BadRequest, Overloaded
from gateway.body import json_object_body
from gateway.resources.rl import _respond
from gateway.state import GatewayState

LOGPROBS_MODE = "raw_logprobs"  # the sampler's logprobs: log_softmax of the raw logits (worker/engine/sample)


# --- /server_info ------------------------------------------------------------------
def vllm_config(state: GatewayState, cluster) -> dict:
    """vLLM's ``VllmConfig`` JSON fields that hold for this deployment."""
    s, model = state.settings, cluster.model
    live = [w for w in cluster.workers if w.alive]
    tp = live[0].world_size if live else 1
    return {
        "model_config": {
            "model": model.name,
            "served_model_name": (s.served_model_names or [model.name])[0],
            "skip_tokenizer_init": not model.has_tokenizer,
            "dtype": model.dtype,
            "max_model_len": model.max_model_len,
            "max_logprobs": model.max_logprobs,
            "logprobs_mode": LOGPROBS_MODE,
            "runner_type": "generate",
        },
        "cache_config": {
            "block_size": model.kv_block_size,
            "enable_prefix_caching": model.enable_prefix_caching,
        },
        "parallel_config": {
            "data_parallel_size": len(live),
            "tensor_parallel_size": tp,
            "pipeline_parallel_size": 1,
            "world_size": tp,
        },
        "scheduler_config": {"max_num_seqs": model.max_num_seqs, "max_model_len": model.max_model_len},
        "lora_config": model.lora_config,
        # This route comes with --enable-rl, which serves /init_weight_transfer_engine: vLLM's
        # NCCL protocol, over gloo on CPU workers.
        "weight_transfer_config": {"backend": model.weight_transfer_backend},
    }


def _config_text(config: dict) -> str:
    """``str(VllmConfig)``'s style: ``key=value`` pairs, sections flattened."""
    parts = []
    for section, fields in config.items():
        if isinstance(fields, dict):
            parts.extend(f"{k}={v!r}" for k, v in fields.items())
        else:
            parts.append(f"{section}={fields!r}")
    return ", ".join(parts)


def _vllm_env() -> dict:
    """The ``VLLM_*`` variables of the gateway's environment, names with KEY left out (as vLLM)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_") and "KEY" not in k}


def _system_env() -> dict:
    return {"python_version": sys.version.split()[0], "python_platform": platform.platform(),
            "os": platform.system()}


class ServerInfo:
    def __init__(self, state: GatewayState):
        self.state = state

    async def on_get(self, req, resp):
        fmt = req.get_param("config_format") or "text"
        if fmt not in ("text", "json"):
            raise BadRequest(f"config_format={fmt!r}: expected 'text' or 'json'", "config_format")
        cluster = await self.state.cluster.fresh()
        if cluster.model is None:
            raise Overloaded("No inference worker is available yet.")
        config = vllm_config(self.state, cluster)
        _respond(resp, {"vllm_config": config if fmt == "json" else _config_text(config),
                        "vllm_env": _vllm_env(), "system_env": _system_env()})


# --- /collective_rpc ---------------------------------------------------------------
def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"collective_rpc: {name} must be a boolean, got {value!r}", name)
    return value


def _tags(value: Any) -> Optional[list]:
    if value is None:
        return None
    if not (isinstance(value, list) and all(isinstance(t, str) for t in value)):
        raise BadRequest(f"collective_rpc: tags must be a list of strings, got {value!r}", "tags")
    return value


def _level(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 2:
        raise BadRequest(f"collective_rpc: level must be 0, 1 or 2, got {value!r}", "level")
    return value


def _start(is_checkpoint_format: Any = True) -> tuple[str, dict]:
    if not _flag(is_checkpoint_format, "is_checkpoint_format"):
        raise BadRequest("collective_rpc: is_checkpoint_format=false (kernel-format weights) is not served: "
                         "send checkpoint-format tensors", "is_checkpoint_format")
    return "start_weight_update", {}


def _update(update_info: Any = None) -> tuple[str, dict]:
    if not isinstance(update_info, (dict, list)):
        raise BadRequest("collective_rpc: update_info must be an object", "update_info")
    return "update_weights", {"update_info": update_info}


def _init(init_info: Any = None) -> tuple[str, dict]:
    if not isinstance(init_info, dict):
        raise BadRequest("collective_rpc: init_info must be an object", "init_info")
    return "init_weight_transfer_engine", {"init_info": init_info}


def _sleep(level: Any = 1) -> tuple[str, dict]:
    # vLLM's worker sleep leaves the scheduler alone: requests in flight stay queued ("keep").
    return "sleep", {"level": _level(level), "mode": "keep"}


def _sleep_for_weight_sync(offload_kv: Any = True) -> tuple[str, dict]:
    # SkyRL frees the weights (the broadcast rewrites them) and the KV cache, leaving the
    # scheduler alone; here the KV cache is released either way, and the requests kept
    # paused are recomputed with the new weights when they resume (no abort).
    _flag(offload_kv, "offload_kv")
    return "sleep", {"level": 2, "mode": "keep"}


def _wake(tags: Any = None) -> tuple[str, dict]:
    tags = _tags(tags)
    return "wake_up", {"tags": tags} if tags else {}


def _no_args(op: str) -> Callable[[], tuple[str, dict]]:
    return lambda: (op, {})


# method name -> (its parameters in order, the control command it becomes)
COLLECTIVE_RPC_METHODS: dict[str, tuple[tuple[str, ...], Callable[..., tuple[str, dict]]]] = {
    # vLLM's worker methods (vllm/v1/worker/gpu_worker.py)
    "init_weight_transfer_engine": (("init_info",), _init),
    "shutdown_weight_transfer_engine": ((), _no_args("shutdown_weight_transfer_engine")),
    "start_weight_update": ((), _no_args("start_weight_update")),
    "update_weights": (("update_info",), _update),
    "finish_weight_update": ((), _no_args("finish_weight_update")),
    "sleep": (("level",), _sleep),
    "wake_up": (("tags",), _wake),
    # SkyRL's worker extension (NewInferenceWorkerWrap), as its RemoteInferenceClient calls it
    "skyrl_start_weight_update": (("is_checkpoint_format",), _start),
    "update_weights_nccl": (("update_info",), _update),
    "skyrl_finish_weight_update": ((), _no_args("finish_weight_update")),
    "skyrl_sleep_for_weight_sync": (("offload_kv",), _sleep_for_weight_sync),
    "skyrl_wake_for_weight_sync": (("tags",), _wake),
}


def map_collective_rpc(body: dict) -> tuple[str, dict]:
    """vLLM's ``/collective_rpc`` body -> (control command, its args); 400 for anything else."""
    method = body.get("method")
    if method is None:
        raise BadRequest("Missing 'method' in request body", "method")
    if not isinstance(method, str):
        raise BadRequest("'method' must be a string", "method")
    if method not in COLLECTIVE_RPC_METHODS:
        raise BadRequest(f"collective_rpc method {method!r} is not served: expected one of "
                         f"{', '.join(sorted(COLLECTIVE_RPC_METHODS))}", "method")
    args, kwargs = body.get("args", []), body.get("kwargs", {})
    if not isinstance(args, list):
        raise BadRequest("'args' must be a list", "args")
    if not isinstance(kwargs, dict):
        raise BadRequest("'kwargs' must be an object", "kwargs")
    timeout = body.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise BadRequest("'timeout' must be a positive number", "timeout")
    params, build = COLLECTIVE_RPC_METHODS[method]
    if len(args) > len(params):
        raise BadRequest(f"collective_rpc method {method!r} takes {len(params)} argument(s), got {len(args)}", "args")
    named = dict(zip(params, args))
    for key, value in kwargs.items():
        if key not in params:
            raise BadRequest(f"collective_rpc method {method!r} has no argument {key!r}", "kwargs")
        if key in named:
            raise BadRequest(f"collective_rpc method {method!r}: {key!r} given twice", "kwargs")
        named[key] = value
    return build(**named)


class CollectiveRpc:
    def __init__(self, state: GatewayState):
        self.state = state

    async def on_post(self, req, resp):
        body = await json_object_body(req, self.state.settings.max_body_bytes)
        op, args = map_collective_rpc(body)
        timeout = body.get("timeout")
        reply = await self.state.client.control(op, args, timeout=float(timeout) if timeout else None)
        if op in ("finish_weight_update", "wake_up", "sleep"):
            self.state.cluster.invalidate()
        # vLLM: each worker's return value; these methods return None in vLLM's workers.
        _respond(resp, {"results": [None for _ in reply.ranks]})


def add_routes(app, state: GatewayState) -> None:
    app.add_route("/server_info", ServerInfo(state))
    app.add_route("/collective_rpc", CollectiveRpc(state))
