"""Who a request's transfer parameters may make a worker connect to (no torch: the
broker imports this).

``kv_transfer_params`` (NixlConnector's ``remote_host``/``remote_port``) and
``ec_transfer_params`` (ECCPUConnector's ``peer_host``/``peer_port`` per item) name a
transfer server a worker then connects to and caches what it reads from.  Left to
clients, that is a connect-anywhere primitive (SSRF, a port scanner) and a way to plant
KV blocks.  So:

* the broker checks every client GENERATE: the parameters must be small JSON (depth
  bounded, type-checked) and every peer they name must be a registered worker's
  transfer server (``WorkerReady.transfer_address``), else a 400 that names neither
  the host nor the port;
* ``GenerateRequest.transfer_trust`` carries what the broker vouches for.  The broker
  resets it on every client GENERATE (a client cannot forge it) and sets it on what it
  forwards: ``TRUST_PEERS`` once the peers are checked, ``TRUST_KV`` / ``TRUST_EC`` on
  the legs it builds itself (broker/disagg.py), which any worker then serves;
* a worker honours client transfer parameters only with a P/D or E/P/D role / connector
  configured, and connects only to peers the broker vouched for.
"""
from __future__ import annotations

from typing import Any, Optional

from common.errors import BadRequest

TRUST_KV = 1  # the broker built kv_transfer_params itself (its own P/D legs)
TRUST_EC = 2  # the broker built ec_transfer_params itself (its own E/P/D legs)
TRUST_PEERS = 4  # every transfer peer the request names is a registered worker's transfer server

KV_PARAM = "kv_transfer_params"
EC_PARAM = "ec_transfer_params"
# vLLM's parameters are shallow: {mm_hash: {"metadata": {"image_grid_thw": [..]}}} is the
# deepest (4).  Anything much deeper is garbage that would cost recursion to echo or encode.
MAX_DEPTH = 8
MAX_NODES = 1 << 16  # containers + scalars: a few thousand block ids, a few hundred images
UNKNOWN_PEER = "unknown transfer peer: transfer parameters may only name this cluster's workers"
# A peer this cluster's worker served from, before that worker left (died, drained): the
# parameters were good, the peer is gone, so the client may retry the whole request (503).
GONE_PEER = "the transfer peer did not answer: its worker has left the cluster; retry the request"


def _bad(param: str, message: str) -> BadRequest:
    return BadRequest(f"{param}: {message}", param)


def check_shape(value: Any, param: str) -> None:
    """BadRequest unless ``value`` is None or a JSON object of bounded depth and size
    (iterative: no recursion however deep the input)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise _bad(param, f"expected a JSON object, got {type(value).__name__}")
    stack: list[tuple[Any, int]] = [(value, 1)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise _bad(param, f"too large (more than {MAX_NODES} values)")
        if isinstance(node, dict):
            if depth > MAX_DEPTH:
                raise _bad(param, f"nested deeper than {MAX_DEPTH} levels")
            for k, v in node.items():
                if not isinstance(k, str):
                    raise _bad(param, "object keys must be strings")
                stack.append((v, depth + 1))
        elif isinstance(node, list):
            if depth > MAX_DEPTH:
                raise _bad(param, f"nested deeper than {MAX_DEPTH} levels")
            stack.extend((v, depth + 1) for v in node)
        elif node is not None and not isinstance(node, (str, int, float, bool)):
            raise _bad(param, f"unsupported value of type {type(node).__name__}")


def _port(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 < v < 65536


def kv_peer(params: Any) -> Optional[tuple[str, int]]:
    """The transfer server a decode leg (``do_remote_prefill``) would pull from, or None
    when the parameters name none.  Malformed peers are BadRequests (the worker would
    refuse them too; refusing here keeps them off the wire)."""
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        return None
    host, port = params.get("remote_host"), params.get("remote_port")
    if not isinstance(host, str) or not host or len(host) > 255:
        raise _bad(KV_PARAM, "remote_host must be a non-empty string with do_remote_prefill")
    if not _port(port):
        raise _bad(KV_PARAM, "remote_port must be an integer port (1..65535)")
    return host, port


def ec_peers(params: Any) -> list[tuple[str, int]]:
    """The transfer servers ``ec_transfer_params`` announce encodings on (entries with a
    ``peer_host``, as a worker reads them)."""
    if not isinstance(params, dict):
        return []
    out = []
    for name, entry in params.items():
        if not isinstance(entry, dict) or "peer_host" not in entry:
            continue
        host, port = entry.get("peer_host"), entry.get("peer_port")
        if not isinstance(host, str) or not host or len(host) > 255:
            raise _bad(EC_PARAM, f"[{str(name)[:64]!r}]: peer_host must be a non-empty string")
        if not _port(port):
            raise _bad(EC_PARAM, f"[{str(name)[:64]!r}]: peer_port must be an integer port (1..65535)")
        out.append((host, port))
    return out


def parse_address(text: Optional[str]) -> Optional[tuple[str, int]]:
    """``WorkerReady.transfer_address`` ("host:port") -> (host, port); None when absent
    or unusable."""
    if not isinstance(text, str):
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not _port(int(port)):
        return None
    return host.strip("[]"), int(port)


def format_address(host: str, port: int) -> str:
    return f"{host}:{port}"
