"""Prefill/decode disaggregation: KV blocks move between workers (vLLM NixlConnector's
``kv_transfer_params``, pull mode, over ZeroMQ instead of NIXL).

Prefill leg (``do_remote_decode``): the request runs as usual; when it finishes, its
full prompt blocks stay referenced in ``HeldTransfers`` (never evicted) and its final
delta carries NixlConnector's answer (``request_finished``'s dict: where and which
blocks to pull).  They are released when the decode side sends ``FREE`` or after
``kv_transfer_timeout`` seconds (vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480).

Decode leg (``do_remote_prefill`` + ``remote_*``): a background thread pulls the blocks
from the prefill worker's transfer server (``PULL``), then sends ``FREE``; the engine
thread imports them into its prefix cache under the prompt's block hashes, so the
ordinary prefix-cache lookup serves the prompt from them (``num_cached_tokens``).

Wire (one ROUTER per worker, ``--kv-transfer-address``; every message one msgpack frame):
  request  {"op": "pull", "engine_id", "request_id", "block_ids": [int], "auth"}
           {"op": "free", "engine_id", "request_id", "auth"}
  reply    {"ok": true, "request_id", "shape": [2, layers, n, block_size, kv_heads, head_dim],
            "dtype": "float32"} + one raw frame (the blocks' K/V, C order)
           {"ok": false, "request_id", "status": 400, "error": "..."}
``auth`` is the cluster's worker token (transfer_auth.py: only workers may use the
server; without it the answer is a bare 401; beyond loopback the link is CURVE).
``FREE`` is not answered.  Malformed messages are dropped (and logged, rate-limited).
``request_id`` is the answer's ``remote_request_id``: the prefill request's id plus a
secret, so PULL / FREE work only for whoever got that answer (even among workers);
refusals never name this worker's engine id.

Threads: the transfer server reads held blocks under ``HeldTransfers.lock``; the
engine thread removes an entry under the same lock before its blocks are released, so
a block being exported is never handed out meanwhile.  ``FREE`` only queues the
request id: the release runs on the engine thread (``KvTransferComponent.tick``).
"""
from __future__ import annotations

import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

import msgspec
import torch
import zmq

from common.errors import BadRequest
from common.logging import RateLimitedLog, get_logger
from worker.engine.disagg import transfer_auth
from worker.engine.disagg.connector_config import parse_connector_config
log = get_logger("tokserve.kv_transfer")

DEFAULT_ADDRESS = "tcp://127.0.0.1:*"
DEFAULT_TIMEOUT_S = 480.0  # vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT
PULL_TIMEOUT_S = 3.0
MAX_REQUEST_BYTES = 1 << 20  # a PULL names block ids only; anything bigger is garbage

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


