"""Direct ZeroMQ client of the broker: what the gateway uses, and what scripts / RL
trainers can use to skip HTTP entirely.

One DEALER socket per client object, multiplexed by request id; frame layouts in
common/framing.py.  The client heartbeats the broker; when the connection to it
drops (the broker exited, or libzmq's link heartbeats went unanswered for the
liveness period: stopped, cut off; common/link_heartbeats.py), or a broker whose
link is up sends nothing for ``unresponsive_timeout``, every in-flight request fails
with a 503 ``RequestError``.  The client keeps working once the broker is back
(ZeroMQ reconnects by itself).
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import struct
import threading
import time
from typing import AsyncIterator, Iterator, Optional, Sequence

import zmq
import zmq.asyncio

from common import config, framing, link_heartbeats, runtime_dir, security, tensor_frames
from common.errors import ServingError
from common.framing import FrameError
from common.logging import RateLimitedLog, get_logger
from common.protocol import (Abort, ClusterInfo, CompletionDelta, ControlReply, ControlRequest, ErrorMsg,
                             GenerateRequest, MsgType, Outputs)

log = get_logger("tokserve.client")


class RequestError(ServingError):
    """A request failed: built from the broker's/worker's ErrorMsg, or raised locally
    (503) when the broker is unreachable or lost."""

    def __init__(self, message: str, status: int = 500, type: Optional[str] = None, param: Optional[str] = None,
                 request_id: Optional[str] = None):
        super().__init__(message, param, status=status, type=type or _default_type(status))
        self.request_id = request_id

    @classmethod
    def from_msg(cls, err: ErrorMsg) -> "RequestError":
        return cls(err.message, err.status, err.type, err.param, err.request_id)

    def __repr__(self) -> str:
        return f"RequestError(status={self.status}, type={self.type!r}, message={self.message!r})"


def _default_type(status: int) -> str:
    return {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(
        status, "InternalServerError")


def _unavailable(message: str, request_id: Optional[str] = None) -> RequestError:
    return RequestError(message, 503, "ServiceUnavailableError", None, request_id)


_BULK_MIN_BYTES_PER_S = 20e6


class _Stream:
    __slots__ = ("queue", "remaining")

    def __init__(self, n: int):
        self.queue: asyncio.Queue = asyncio.Queue()  # lists of deltas, or a RequestError
        self.remaining = n


class AsyncClient:
    """asyncio client; use inside one event loop (``async with AsyncClient(...)``).

    Control commands carry the broker's control token: ``control_token``, else the file
    ``control_token_file`` / $TOKSERVE_CONTROL_TOKEN_FILE / the runtime directory's
    control.token, read at the first command (so a client that only generates never
    touches it).  ``read_control_token=False``: never read it (a gateway without control
    routes holds no more privilege than it needs)."""

    def __init__(self, address: str | None = None, *, identity: bytes | None = None,
                 curve_server_key: bytes | None = None, curve_client_keys: security.CurveKeys | None = None,
                 heartbeat_interval: float | None = None,
                 liveness: int | None = None, context: zmq.asyncio.Context | None = None,
                 control_token: str | None = None, control_token_file: str | None = None,
                 read_control_token: bool = True, unresponsive_timeout: float | None = None):
        self.address = address or config.frontend_address()
        self._control_token = control_token
        self._control_token_file = control_token_file
        self._read_control_token = read_control_token
        self.identity = identity
        self.curve_server_key = curve_server_key
        self.curve_client_keys = curve_client_keys  # needed when the broker authenticates peers
        self.interval = heartbeat_interval or config.heartbeat_interval()
        self.liveness = liveness or config.heartbeat_liveness()
        # A busy broker (its Python loop starved, or long in a batch) is slow, not gone: the
        # link heartbeats catch a dead one; this bound is for a live link that says nothing.
        self.expiry = max(unresponsive_timeout or config.unresponsive_timeout(), self.interval * self.liveness)
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock: Optional[zmq.asyncio.Socket] = None
        self._streams: dict[str, _Stream] = {}
        self._info_waiters: dict[int, asyncio.Future] = {}  # INFO and CONTROL replies, by nonce
        self._nonces = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self._last_heard = 0.0
        self._monitor: Optional[zmq.asyncio.Socket] = None
        self._bad = RateLimitedLog(log)
        self._outputs_decoder = framing._decoders[Outputs]
        self._bulk_bytes = 0  # weight-bucket bytes sent and not yet answered

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._sock is not None:
            return
        runtime_dir.check_before_connect(self.address)  # never talk to a socket someone else planted
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing into a missing connection: fail fast instead
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        link_heartbeats.enable(sock, self.interval, self.liveness)
        if self.identity:
            sock.setsockopt(zmq.ROUTING_ID, self.identity)
        if self.curve_server_key:
            security.configure_client(sock, self.curve_server_key, self.curve_client_keys)
        # A dropped connection means the broker process died (or restarted faster than the
        # heartbeat liveness): the requests it routed are lost, so fail them at once.
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.address)
        self._sock = sock
        self._last_heard = time.monotonic()
        self._tasks = [asyncio.create_task(self._reader(), name="tokserve-client-reader"),
                       asyncio.create_task(self._heartbeat(), name="tokserve-client-heartbeat"),
                       asyncio.create_task(self._watch_disconnects(), name="tokserve-client-monitor")]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        self._fail_all(_unavailable("client closed"))
        if self._sock is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(0)
            self._sock.close(0)
            self._sock = None

    async def __aenter__(self) -> "AsyncClient":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ API
    async def generate(self, request: GenerateRequest) -> AsyncIterator[CompletionDelta]:
        """Yield the deltas of all choices as they arrive; end when every choice finished.

        Raises RequestError on an error from the cluster or when the broker is
        unreachable/lost.  Closing the generator early aborts the request.
        """
        if self._sock is None:
            await self.start()
        rid = request.request_id
        if rid in self._streams:
            raise RequestError(f"request_id {rid!r} is already in flight on this client", 400,
                               param="request_id", request_id=rid)
        stream = _Stream(max(1, request.params.n))
        self._streams[rid] = stream
        if not await self._send_when_connected(framing.message(MsgType.GENERATE, request)):
            if self._streams.get(rid) is stream:
                del self._streams[rid]
            raise _unavailable(f"broker at {self.address} is unreachable", rid)
        ended = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, RequestError):
                    ended = True
                    raise item
                for delta in item:
                    if delta.finish_reason is not None:
                        stream.remaining -= 1
                        ended = stream.remaining <= 0
                    yield delta
                if ended:
                    return
        finally:
            if self._streams.get(rid) is stream:
                del self._streams[rid]
            if not ended:  # abandoned by the caller (aclose / cancellation)
                self._send(framing.message(MsgType.ABORT, Abort([rid])))

    async def abort(self, request_ids: list[str]) -> None:
        """Abort requests; their streams end with finish_reason "abort".  Unknown ids are ignored."""
        if request_ids:
            if self._sock is None:
                await self.start()
            await self._send_when_connected(framing.message(MsgType.ABORT, Abort(list(request_ids))))

    async def info(self, timeout: float = 2.0) -> ClusterInfo:
        """Live workers with their load and the served model; RequestError(503) on timeout."""
        if self._sock is None:
            await self.start()
        nonce = next(self._nonces)
        fut = asyncio.get_running_loop().create_future()
        self._info_waiters[nonce] = fut
        try:
            if not await self._send_when_connected(framing.message(MsgType.INFO, framing.nonce_bytes(nonce))):
                raise _unavailable(f"broker at {self.address} is unreachable")
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise _unavailable(f"broker at {self.address} did not answer within {timeout}s") from None
        finally:
            self._info_waiters.pop(nonce, None)

    # ------------------------------------------------------- control plane
    async def control(self, op: str, args: Optional[dict] = None, *, rank: Optional[int] = None,
                      payload: Sequence = (), timeout: Optional[float] = None) -> ControlReply:
        """Run a control command on every live worker (or ``rank``); the aggregated reply.

        Raises RequestError with the broker's status when any targeted worker refused
        or failed (its message names the ranks), 503 when the broker is unreachable.
        ``payload`` frames (e.g. a weight bucket) go to every targeted worker."""
        if self._sock is None:
            await self.start()
        nonce = next(self._nonces)
        body = framing.encode(ControlRequest(nonce, op, dict(args or {}), rank, token=self._token()))
        fut = asyncio.get_running_loop().create_future()
        self._info_waiters[nonce] = fut
        try:
            frames = [framing.MAGIC, MsgType.CONTROL, body, *payload]
            nbytes = sum(len(f) for f in payload)
            self._bulk_bytes += nbytes
            try:
                if not await self._send_when_connected(frames, copy=not payload):  # tensor bytes: zero-copy
                    raise _unavailable(f"broker at {self.address} is unreachable")
                reply: ControlReply = await asyncio.wait_for(fut, timeout)
            finally:
                self._bulk_bytes -= nbytes
        except asyncio.TimeoutError:
            raise _unavailable(f"{op}: no reply within {timeout}s") from None
        finally:
            self._info_waiters.pop(nonce, None)
        if not reply.ok:
            raise RequestError(reply.message, reply.status, reply.error_type or None)
        return reply

    async def pause(self, mode: str = "abort", clear_cache: bool = True, **kw) -> None:
        """Stop serving: ``abort`` in-flight requests, ``wait`` for them, or ``keep`` them frozen.
        After ``abort`` / ``wait`` new requests fail with a retryable 503 until ``resume``
        (vLLM 0.33); after ``keep`` they wait in the broker and run on resume."""
        await self.control("pause", {"mode": mode, "clear_cache": clear_cache}, **kw)

    async def resume(self, **kw) -> None:
        await self.control("resume", **kw)

    async def is_paused(self) -> bool:
        return bool((await self.control("is_paused")).result["is_paused"])

    async def abort_all(self, request_ids: Optional[list[str]] = None) -> int:
        """Abort these requests (or all) of every client; the number aborted."""
        args = {"request_ids": list(request_ids)} if request_ids else {}
        return int((await self.control("abort", args)).result["aborted"])

    async def update_weights(self, named_tensors, version: Optional[str] = None, *,
                             bucket_bytes: int = tensor_frames.DEFAULT_BUCKET_BYTES, rank: Optional[int] = None,
                             timeout: Optional[float] = None, max_in_flight: int = 2) -> int:
        """Push (name, tensor) pairs to every worker in buckets of raw frames, then swap
        them in at once (and label them ``version``).  Returns the tensor count."""
        await self.control("start_weight_update", rank=rank, timeout=timeout)
        # Buckets are pipelined (a few in flight) so the hops client -> broker -> worker
        # overlap instead of adding up; workers take them in order.
        window = asyncio.Semaphore(max_in_flight)
        sent: list[asyncio.Task] = []
        count = 0

        async def one(info, frames):
            try:
                await self.control("update_weights", {"update_info": info}, payload=frames, rank=rank,
                                   timeout=timeout)
            finally:
                window.release()

        for info, frames in tensor_frames.buckets(named_tensors, bucket_bytes):
            await window.acquire()
            sent.append(asyncio.ensure_future(one(info, frames)))
            count += len(info["names"])
        results = await asyncio.gather(*sent, return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]  # the session is now failed on the workers: finish would refuse it
        args = {"weight_version": version} if version is not None else {}
        await self.control("finish_weight_update", args, rank=rank, timeout=timeout)
        return count

    async def update_weights_from_disk(self, path: str, version: Optional[str] = None, **kw) -> None:
        """Every worker reloads the safetensors checkpoint in ``path`` (a folder they can read)."""
        await self.control("start_weight_update", **kw)
        await self.control("update_weights", {"update_info": {"path": path}}, **kw)
        args = {"weight_version": version} if version is not None else {}
        await self.control("finish_weight_update", args, **kw)

    async def weight_info(self) -> dict:
        """The pool's weight version and each rank's (``stale`` ranks are held out of dispatch)."""
        return (await self.control("weight_info")).result

    async def weight_checksums(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for r in (await self.control("weight_checker", {"action": "checksum"})).ranks:
            out.update(r.result["checksums"])
        return out

    async def load_lora(self, name: str, path: str, load_inplace: bool = False) -> None:
        """Register a PEFT LoRA adapter on every worker (vLLM's /v1/load_lora_adapter)."""
        await self.control("load_lora_adapter", {"lora_name": name, "lora_path": path, "load_inplace": load_inplace})

    async def unload_lora(self, name: str) -> None:
        await self.control("unload_lora_adapter", {"lora_name": name})

    async def reset_prefix_cache(self) -> bool:
        reply = await self.control("reset_prefix_cache")
        return all(r.result.get("success") for r in reply.ranks)

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        await self.control("sleep", {"level": level, "mode": mode})

    async def wake_up(self, tags: Optional[list[str]] = None) -> bool:
        """True once every worker holds its weights and KV cache again."""
        reply = await self.control("wake_up", {"tags": tags} if tags else {})
        return all(r.result.get("fully_awake") for r in reply.ranks)

    async def is_sleeping(self) -> bool:
        reply = await self.control("is_sleeping")
        return any(r.result.get("is_sleeping") for r in reply.ranks)

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------- internals
    def _token(self) -> str:
        """The control token, read once found; "" (the broker refuses with 401) when none."""
        if self._control_token is None and self._read_control_token:
            try:
                self._control_token = runtime_dir.read_token(runtime_dir.CONTROL, self._control_token_file)
            except (runtime_dir.RuntimeDirError, OSError) as exc:
                raise RequestError(f"cannot read the control token: {exc}", 401, "Unauthorized") from None
        return self._control_token or ""

    def _send(self, frames: list, copy: bool = True) -> bool:
        """Non-blocking send (never waits on HWM); False when no broker connection exists.
        ``copy=False`` hands the buffers to libzmq (they must stay unchanged until sent)."""
        fut = self._sock.send_multipart(frames, zmq.NOBLOCK, copy=copy)
        if not fut.done():
            # pyzmq queues even a NOBLOCK send behind any pending send-side future (an
            # awaited POLLOUT poll is one), to go out whenever the socket turns writable.
            # A message parked there would count as sent without a connection: refuse it.
            fut.cancel()
            return False
        exc = fut.exception()
        if isinstance(exc, zmq.Again):
            return False
        if exc is not None:
            raise exc
        return True

    async def _send_when_connected(self, frames: list, copy: bool = True) -> bool:
        """Send, waiting up to one heartbeat interval for a (re)connection to the broker.

        It retries on a short timer rather than awaiting the socket's POLLOUT: pyzmq
        registers such a poll as a pending send, and while one is pending every other
        non-blocking send on the socket would be queued instead of attempted."""
        if self._send(frames, copy):
            return True
        deadline = time.monotonic() + self.interval
        pause = 0.005
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(pause, left))
            if self._send(frames, copy):
                return True
            pause = min(pause * 2, 0.05)
        return False

    def _fail_all(self, error: RequestError) -> None:
        for rid, stream in list(self._streams.items()):
            stream.queue.put_nowait(RequestError(error.message, error.status, error.type, None, rid))
        self._streams.clear()
        for fut in self._info_waiters.values():
            if not fut.done():
                fut.set_exception(error)

    async def _heartbeat(self) -> None:
        beat = framing.message(MsgType.HEARTBEAT)
        while True:
            await asyncio.sleep(self.interval)
            self._send(beat)
            silent = time.monotonic() - self._last_heard
            # Heartbeats queue behind our own weight buckets on the same connection: allow
            # for those bytes at a pessimistic rate before calling the broker lost.
            allowance = self.expiry + self._bulk_bytes / _BULK_MIN_BYTES_PER_S
            if silent > allowance and (self._streams or self._info_waiters):
                log.warning("broker silent for %.1fs: failing %d in-flight request(s)", silent, len(self._streams))
                self._fail_all(_unavailable(f"lost connection to the broker ({silent:.1f}s without heartbeat)"))

    async def _watch_disconnects(self) -> None:
        while True:
            frames = await self._monitor.recv_multipart()
            if len(frames) != 2 or len(frames[0]) != 6:
                continue
            if struct.unpack("=hi", frames[0])[0] != zmq.EVENT_DISCONNECTED or not self._streams:
                continue
            lost = list(self._streams)
            log.warning("connection to the broker dropped: failing %d in-flight request(s)", len(lost))
            self._fail_all(_unavailable("lost connection to the broker (disconnected)"))
            # If they reached a broker that is back already, don't leave them running.
            self._send(framing.message(MsgType.ABORT, Abort(lost)))

    async def _reader(self) -> None:
        sock = self._sock
        while True:
            frames = await sock.recv_multipart()
            self._last_heard = time.monotonic()
            try:
                self._dispatch(frames)
            except FrameError as exc:
                self._bad.warning("dropped malformed message from broker: %s", exc)
            except Exception:
                log.exception("error handling a broker message; dropped")

    def _dispatch(self, frames: list) -> None:
        msg_type, rest = framing.split(frames)
        if msg_type == MsgType.OUTPUTS:
            deltas = framing.decode(rest[0], Outputs).deltas
            streams = self._streams
            if len(deltas) == 1:
                stream = streams.get(deltas[0].request_id)
                if stream is not None:
                    stream.queue.put_nowait(deltas)
                return
            per_request: dict[str, list] = {}
            for d in deltas:
                per_request.setdefault(d.request_id, []).append(d)
            for rid, ds in per_request.items():
                stream = streams.get(rid)
                if stream is not None:  # else: already finished/abandoned locally
                    stream.queue.put_nowait(ds)
        elif msg_type == MsgType.ERROR:
            err = framing.decode(rest[0], ErrorMsg)
            stream = self._streams.pop(err.request_id, None)
            if stream is not None:
                stream.queue.put_nowait(RequestError.from_msg(err))
        elif msg_type == MsgType.CONTROL:
            reply = framing.decode(rest[0], ControlReply)
            fut = self._info_waiters.get(reply.nonce)
            if fut is not None and not fut.done():
                fut.set_result(reply)
        elif msg_type == MsgType.INFO:
            framing.expect_count(rest, 2, "INFO")
            fut = self._info_waiters.get(framing.nonce_from(rest[1]))
            if fut is not None and not fut.done():
                fut.set_result(framing.decode(rest[0], ClusterInfo))
        elif msg_type != MsgType.HEARTBEAT:
            raise FrameError(f"unexpected message type {msg_type!r} from broker")


