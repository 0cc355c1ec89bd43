"""Frame layouts of every tokserve ZeroMQ message, and their encode/decode helpers.

Sockets: clients (gateway, scripts) DEALER -> broker ROUTER "frontend"; workers
DEALER -> broker ROUTER "backend".  Both ROUTERs use ROUTER_MANDATORY so that a
message to a vanished peer raises EHOSTUNREACH instead of being dropped.  Frames
below omit the routing identity a ROUTER adds/strips as the first frame.

Client <-> broker (frontend)::

    GENERATE   [MAGIC][0x01][GenerateRequest]
    ABORT      [MAGIC][0x02][Abort]
    INFO       [MAGIC][0x08][nonce]                    reply: [MAGIC][0x08][ClusterInfo][nonce]
    HEARTBEAT  [MAGIC][0x06][]                         reply: [MAGIC][0x06][]
    OUTPUTS    [MAGIC][0x03][Outputs]                  broker -> client
    ERROR      [MAGIC][0x04][ErrorMsg]                 broker -> client
    CONTROL    [MAGIC][0x09][ControlRequest][payload]* reply: [MAGIC][0x09][ControlReply]

Broker <-> worker (backend)::

    GENERATE   [MAGIC][0x01][GenerateRequest][client identity]
    ABORT      [MAGIC][0x02][Abort]
    HEARTBEAT  [MAGIC][0x06][]                         broker -> worker
    HEARTBEAT  [MAGIC][0x06][WorkerLoad]               worker -> broker
    DISCONNECT [MAGIC][0x07][]                         broker -> worker: "I do not know you, send READY"
    READY      [MAGIC][0x05][WorkerReady]
    DISCONNECT [MAGIC][0x07][Disconnect]               worker -> broker: draining / leaving
    ERROR      [MAGIC][0x04][ErrorMsg][client identity]
    OUTPUTS    [MAGIC][0x03][OutputsHeader]([client identity][Outputs])*
    CONTROL    [MAGIC][0x09][ControlRequest][payload]* broker -> worker (payload: raw tensor bytes)
    CONTROL    [MAGIC][0x09][RankReply]                worker -> broker

Control commands fan out to every live worker (or the one rank asked for); the
broker answers the client once every targeted worker replied or died.

The relay fast path is OUTPUTS: a worker ships ONE frame set per engine step; the
deltas are grouped per client and each group is encoded once as that client's
``Outputs`` body.  The broker decodes only the small ``OutputsHeader`` (request
ids started/finished this step, the worker's load) to keep its request table
current, and forwards every ``[identity][Outputs]`` pair to the frontend as
``[identity][MAGIC][0x03][Outputs]`` without touching the body.  Because the
worker receives the client identity with each GENERATE, the broker never needs
a per-delta lookup.

Bookkeeping the broker derives from these messages: a request is "started" once
a header lists it (it can no longer be retried on another worker if its worker
dies) and leaves the broker's table when a header lists it as finished or an
ERROR for it arrives.  Request ids must be unique among in-flight requests (a
duplicate gets ERROR 400).  A DISCONNECT from the broker tells a worker that the
broker does not know it (restart, or it was declared dead): the worker drops its
requests (their clients were already told) and sends READY again.

Anything malformed (wrong magic, unknown type, wrong frame count, undecodable
body) raises ``FrameError``; receivers log it (rate limited) and drop the message.
"""
from __future__ import annotations

from typing import Optional, Sequence, Type, TypeVar

import msgspec
import zmq
from zmq.backend import Socket as _BackendSocket

from common.protocol import (MAGIC, Abort, ClusterInfo, ControlReply, ControlRequest, Disconnect, ErrorMsg,
                             GenerateRequest, KvEvents, MsgType, Outputs, OutputsHeader, RankReply, WorkerLoad,
                             WorkerReady)

T = TypeVar("T")

KNOWN_TYPES = frozenset(v for k, v in vars(MsgType).items() if not k.startswith("_"))
EMPTY = b""


class FrameError(ValueError):
    """A message that does not follow the layouts above."""


# One encoder, one decoder per Struct: msgspec caches the type plan in them.
_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {
    t: msgspec.msgpack.Decoder(t)
    for t in (GenerateRequest, Abort, Outputs, ErrorMsg, WorkerReady, WorkerLoad, ClusterInfo, OutputsHeader,
              Disconnect, ControlRequest, ControlReply, RankReply, KvEvents)
}


def encode(obj) -> bytes:
    return _encoder.encode(obj)


def decode(data, type_: Type[T]) -> T:
    """Decode a body (bytes, memoryview or zmq.Frame buffer); FrameError if invalid."""
    try:
        return _decoders[type_].decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(f"bad {type_.__name__} body: {exc}") from None
    except RecursionError:  # e.g. kv_transfer_params nested thousands deep: garbage, not a bug
        raise FrameError(f"bad {type_.__name__} body: nested too deeply") from None


class _RequestIdOnly(msgspec.Struct, array_like=True):
    request_id: str  # GenerateRequest's first field