class TransferError(Exception):
    """A decode leg that cannot get its blocks (``status`` follows HTTP)."""

    def __init__(self, status: int, message: str, refusal: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.refusal = refusal  # the peer's own error text, when it answered with a refusal


# --- --kv-transfer-config ----------------------------------------------------------------
KV_CONNECTOR = "NixlConnector"  # the vLLM connector whose kv_transfer_params we speak
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
ENABLE_HINT = ("start it with --kv-transfer-config '{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"kv_both\"}' "
               "or --role prefill|decode")


def parse_kv_transfer_config(text: Optional[str]) -> Optional[str]:
    """``--kv-transfer-config`` (vLLM's JSON) -> its kv_role (default kv_both), or None without one."""
    return parse_connector_config(text, "kv", KV_CONNECTOR, KV_ROLES, "KV blocks", default_role="kv_both")


# --- kv_transfer_params ------------------------------------------------------------------
@dataclass
class PrefillLeg:
    pass


@dataclass
class DecodeLeg:
    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: list[int]


def is_int(v: Any) -> bool:
    """A JSON integer (bool excluded): ports, block ids, shapes in transfer parameters."""
    return isinstance(v, int) and not isinstance(v, bool)


def _bad(message: str) -> BadRequest:
    return BadRequest(f"kv_transfer_params: {message}", "kv_transfer_params")


def parse_params(params: Any):
    """None (pass through), ``PrefillLeg`` or ``DecodeLeg``; BadRequest when malformed."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise _bad(f"expected a JSON object, got {type(params).__name__}")
    decode, prefill = params.get("do_remote_decode"), params.get("do_remote_prefill")
    for name, v in (("do_remote_decode", decode), ("do_remote_prefill", prefill)):
        if v is not None and not isinstance(v, bool):
            raise _bad(f"{name} must be a boolean")
    if decode and prefill:
        raise _bad("do_remote_decode and do_remote_prefill cannot both be true")
    if decode:
        return PrefillLeg()
    if not prefill:
        return None  # nothing to do: the params are echoed as before
    engine_id, request_id = params.get("remote_engine_id"), params.get("remote_request_id")
    host, port, blocks = params.get("remote_host"), params.get("remote_port"), params.get("remote_block_ids")
    for name, v in (("remote_engine_id", engine_id), ("remote_request_id", request_id), ("remote_host", host)):
        if not isinstance(v, str) or not v:
            raise _bad(f"{name} must be a non-empty string with do_remote_prefill")
    if not is_int(port) or not 0 < port < 65536:
        raise _bad("remote_port must be an integer port (1..65535)")
    # vLLM sends one list per KV cache group; a flat list is taken too.
    if isinstance(blocks, list) and len(blocks) == 1 and isinstance(blocks[0], list):
        blocks = blocks[0]
    if not isinstance(blocks, list) or not all(is_int(b) and b >= 0 for b in blocks):
        raise _bad("remote_block_ids must be a list of block ids (non-negative integers), or one such list")
    tp = params.get("tp_size", 1)
    if tp is not None and tp != 1:
        raise _bad(f"tp_size {tp!r}: only KV from a single-rank (tensor_parallel_size 1) prefill worker is supported")
    return DecodeLeg(engine_id, request_id, host, port, list(blocks))


# --- prefill side: held blocks and the transfer server ---------------------------------
@dataclass
class _Held:
    block_ids: list[int]
    deadline: float


class HeldTransfers:
    """Finished prefill legs' blocks waiting for their decode side (request id -> blocks)."""

    def __init__(self):
        self.lock = threading.Lock()
        self._held: dict[str, _Held] = {}
        self.num_blocks = 0  # blocks held, all entries together (the cap's measure)
        self.freed: "queue.SimpleQueue[str]" = queue.SimpleQueue()  # FREE received (transfer thread -> engine)

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, request_id: str, block_ids: list[int], timeout: float) -> Optional[list[int]]:
        """Engine thread.  Returns the blocks of an older entry of the same id (to release)."""
        with self.lock:
            old = self._held.pop(request_id, None)
            self._held[request_id] = _Held(list(block_ids), time.monotonic() + timeout)
            self.num_blocks += len(block_ids) - (len(old.block_ids) if old is not None else 0)
        return old.block_ids if old is not None else None

    def take(self, request_id: str) -> Optional[list[int]]:
        """Engine thread: forget an entry; its blocks are the caller's to release."""
        with self.lock:
            held = self._held.pop(request_id, None)
            if held is not None:
                self.num_blocks -= len(held.block_ids)
        return held.block_ids if held is not None else None

    def take_expired(self, now: float) -> list[tuple[str, list[int]]]:
        with self.lock:
            gone = [(rid, self._held.pop(rid).block_ids) for rid, h in list(self._held.items()) if h.deadline <= now]
            self.num_blocks -= sum(len(blocks) for _, blocks in gone)
            return gone

    def take_all(self) -> list[list[int]]:
        with self.lock:
            out = [h.block_ids for h in self._held.values()]
            self._held.clear()
            self.num_blocks = 0
        return out

    def export(self, request_id: str, block_ids: list[int], kv_cache: Optional[torch.Tensor]) -> torch.Tensor:
        """Transfer thread: the held blocks' K/V, contiguous, on the CPU."""
        with self.lock:
            held = self._held.get(request_id)
            if held is None or held.deadline <= time.monotonic():
                raise TransferError(400, f"unknown or expired transfer for request {request_id!r}")
            if held.block_ids != block_ids:
                raise TransferError(400, f"block ids {block_ids} are not those held for request {request_id!r}")
            if kv_cache is None:
                raise TransferError(503, "the KV cache is released (sleeping)")
            index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
            return kv_cache.index_select(2, index).to("cpu").contiguous()


