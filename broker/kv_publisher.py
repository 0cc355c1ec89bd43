"""The cell's KV events for an outside router, in vLLM's ZeroMQ wire format.

A *cell* is one broker with its workers and gateways; several cells run behind an L7
router (vllm-router ``--policy kv_aware``), which treats each cell's gateway as one
backend.  The router learns where prefixes are cached by subscribing to each backend's
KV-event stream (``GET /kv_event_sources`` on the gateway names this socket): vLLM's
``ZmqEventPublisher`` frames ``[topic, seq (8 bytes, big-endian), msgpack EventBatch]``,
``EventBatch = [ts, [BlockStored | BlockRemoved | AllBlocksCleared, ...]]``, events as
maps tagged ``"type"`` (vllm/distributed/kv_events.py).

The stream describes the cell as one cache: a block is announced stored when the first
worker of the cell caches it and removed when the last one drops it (reference counts
per routing key), so a worker evicting a block another worker still holds does not make
the router forget it.  Block hashes on the wire are the routing keys
(common/prefix_hash.py), the same on every cell for the same prefix; the router keys its
own index by the token ids each ``BlockStored`` carries, which the workers send with
their KV events (common/protocol.py ``KvBlockTokens``).  Blocks whose chain holds a cache
salt or an image are never announced: a token-only router cannot compute their keys.

A subscriber that joins late (a router started, or restarted, after the cell) gets every
block the cell holds re-announced, a batch per turn of the broker's loop: the socket is
an XPUB, which hears subscriptions, and the publisher keeps each announced block's parent
and token ids.  Existing subscribers see the repeats, which change nothing for them.

Bounded: each worker contributes at most ``capacity`` keys (twice its KV blocks, as the
broker's own prefix index); the socket drops at its high-water mark rather than block the
broker's loop (a subscriber that misses a sequence number resets its view of this cell,
as with vLLM's publisher without a replay socket).

Trust: the socket only sends, apart from subscriptions (which at most trigger one
re-announcement at a time, a batch per loop turn).  Anyone who can connect reads the token
ids of every prompt prefix cached in the cell (other users' prompts included), so by
default it is an ``ipc://`` socket in the private (0700) runtime directory, which only the
same user reaches (vllm-router subscribes to ipc:// as to tcp://).  ZeroMQ over TCP knows
no peer uid and vllm-router speaks no CURVE: a TCP publisher is an explicit opt-in
(``--kv-events-allow-tcp``, loopback: every local user reads the prefixes) and beyond
loopback a second one (``--kv-events-allow-remote``: network policy must keep it to the
router's hosts).
"""
from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Optional

import msgspec
import numpy as np
import zmq

from common import runtime_dir
from common.logging import get_logger
from common.protocol import KvEvents

log = get_logger("tokserve.broker.kv_publisher")

MAX_EVENTS_PER_BATCH = 4096  # vllm-router refuses larger batches
PUB_HWM = 10_000  # batches queued per subscriber before the socket drops (never blocks)


# vLLM's event structs (vllm/distributed/kv_events.py): maps tagged "type", batch as an array.
class _Event(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class BlockStored(_Event):
    block_hashes: list[bytes]
    parent_block_hash: Optional[bytes]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]


class BlockRemoved(_Event):
    block_hashes: list[bytes]
    medium: Optional[str]


class AllBlocksCleared(_Event):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list
    data_parallel_rank: Optional[int] = None


MEDIUM = "GPU"  # vLLM's label for the device KV cache (CPU workers' cache plays that part)
_encoder = msgspec.msgpack.Encoder()


def _stored(key: bytes, parent: Optional[bytes], tokens: bytes, block_size: int) -> BlockStored:
    return BlockStored(block_hashes=[key], parent_block_hash=parent,
                       token_ids=np.frombuffer(tokens, dtype="<i4").tolist(), block_size=block_size,
                       lora_id=None, medium=MEDIUM, lora_name=None)


DEFAULT_SOCKET = "kv-events.sock"  # in the runtime directory: ``--kv-events-endpoint`` without a value


def default_endpoint() -> str:
    return runtime_dir.ipc_endpoint(DEFAULT_SOCKET)


def is_loopback_tcp(endpoint: str) -> bool:
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
    return host in ("127.0.0.1", "localhost", "[::1]", "::1")


def check_endpoint(endpoint: str, allow_tcp: bool = False, allow_remote: bool = False) -> None:
    """ValueError unless this publisher may bind ``endpoint``: ipc:// in a private folder
    (only the same user connects), or TCP the operator opted into (``allow_remote``
    implies ``allow_tcp``: it says more)."""
    if endpoint.startswith("ipc://"):
        folder = Path(runtime_dir.ipc_path(endpoint)).parent
        if folder == runtime_dir.path():
            return  # created private by prepare_ipc_bind, or refused there if it is not
        try:
            st = os.lstat(folder)
        except OSError as exc:
            raise ValueError(f"--kv-events-endpoint {endpoint!r}: cannot use folder {folder}: {exc}") from None
        if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ValueError(f"--kv-events-endpoint {endpoint!r}: folder {folder} is not private to this user "
                             f"(a real directory of ours, mode 0700), so other users could read cached prompts' "
                             f"token ids; use the runtime directory (give --kv-events-endpoint no value)")
        return
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"--kv-events-endpoint must be ipc://PATH or tcp://HOST:PORT, got {endpoint!r}")
    if not (allow_tcp or allow_remote):
        raise ValueError(f"--kv-events-endpoint {endpoint!r}: over TCP every local user who connects reads the "
                         f"token ids of cached prompt prefixes (vllm-router speaks no CURVE); give "
                         f"--kv-events-endpoint no value (ipc:// in the private runtime directory), or add "
                         f"--kv-events-allow-tcp to mean it")
    if not allow_remote and not is_loopback_tcp(endpoint):
        raise ValueError(f"--kv-events-endpoint {endpoint!r} is beyond loopback: subscribers read the token "
                         f"ids of cached prompt prefixes; add --kv-events-allow-remote to mean it")


