"""The broker's settings (``tokserve broker`` flags, or an embedder's choice).

A module of its own so that every component can name the type without importing
broker/broker.py (components never import the Broker that composes them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from common import config


@dataclass
class BrokerConfig:
    frontend: str = field(default_factory=config.frontend_address)
    backend: str = field(default_factory=config.backend_address)
    heartbeat_interval: float = config.HEARTBEAT_INTERVAL_S
    liveness: int = config.HEARTBEAT_LIVENESS  # link (ZMTP) heartbeats missed before a worker is dropped
    unresponsive_timeout: float = config.UNRESPONSIVE_TIMEOUT_S  # link up, no message for this long: dropped
    max_pending: int = config.MAX_PENDING
    no_worker_timeout: float = config.NO_WORKER_TIMEOUT_S
    max_inflight_per_worker: int = 0  # 0: INFLIGHT_PER_SEQ_SLOT * worker's max_num_seqs
    max_client_frame_bytes: int = config.MAX_CLIENT_FRAME_BYTES
    max_worker_frame_bytes: int = config.MAX_WORKER_FRAME_BYTES
    curve_secret_key: Optional[bytes] = None  # enables CURVE server mode on both sockets
    curve_public_key: Optional[bytes] = None
    curve_authorized_dir: Optional[str] = None  # with CURVE: only peers whose public key is in here connect
    # A tcp:// frontend without CURVE authorized keys admits every local user (ZeroMQ over
    # TCP knows no peer uid): refused unless the operator opts in (common/security.py).
    allow_unauthenticated_tcp_frontend: bool = False
    routing: str = "cache-aware"  # broker/dispatch.py ROUTING_POLICIES
    pd: str = "off"  # broker/disagg.py: "auto" splits requests over prefill and decode workers
    epd: str = "off"  # broker/disagg.py: "auto" runs image requests' encoders on encode workers first
    # Shared secrets (common/runtime_dir.py).  None: nothing matches, so no worker
    # registers and every CONTROL command is refused (fail closed).
    worker_token: Optional[str] = None
    control_token: Optional[str] = None
    # A ZeroMQ PUB socket announcing the cell's cached prefixes to an outside router
    # (vllm-router --policy kv_aware), in vLLM's KV-event format; None: off.
    kv_events_endpoint: Optional[str] = None
    kv_events_allow_tcp: bool = False  # bind it to TCP: every local user can read prompt prefixes' token ids
    kv_events_allow_remote: bool = False  # bind it beyond loopback (implies kv_events_allow_tcp)