_END = object()


class Client:
    """Synchronous twin of AsyncClient (scripts, RL trainers): an AsyncClient on a
    private event-loop thread.  Thread-safe: many threads may generate at once."""

    def __init__(self, address: str | None = None, **kwargs):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tokserve-client", daemon=True)
        self._thread.start()
        self._closed = False

        async def make() -> AsyncClient:
            client = AsyncClient(address, context=zmq.asyncio.Context(), **kwargs)
            await client.start()
            return client

        self._client: AsyncClient = self._call(make())

    def _call(self, coro, timeout: Optional[float] = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def generate(self, request: GenerateRequest) -> Iterator[CompletionDelta]:
        """Iterator over the deltas; closing it early aborts the request."""
        items: queue.Queue = queue.Queue()

        async def pump() -> None:
            try:
                async for delta in self._client.generate(request):
                    items.put(delta)
                items.put(_END)
            except asyncio.CancelledError:
                items.put(_END)
                raise
            except BaseException as exc:
                items.put(exc)

        future = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while True:
                item = items.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not future.done():
                future.cancel()  # cancels the async generator: it sends ABORT

    def abort(self, request_ids: list[str]) -> None:
        self._call(self._client.abort(request_ids))

    def info(self, timeout: float = 2.0) -> ClusterInfo:
        return self._call(self._client.info(timeout))

    # Control plane: the AsyncClient methods, run on the client's loop.
    def control(self, op: str, args: Optional[dict] = None, **kw) -> ControlReply:
        return self._call(self._client.control(op, args, **kw))

    def pause(self, mode: str = "abort", clear_cache: bool = True, **kw) -> None:
        self._call(self._client.pause(mode, clear_cache, **kw))

    def resume(self, **kw) -> None:
        self._call(self._client.resume(**kw))

    def is_paused(self) -> bool:
        return self._call(self._client.is_paused())

    def abort_all(self, request_ids: Optional[list[str]] = None) -> int:
        return self._call(self._client.abort_all(request_ids))

    def update_weights(self, named_tensors, version: Optional[str] = None, **kw) -> int:
        return self._call(self._client.update_weights(named_tensors, version, **kw))

    def update_weights_from_disk(self, path: str, version: Optional[str] = None, **kw) -> None:
        self._call(self._client.update_weights_from_disk(path, version, **kw))

    def weight_info(self) -> dict:
        return self._call(self._client.weight_info())

    def weight_checksums(self) -> dict[str, str]:
        return self._call(self._client.weight_checksums())

    def reset_prefix_cache(self) -> bool:
        return self._call(self._client.reset_prefix_cache())

    def load_lora(self, name: str, path: str, load_inplace: bool = False) -> None:
        self._call(self._client.load_lora(name, path, load_inplace))

    def unload_lora(self, name: str) -> None:
        self._call(self._client.unload_lora(name))

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self._call(self._client.sleep(level, mode))

    def wake_up(self, tags: Optional[list[str]] = None) -> bool:
        return self._call(self._client.wake_up(tags))

    def is_sleeping(self) -> bool:
        return self._call(self._client.is_sleeping())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._client.close(), timeout=5)
            self._client._ctx.term()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            self._loop.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