class TransferServer(threading.Thread):
    """The ROUTER answering PULL / FREE for this worker's held blocks."""

    def __init__(self, ctx: zmq.Context, address: str, engine_id: str, held: HeldTransfers,
                 kv_cache: Callable[[], Optional[torch.Tensor]], encodings: Optional[Any] = None):
        super().__init__(name="kv-transfer", daemon=True)
        self.engine_id, self.held, self.kv_cache = engine_id, held, kv_cache
        self.encodings = encodings  # ec_transfer.EncoderExports of an encoder worker, else None
        self._bad = RateLimitedLog(log)
        self._halt = threading.Event()
        self.auth = transfer_auth.current()
        self.refused = 0  # messages without the worker token (transfer_auth.py)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        bind_host = address.partition("://")[2].rpartition(":")[0].strip("[]")
        self.auth.secure_server(self.sock, bind_host)
        self.sock.bind(address)
        endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)  # tcp://host:port
        host, _, port = endpoint.rpartition("//")[2].rpartition(":")
        if host in ("0.0.0.0", "*", "[::]", "::"):
            host = socket.gethostbyname(socket.gethostname())
            if self.auth.encrypts(bind_host) and not self.auth.encrypts(host):
                # Peers would dial the announced loopback address in the clear and fail
                # the CURVE handshake this every-interface socket expects.
                self.sock.close(0)
                raise ValueError(f"--kv-transfer-address {address} listens on every interface, but this host's "
                                 f"name resolves to the loopback address {host}: bind this host's routable address")
        self.host, self.port = host.strip("[]"), int(port)

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                if not self.sock.poll(200):
                    continue
                try:
                    frames = self.sock.recv_multipart()
                except zmq.ZMQError as exc:
                    self._bad.warning("kv transfer: receive failed: %s", exc)
                    continue
                try:
                    self._handle(frames)
                except Exception:  # never let a peer take the thread down
                    log.exception("kv transfer: failed to handle a message")
        finally:
            self.sock.close(0)

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self._bad.warning("kv transfer: dropped a message of %d frames", len(frames))
            return
        identity, body = frames
        try:
            msg = _decoder.decode(body)
        except Exception as exc:
            self._bad.warning("kv transfer: dropped an undecodable message: %s", exc)
            return
        if not isinstance(msg, dict) or not self.auth.admits(msg):
            # Only workers of this cluster hold the token; others learn nothing, not even
            # whether the request id or engine id they sent exists.
            self.refused += 1
            self._bad.warning("kv transfer: refused a message without this cluster's worker token")
            self._reply(identity, {"ok": False, "status": 401, "error": "unauthorized"})
            return
        if msg.get("op") == "ec_pull":
            self._ec_pull(identity, msg)
            return
        if not isinstance(msg, dict) or msg.get("op") not in ("pull", "free") \
                or not isinstance(msg.get("request_id"), str) or not isinstance(msg.get("engine_id"), str):
            self._bad.warning("kv transfer: dropped a malformed message")
            return
        rid = msg["request_id"]
        if msg["op"] == "free":
            if msg["engine_id"] == self.engine_id:
                self.held.freed.put(rid)
            return
        blocks = msg.get("block_ids")
        if not isinstance(blocks, list) or not all(is_int(b) for b in blocks):
            self._bad.warning("kv transfer: dropped a PULL with malformed block ids")
            return
        try:
            if msg["engine_id"] != self.engine_id:
                # Never this worker's own id: whoever can reach the port must not learn it.
                raise TransferError(400, "unknown engine id")
            data = self.held.export(rid, blocks, self.kv_cache())
        except TransferError as exc:
            self._reply(identity, {"ok": False, "request_id": rid, "status": exc.status, "error": exc.message})
            return
        header = {"ok": True, "request_id": rid, "shape": list(data.shape), "dtype": str(data.dtype)[6:]}
        raw = data.view(-1).view(torch.uint8).numpy()  # zero-copy: the frame is the tensor's buffer
        self._reply(identity, header, raw)

    def _ec_pull(self, identity: bytes, msg: dict) -> None:
        """An encoder output by its cache key (ec_transfer.py: encoder disaggregation)."""
        key = msg.get("key")
        if not isinstance(key, str):
            self._bad.warning("kv transfer: dropped an EC pull without a key")
            return
        data = self.encodings.get(key) if self.encodings is not None else None
        if data is None:
            why = "unknown or evicted encoder output" if self.encodings is not None else \
                "this worker does not export encoder outputs (no ec_producer --ec-transfer-config)"
            self._reply(identity, {"ok": False, "key": key, "status": 400, "error": f"{why} {key!r}"})
            return
        header = {"ok": True, "key": key, "shape": list(data.shape), "dtype": str(data.dtype)[6:]}
        self._reply(identity, header, data.view(-1).view(torch.uint8).numpy())

    def _reply(self, identity: bytes, header: dict, raw=None) -> None:
        frames = [identity, _encoder.encode(header)]
        if raw is not None:
            frames.append(raw)
        try:
            self.sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._bad.warning("kv transfer: reply dropped: %s", exc)


