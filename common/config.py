"""Default endpoints and timing knobs shared by every process.

Each value can be overridden by an environment variable so that a whole stack
(gateway, broker, workers, scripts) started from one shell agrees without
repeating flags; command-line flags in turn override the environment.
"""
from __future__ import annotations

import os

from common import runtime_dir

# Unix sockets in the private runtime directory (common/runtime_dir.py) by default: only
# our own uid can connect, nothing is reachable from another host.  TCP (and beyond the
# host, CURVE) is an explicit choice: --frontend / --backend, TOKSERVE_FRONTEND / _BACKEND.
# Functions, not constants: the directory follows TOKSERVE_RUNTIME_DIR / XDG_RUNTIME_DIR.
def default_frontend() -> str:
    """clients (gateways, scripts) -> broker"""
    return runtime_dir.ipc_endpoint(runtime_dir.FRONTEND_SOCKET)


def default_backend() -> str:
    """workers -> broker"""
    return runtime_dir.ipc_endpoint(runtime_dir.BACKEND_SOCKET)


HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_LIVENESS = 3  # missed intervals before a peer's link counts as dead (libzmq's ZMTP heartbeats)
# A peer whose link is up (its process runs: libzmq answers heartbeats in its own C
# thread, without the GIL) but whose Python loop sent nothing for this long counts as
# hung.  Long, as vLLM's engine timeouts are (VLLM_ENGINE_ITERATION_TIMEOUT_S = 60): a
# worker starved of CPU or inside a GIL-holding step is slow, not dead.
UNRESPONSIVE_TIMEOUT_S = 60.0

# Broker admission control.
MAX_PENDING = 4096  # requests queued in the broker while no worker has capacity
NO_WORKER_TIMEOUT_S = 10.0  # queued requests fail with 503 after this long without any live worker
INFLIGHT_PER_SEQ_SLOT = 4  # a worker "has capacity" while in-flight < this * max_num_seqs

# Per-frame size caps (ZMQ_MAXMSGSIZE): a peer sending bigger frames is disconnected.
MAX_CLIENT_FRAME_BYTES = 64 << 20
MAX_WORKER_FRAME_BYTES = 1 << 30


def _env(name: str, default):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return type(default)(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r} is not a valid {type(default).__name__}") from exc


def frontend_address() -> str:
    return _env("TOKSERVE_FRONTEND", default_frontend())


def backend_address() -> str:
    return _env("TOKSERVE_BACKEND", default_backend())


def heartbeat_interval() -> float:
    return _env("TOKSERVE_HEARTBEAT_INTERVAL", HEARTBEAT_INTERVAL_S)


def heartbeat_liveness() -> int:
    return _env("TOKSERVE_HEARTBEAT_LIVENESS", HEARTBEAT_LIVENESS)


def unresponsive_timeout() -> float:
    return _env("TOKSERVE_UNRESPONSIVE_TIMEOUT", UNRESPONSIVE_TIMEOUT_S)


def log_level() -> str:
    return _env("TOKSERVE_LOG_LEVEL", "INFO").upper()