class CellKvPublisher:
    def __init__(self, ctx: zmq.Context, endpoint: str, allow_tcp: bool = False, allow_remote: bool = False,
                 topic: str = ""):
        check_endpoint(endpoint, allow_tcp, allow_remote)
        runtime_dir.prepare_ipc_bind(endpoint)  # ipc: a private runtime directory, never a live socket's path
        self.topic = topic.encode()
        # XPUB: a PUB that also hears subscriptions, so a router that subscribes late (or
        # again, after a restart) gets the blocks already announced (VERBOSE: every one,
        # not only a topic's first subscriber).
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, PUB_HWM)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)  # the port when bound to :0
        self._seq = 0
        self._refs: dict[bytes, int] = {}  # routing key -> workers of the cell holding it
        # Announced keys (stored in the cell, not removed), in announcement order (parents
        # first) -> parent key (b"": none) + token ids: what a late subscriber is sent.  About
        # 200 bytes per key, the order of the broker's own prefix index.
        self._announced: dict[bytes, bytes] = {}
        self._held: dict[bytes, set[bytes]] = {}  # worker identity -> its keys
        self._block_size = 0
        self._replay: list[bytes] = []  # keys still to re-announce for a new subscriber
        self._replay_at = 0
        self.dropped_keys = 0  # keys past a worker's capacity (never announced)
        self.snapshots = 0  # re-announcements started for new subscribers
        log.info("KV events for outside routers on %s", self.endpoint)

    # ------------------------------------------------------------------ input
    def on_events(self, worker: bytes, events: KvEvents, block_size: int, capacity: int) -> None:
        out: list = []
        held = self._held.setdefault(worker, set())
        if events.cleared:
            self._drop(held, held.copy(), out)
        self._drop(held, [k for k in events.removed if k in held], out)
        tokens = {t.key: t for t in events.tokens}
        refs, announced = self._refs, self._announced
        for key in events.stored:
            if key not in held:
                if len(held) >= capacity:
                    self.dropped_keys += 1
                    continue
                held.add(key)
                refs[key] = refs.get(key, 0) + 1
            block = tokens.get(key)
            if block is not None and key not in announced:
                announced[key] = (block.parent or b"") + block.token_ids
                out.append(_stored(key, block.parent, block.token_ids, block_size))
        self._block_size = block_size
        self._send(out)

    def on_worker_gone(self, worker: bytes) -> None:
        held = self._held.pop(worker, None)
        if held:
            out: list = []
            self._drop(held, held.copy(), out)
            self._send(out)

    def _drop(self, held: set, keys, out: list) -> None:
        refs, announced = self._refs, self._announced
        removed = []
        for key in keys:
            held.discard(key)
            n = refs.get(key, 0) - 1
            if n > 0:
                refs[key] = n
                continue
            refs.pop(key, None)
            if announced.pop(key, None) is not None:
                removed.append(key)
        if removed:
            out.append(BlockRemoved(block_hashes=removed, medium=MEDIUM))

    # ------------------------------------------------------------- subscribers
    def on_subscriptions(self) -> None:
        """Read the XPUB's subscription messages (the broker polls the socket); a new
        subscription starts re-announcing every block the cell holds, sent a batch per
        ``pump()`` so that a large cell never stalls the broker's loop."""
        subscribed = False
        while True:
            try:
                msg = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            subscribed |= msg[:1] == b"\x01"
        if subscribed:
            self._replay, self._replay_at = list(self._announced), 0
            self.snapshots += 1

    @property
    def replaying(self) -> bool:
        return self._replay_at < len(self._replay)

    def pump(self) -> None:
        """One batch of the re-announcement in progress.  A key removed since it started is
        skipped (its BlockRemoved already went out); one stored since went out live."""
        announced, out, bs = self._announced, [], self._block_size
        keys, i = self._replay, self._replay_at
        while i < len(keys) and len(out) < MAX_EVENTS_PER_BATCH:
            key = keys[i]
            i += 1
            blob = announced.get(key)
            if blob is not None:
                parent, tokens = (blob[:len(key)], blob[len(key):]) if len(blob) > 4 * bs else (None, blob)
                out.append(_stored(key, parent, tokens, bs))
        self._replay_at = i
        if not self.replaying:
            self._replay, self._replay_at = [], 0
        self._send(out)

    # ------------------------------------------------------------------ output
    def _send(self, events: list) -> None:
        for i in range(0, len(events), MAX_EVENTS_PER_BATCH):
            payload = _encoder.encode(EventBatch(ts=time.time(), events=events[i:i + MAX_EVENTS_PER_BATCH]))
            try:
                self.sock.send_multipart([self.topic, self._seq.to_bytes(8, "big", signed=True), payload],
                                         zmq.NOBLOCK)
            except zmq.Again:  # no subscriber keeps up: it sees a sequence gap and resets this cell
                pass
            self._seq += 1

    def close(self) -> None:
        self.sock.close(0)