# --- decode side: the pull ----------------------------------------------------------------
def ask(ctx: zmq.Context, host: str, port: int, msg: dict, timeout: float, what: str,
        then: Optional[dict] = None) -> tuple[dict, Any]:
    """One request to a worker's transfer server: (reply header, raw payload buffer).
    ``then``: sent after a good reply (not answered).  TransferError: 503 when the peer
    does not answer in time, its status when it refuses, 502 on a malformed reply;
    messages start with ``what`` (the request field they concern) and never name the
    peer's host or port (they reach clients: no port-scan oracle)."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    auth = transfer_auth.current()
    msg = auth.stamp(msg)
    then = auth.stamp(then) if then is not None else None
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        try:
            auth.secure_client(sock, host)
            sock.connect(f"tcp://{where}")
        except zmq.ZMQError as exc:
            log.warning("%s: cannot connect to transfer peer %s: %s", what, where, exc)
            raise TransferError(400, f"{what}: transfer peer unreachable") from None
        sock.send(_encoder.encode(msg))
        if not sock.poll(int(timeout * 1000)):
            raise TransferError(503, f"{what}: the transfer peer did not answer within {timeout:g} s "
                                     "(unreachable or gone)")
        frames = sock.recv_multipart(copy=False)
        try:
            header = _decoder.decode(frames[0].buffer)
            ok = header["ok"]
        except Exception:
            raise TransferError(502, f"{what}: malformed reply from the transfer peer") from None
        if not ok:
            status = header.get("status", 400)
            raise TransferError(status if is_int(status) else 400, f"{what}: {header.get('error')}",
                                refusal=str(header.get("error")))
        if len(frames) != 2:
            raise TransferError(502, f"{what}: malformed reply from the transfer peer")
        if then is not None:
            sock.setsockopt(zmq.LINGER, 1000)
            sock.send(_encoder.encode(then))
        return header, frames[1].buffer
    finally:
        sock.close()


def pull_blocks(ctx: zmq.Context, leg: DecodeLeg, timeout: float = PULL_TIMEOUT_S) -> tuple[dict, Any]:
    """PULL the blocks (then FREE them remotely: they are ours now); returns (header, raw buffer)."""
    msg = {"op": "pull", "engine_id": leg.engine_id, "request_id": leg.request_id, "block_ids": leg.block_ids}
    free = {"op": "free", "engine_id": leg.engine_id, "request_id": leg.request_id}
    try:
        return ask(ctx, leg.host, leg.port, msg, timeout, "kv_transfer_params", then=free)
    except TransferError as exc:
        if exc.refusal is not None:
            raise TransferError(exc.status, f"kv_transfer_params: unknown or expired transfer ({exc.refusal})",
                                exc.refusal) from None
        if exc.status == 503:
            raise TransferError(503, exc.message + "; its KV blocks cannot be pulled") from None
        raise


def blocks_from_reply(header: dict, raw, like: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The pulled K/V as a CPU tensor shaped like ``like``'s blocks; TransferError when its
    layout does not match this worker's KV cache (another model, dtype or block size)."""
    shape = header.get("shape")
    want = [like.shape[0], like.shape[1], num_blocks, *like.shape[3:]]
    dtype = str(like.dtype)[6:]
    if shape != want or header.get("dtype") != dtype:
        raise TransferError(400, f"kv_transfer_params: the remote KV layout {shape} {header.get('dtype')} does not "
                                 f"match this worker's {want} {dtype} (another model or block size?)")
    data = bytearray(raw)  # one copy: writable memory torch can wrap
    if len(data) != like.element_size() * like[:, :, :num_blocks].numel():
        raise TransferError(502, "kv_transfer_params: truncated KV payload")
    return torch.frombuffer(data, dtype=torch.uint8).view(like.dtype).view(want)