_rid_decoder = msgspec.msgpack.Decoder(_RequestIdOnly)


def request_id_of(data) -> Optional[str]:
    """The ``request_id`` of a GENERATE body that does not decode as a GenerateRequest
    (a field of the wrong type further in), so that its sender gets an error instead of
    waiting forever; None when not even that can be read."""
    try:
        return _rid_decoder.decode(data).request_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    except RecursionError:  # skipping the rest recursed too deep: read the first field by hand
        return _leading_str(bytes(data))


def _leading_str(data: bytes) -> Optional[str]:
    """The first element of a msgpack array when it is a string (GenerateRequest's
    request_id), without looking further into the body."""
    if not data:
        return None
    head = data[0]
    at = 1 if 0x90 <= head <= 0x9f else 3 if head == 0xdc else 5 if head == 0xdd else None
    if at is None or len(data) <= at:
        return None
    tag = data[at]
    if 0xa0 <= tag <= 0xbf:
        start, size = at + 1, tag - 0xa0
    elif tag in (0xd9, 0xda, 0xdb):
        width = {0xd9: 1, 0xda: 2, 0xdb: 4}[tag]
        start, size = at + 1 + width, int.from_bytes(data[at + 1:at + 1 + width], "big")
    else:
        return None
    if len(data) < start + size:
        return None
    try:
        return data[start:start + size].decode()
    except UnicodeDecodeError:
        return None


def message(msg_type: bytes, body=EMPTY, *extra) -> list:
    """Frames of one message, without routing identity.  ``body`` may be a Struct."""
    if not isinstance(body, (bytes, bytearray, memoryview)):
        body = _encoder.encode(body)
    return [MAGIC, msg_type, body, *extra]


def split(frames: Sequence, min_frames: int = 3) -> tuple[bytes, list]:
    """Check MAGIC and type of ``frames`` (identity already stripped).

    Returns (type byte, frames from the body on).  Works with bytes or zmq.Frame.
    """
    if len(frames) < min_frames:
        raise FrameError(f"expected at least {min_frames} frames, got {len(frames)}")
    magic, msg_type = _bytes(frames[0]), _bytes(frames[1])
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic[:8]!r}")
    if msg_type not in KNOWN_TYPES:
        raise FrameError(f"unknown message type {msg_type[:8]!r}")
    return msg_type, list(frames[2:])


def expect_count(rest: Sequence, n: int, what: str) -> None:
    if len(rest) != n:
        raise FrameError(f"{what}: expected {n} frame(s) after the type, got {len(rest)}")


def _bytes(frame) -> bytes:
    return frame if isinstance(frame, bytes) else frame.bytes


def nonce_bytes(nonce: int) -> bytes:
    return nonce.to_bytes(8, "little")


def nonce_from(frame) -> int:
    data = _bytes(frame)
    if len(data) != 8:
        raise FrameError("nonce frame must be 8 bytes")
    return int.from_bytes(data, "little")


# Hot-path socket IO.  pyzmq's send_multipart/recv_multipart wrappers cost ~20 us per
# message in Python (flag enums, per-frame checks); calling the backend directly is
# ~4x cheaper, which is most of the broker's per-message budget.  Both are
# non-blocking.  On a ROUTER_MANDATORY socket an unroutable identity fails on the
# first frame (EHOSTUNREACH), so no partial message is ever left behind.
_NB = int(zmq.NOBLOCK)
_MORE_NB = int(zmq.SNDMORE | zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
_ZERO_COPY_BYTES = 1 << 16  # above this, hand the buffer to libzmq instead of copying
_send = _BackendSocket.send
_recv = _BackendSocket.recv
_get = _BackendSocket.get


def send_frames(sock: zmq.Socket, frames: Sequence) -> None:
    """Send a multipart message without blocking (raises zmq.Again / EHOSTUNREACH)."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        _send(sock, frame, _MORE_NB if i < last else _NB, len(frame) < _ZERO_COPY_BYTES)


def recv_frames(sock: zmq.Socket) -> list[bytes]:
    """Receive one multipart message without blocking (raises zmq.Again when none)."""
    frames = [_recv(sock, _NB)]
    while _get(sock, _RCVMORE):
        frames.append(_recv(sock, _NB))
    return frames


def recv_frames_zero_copy_payload(sock: zmq.Socket, routed: bool = False) -> list:
    """``recv_frames``, except that the payload frames of a CONTROL message (tensor
    bytes, after MAGIC, type and body) stay zmq.Frame objects over libzmq's buffers
    instead of being copied into bytes.  ``routed``: a ROUTER socket, whose first
    frame is the sender's identity."""
    at = 2 if routed else 1  # index of the type frame
    frames = [_recv(sock, _NB)]
    while _get(sock, _RCVMORE):
        if len(frames) > at + 1 and frames[at] == MsgType.CONTROL:
            frames.append(_recv(sock, _NB, False))
        else:
            frames.append(_recv(sock, _NB))
    return frames
