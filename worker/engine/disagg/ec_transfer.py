"""Encoder disaggregation (vLLM's E/P/D): image embeddings move between workers.

vLLM 0.32 runs the vision encoder on ``ec_producer`` instances and the language model
on ``ec_consumer`` ones (``--ec-transfer-config``); an orchestrator sends the media to a
producer, whose response names, per item, where its encoder output can be read
(``ec_transfer_params``), then sends the consumer the prompt with *metadata-only*
``features`` items (the grid, no pixels) and those ``ec_transfer_params``.  The answer
has ECCPUConnector's shape, one entry per mm_hash::

    {mm_hash: {"item_indices": [i, ...], "metadata": {"image_grid_thw": [t, h, w]},
               "peer_host": str, "peer_port": int, "size_bytes": int, "shape": [rows, hidden],
               "remote_key": str}}

``remote_key`` (ours; a proxy passes the entry through whole) is the producer's own key of
the output: its encoder-cache key, in which an image a client named (``features`` hash,
``uuid``) and an image hashed by content never share a name, so no client can plant an
output under another image's name.

The bytes travel over this worker's transfer server (kv_transfer.py, the ROUTER that
also serves KV blocks) instead of NIXL:
  request  {"op": "ec_pull", "key": remote_key}
  reply    {"ok": true, "key", "shape": [rows, hidden], "dtype"} + one raw frame
           {"ok": false, "key", "status": 400, "error": "..."}

Producer (``ec_producer`` / ``ec_both``): every encoder output a request uses is copied
to host memory (``EncoderExports``, least recently used dropped past a byte budget) as
the encoder cache hands it out; a finished request answers with the entries above (an
item no longer exported is announced with empty metadata and no address, as vLLM).
Consumer: any worker pulls what a request's ``ec_transfer_params`` announce for its
items (unless its own encoder cache has them) before scheduling it; the pulled rows
are the request's and fill the encoder cache as if encoded here.  A failed pull falls
back to the item's pixels when the request carries them, else fails the request
(503 when the producer is gone, 400 when it no longer has the output).
"""
from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import zmq

from common.errors import BadRequest
from common.logging import get_logger
from common.multimodal import client_hash
from common.protocol import MultiModalItem
from worker.engine.disagg.connector_config import parse_connector_config
from worker.engine.disagg.kv_transfer import PULL_TIMEOUT_S, TransferError, ask, is_int
from worker.engine.multimodal.images import REMOTE

log = get_logger("tokserve.ec_transfer")

PARAM = "ec_transfer_params"
CONNECTOR = "ECCPUConnector"  # the vLLM connector whose ec_transfer_params we speak
ROLES = ("ec_producer", "ec_consumer", "ec_both")
PRODUCER_ROLES = ("ec_producer", "ec_both")
# Host memory a producer keeps its exported outputs in: hundreds of images of a 7B model's
# width, so an announced output outlives the round trip to its consumer.
DEFAULT_EXPORT_BYTES = 4 << 30
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_ec_transfer_config(text: Optional[str]) -> Optional[str]:
    """``--ec-transfer-config`` (vLLM's JSON) -> its ec_role, or None without one."""
    return parse_connector_config(text, "ec", CONNECTOR, ROLES, "encoder outputs")


# --- producer ------------------------------------------------------------------------------
class EncoderExports:
    """Host copies of encoder outputs for consumers to pull (the engine thread adds, the
    transfer server's thread reads), by the engine's keyed mm_hash (``remote_key``)."""

    def __init__(self, max_bytes: int = DEFAULT_EXPORT_BYTES):
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def put(self, key: str, emb: torch.Tensor) -> None:
        """Engine thread: export ``emb`` (copied to the host once per key)."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
        host = emb.detach().to("cpu").contiguous()
        if host.data_ptr() == emb.data_ptr():
            host = host.clone()  # the encoder cache's own tensor must not be shared with a reader thread
        with self._lock:
            self._entries[key] = host
            self._bytes += _nbytes(host)
            while self._bytes > self.max_bytes and len(self._entries) > 1:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= _nbytes(dropped)

    def get(self, key: str) -> Optional[torch.Tensor]:
        with self._lock:
            return self._entries.get(key)

    def clear(self) -> None:
        """New weights: the outputs no longer match the model."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def announce(items: Sequence[MultiModalItem], wire_hashes: Sequence[str], exports: EncoderExports,
             host: str, port: int) -> dict:
    """A finished request's ec_transfer_params (``items`` keyed and in prompt order,
    ``wire_hashes`` their hashes as the request named them)."""
    out: dict[str, dict] = {}
    for index, (it, wire) in enumerate(zip(items, wire_hashes)):
        entry = out.setdefault(client_hash(wire), {"item_indices": []})
        entry["item_indices"].append(index)
        data = exports.get(it.mm_hash)
        if data is None:  # dropped since: no address, so no orchestrator strips the media
            entry["metadata"] = {}
            continue
        entry["metadata"] = {"image_grid_thw": [int(v) for v in it.grid_thw]}
        entry.update(peer_host=host, peer_port=port, size_bytes=_nbytes(data),
                     shape=list(data.shape), remote_key=it.mm_hash)
    return out