class KvTransfer:
    """Per-engine state: engine id, held blocks (+ the transfer server, started on the
    first prefill leg) and the decode legs whose pull is in flight."""

    def __init__(self, address: Optional[str], timeout: Optional[float],
                 kv_cache: Callable[[], Optional[torch.Tensor]]):
        self.address = address or DEFAULT_ADDRESS
        self.timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
        self.engine_id = uuid.uuid4().hex
        self.held = HeldTransfers()
        self.max_held_blocks = 0  # the engine sets it: a fraction of its KV blocks (--kv-transfer-max-held)
        # Prefill legs admitted and not finished: request id -> prompt blocks they will hold.
        # Counted against the cap at admission, so a burst cannot overshoot it.
        self.reserved: dict[str, int] = {}
        self._kv_cache = kv_cache
        self._server: Optional[TransferServer] = None
        self.encodings: Optional[Any] = None  # ec_transfer.EncoderExports served alongside (encoder workers)
        self._ctx = zmq.Context.instance()
        self.pending: dict[str, tuple] = {}  # request id -> (request, seq, leg, token): pull in flight
        self.pulled: "queue.Queue[tuple[str, object, Optional[tuple], Optional[TransferError]]]" = queue.Queue()
        self._token = 0

    def committed_blocks(self) -> int:
        """Blocks held for remote decode plus those running prefill legs will hold."""
        return self.held.num_blocks + sum(self.reserved.values())

    def bound(self) -> Optional[TransferServer]:
        return self._server

    def server(self) -> TransferServer:
        if self._server is None:
            self._server = TransferServer(self._ctx, self.address, self.engine_id, self.held, self._kv_cache,
                                          self.encodings)
            self._server.start()
            log.info("KV transfer server on %s:%d (engine id %s)", self._server.host, self._server.port,
                     self.engine_id)
        return self._server

    def start_pull(self, request, seq, leg: DecodeLeg) -> None:
        rid = request.request_id
        self._token += 1
        token = self._token
        self.pending[rid] = (request, seq, leg, token)

        def run():
            try:
                header, raw = pull_blocks(self._ctx, leg)
                self.pulled.put((rid, token, (header, raw), None))
            except TransferError as exc:
                self.pulled.put((rid, token, None, exc))
            except Exception as exc:  # a bug, not the peer: still end the request
                log.exception("kv transfer: pull for %s failed", rid)
                self.pulled.put((rid, token, None, TransferError(500, f"kv_transfer_params: pull failed: {exc}")))

        threading.Thread(target=run, name=f"kv-pull-{rid}", daemon=True).start()

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server.join(timeout=2)
            self._server = None