# --- consumer ------------------------------------------------------------------------------
@dataclass
class RemoteEncoding:
    host: str
    port: int
    key: str  # the producer's cache key
    rows: int
    hidden: int
    required: bool  # the item has no pixels: a failed pull fails the request


def remote_sources(params: Any, items: Sequence[MultiModalItem], wire_hashes: Sequence[str],
                   hidden: int) -> dict[str, RemoteEncoding]:
    """The items (keyed, by their cache key) whose encoder output ``params`` announce on
    a producer; BadRequest when an announcement is malformed or a pixel-less item has
    none."""
    if params is not None and not isinstance(params, dict):
        raise BadRequest(f"{PARAM}: expected a JSON object mapping mm_hash to a producer's entry", PARAM)
    out: dict[str, RemoteEncoding] = {}
    for it, wire in zip(items, wire_hashes):
        name = client_hash(wire)
        entry = (params or {}).get(name)
        remote = it.encoding == REMOTE
        if not isinstance(entry, dict) or "peer_host" not in entry:
            if remote:
                raise BadRequest(f"{PARAM}: image at offset {it.offset} (mm_hash {name!r}) has no pixels and "
                                 f"{PARAM} names no producer for it (an entry with peer_host and peer_port)", PARAM)
            continue
        host, port, shape = entry.get("peer_host"), entry.get("peer_port"), entry.get("shape")
        key = entry.get("remote_key")
        where = f"{PARAM}[{name!r}]"
        if not isinstance(key, str) or not key or len(key) > 1024:
            raise BadRequest(f"{where}: remote_key must be the non-empty string an encoder worker's answer gives",
                             PARAM)
        if not isinstance(host, str) or not host:
            raise BadRequest(f"{where}: peer_host must be a non-empty string", PARAM)
        if not is_int(port) or not 0 < port < 65536:
            raise BadRequest(f"{where}: peer_port must be an integer port (1..65535)", PARAM)
        if not (isinstance(shape, list) and len(shape) == 2 and all(is_int(v) for v in shape)):
            raise BadRequest(f"{where}: shape must be [rows, hidden]", PARAM)
        if shape != [it.length, hidden]:
            raise BadRequest(f"{where}: shape {shape} does not fit the image's {it.length} placeholder tokens of "
                             f"this model's hidden size {hidden} (expected {[it.length, hidden]})", PARAM)
        out[it.mm_hash] = RemoteEncoding(host, port, key, it.length, hidden, remote)
    return out


def _tensor_from_reply(header: dict, raw, src: RemoteEncoding) -> torch.Tensor:
    # Messages reach clients: they never name the producer's host or port.
    dtype = header.get("dtype")
    dtype = _DTYPES.get(dtype) if isinstance(dtype, str) else None
    if header.get("shape") != [src.rows, src.hidden] or dtype is None:
        raise TransferError(400, f"{PARAM}: the encoder output on the transfer peer is {header.get('shape')} "
                                 f"{header.get('dtype')}, not the announced [{src.rows}, {src.hidden}] "
                                 "(another model?)")
    data = bytearray(raw)  # one copy: writable memory torch can wrap
    if len(data) != src.rows * src.hidden * dtype.itemsize:
        raise TransferError(502, f"{PARAM}: truncated encoder output from the transfer peer")
    return torch.frombuffer(data, dtype=dtype).view(src.rows, src.hidden)


def pull_encoding(ctx: zmq.Context, src: RemoteEncoding, timeout: float = PULL_TIMEOUT_S) -> torch.Tensor:
    try:
        header, raw = ask(ctx, src.host, src.port, {"op": "ec_pull", "key": src.key}, timeout, PARAM)
    except TransferError as exc:
        if exc.status == 503:
            raise TransferError(503, exc.message + "; the encoder output cannot be pulled") from None
        raise
    return _tensor_from_reply(header, raw, src)


class EcPulls:
    """Requests waiting for encoder outputs: a thread per request pulls its items; the
    engine thread collects the results (``done``) and schedules the request."""

    def __init__(self):
        self._ctx = zmq.Context.instance()
        self.pending: dict[str, tuple] = {}  # request id -> (request, seq, sources, token)
        self.done: "queue.Queue[tuple[str, int, dict, dict]]" = queue.Queue()
        self._token = 0

    def start(self, request, seq, sources: dict[str, RemoteEncoding]) -> None:
        rid = request.request_id
        self._token += 1
        token = self._token
        self.pending[rid] = (request, seq, sources, token)

        def run():
            pulled: dict[str, torch.Tensor] = {}
            failed: dict[str, TransferError] = {}
            for key, src in sources.items():
                try:
                    pulled[key] = pull_encoding(self._ctx, src)
                except TransferError as exc:
                    failed[key] = exc
                except Exception as exc:  # a bug, not the peer: still end the request
                    log.exception("ec transfer: pull of %s for %s failed", src.key, rid)
                    failed[key] = TransferError(500, f"{PARAM}: pull failed: {exc}")
            self.done.put((rid, token, pulled, failed))

        threading.Thread(target=run, name=f"ec-pull-{rid}", daemon=True).start()
