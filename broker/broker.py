"""The broker: one thread, two ROUTER sockets, a request table.

Frontend ROUTER: clients (gateways, scripts).  Backend ROUTER: workers.  Frame
layouts are documented in common/framing.py.  The hot path (worker OUTPUTS ->
clients) decodes only the small OutputsHeader and forwards delta bodies as-is.
"""
from __future__ import annotations

import collections
import operator
import time
from dataclasses import dataclass, field
from typing import Optional

import msgspec
import zmq

from broker.control import ControlPlane
from broker import disagg
from broker.dispatch import make_policy, sticky_worker
from broker.prefix_index import PrefixIndex
from broker.workers import Worker, WorkerRegistry
from common import config, framing, runtime_dir, security
from common.framing import FrameError
from common.errors import BadRequest
from common.logging import RateLimitedLog, get_logger
from common.transfer_peers import (EC_PARAM, KV_PARAM, TRUST_PEERS, UNKNOWN_PEER, check_shape, ec_peers, kv_peer,
                                   parse_address)
from common.protocol import (Abort, BrokerStats, ClusterInfo, CompletionDelta, Disconnect, ErrorMsg, GenerateRequest,
                             KvEvents, MsgType, Outputs, OutputsHeader, RankReply, WorkerLoad, WorkerReady)

log = get_logger("tokserve.broker")

_E_OVERLOADED = "ServiceUnavailableError"
_E_INTERNAL = "InternalServerError"


class _DeltaId(msgspec.Struct, array_like=True, gc=False):
    request_id: str  # CompletionDelta's first field; the rest of each delta is skipped, not built


class _OutputsIds(msgspec.Struct, array_like=True, gc=False):
    deltas: list[_DeltaId]


# The request ids of an OUTPUTS body, to check that its sender serves them: about a
# third of decoding the body (its tokens, logprobs, ... are never materialized).
_outputs_ids = msgspec.msgpack.Decoder(_OutputsIds)
_request_id = operator.attrgetter("request_id")
_NONE: frozenset = frozenset()


@dataclass(eq=False)
class Entry:
    """One request the broker knows about, from GENERATE until its last choice finishes."""

    request_id: str
    client: bytes
    body: bytes  # the GenerateRequest as received: re-sent untouched on redispatch
    n: int
    rank: Optional[int]
    session_id: Optional[str]
    lora_name: Optional[str] = None  # adapter-aware dispatch prefers workers holding it
    prefix_hashes: Optional[list] = None  # routing keys of the prompt's blocks (cache-aware dispatch)
    roles: tuple = ()  # worker roles that may serve it (empty: any)
    pd_request: Optional[GenerateRequest] = None  # broker-native P/D / E/P/D: the request, while a leg runs
    leg: Optional[str] = None  # that leg: "prefill" | "encode" (broker/disagg.py)
    worker: Optional[Worker] = None  # None while pending
    started: bool = False  # a delta reached the client: cannot be retried elsewhere
    orphaned: bool = False  # client vanished; abort already sent
    queued: bool = False  # waiting in the pending deque
    done: bool = False  # removed (lets the pending deque skip it lazily)


@dataclass
class BrokerConfig:
    frontend: str = field(default_factory=config.frontend_address)
    backend: str = field(default_factory=config.backend_address)
    heartbeat_interval: float = config.HEARTBEAT_INTERVAL_S
    liveness: int = config.HEARTBEAT_LIVENESS
    max_pending: int = config.MAX_PENDING
    no_worker_timeout: float = config.NO_WORKER_TIMEOUT_S
    max_inflight_per_worker: int = 0  # 0: INFLIGHT_PER_SEQ_SLOT * worker's max_num_seqs
    max_client_frame_bytes: int = config.MAX_CLIENT_FRAME_BYTES
    max_worker_frame_bytes: int = config.MAX_WORKER_FRAME_BYTES
    curve_secret_key: Optional[bytes] = None  # enables CURVE server mode on both sockets
    curve_public_key: Optional[bytes] = None
    curve_authorized_dir: Optional[str] = None  # with CURVE: only peers whose public key is in here connect
    routing: str = "cache-aware"  # broker/dispatch.py ROUTING_POLICIES
    pd: str = "off"  # broker/disagg.py: "auto" splits requests over prefill and decode workers
    epd: str = "off"  # broker/disagg.py: "auto" runs image requests' encoders on encode workers first
    # Shared secrets (common/runtime_dir.py).  None: nothing matches, so no worker
    # registers and every CONTROL command is refused (fail closed).
    worker_token: Optional[str] = None
    control_token: Optional[str] = None


class Broker:
    def __init__(self, cfg: BrokerConfig, ctx: Optional[zmq.Context] = None):
        self.cfg = cfg
        self.ctx = ctx or zmq.Context.instance()
        for flag, endpoint in (("--frontend", cfg.frontend), ("--backend", cfg.backend)):
            security.refuse_plaintext_beyond_host(flag, endpoint, bool(cfg.curve_secret_key))
        # ZAP must answer before the sockets bind, else early handshakes go unauthenticated.
        self._auth = (security.start_authenticator(self.ctx, cfg.curve_authorized_dir)
                      if cfg.curve_secret_key and cfg.curve_authorized_dir else None)
        self.frontend = self._router(cfg.frontend, cfg.max_client_frame_bytes)
        self.backend = self._router(cfg.backend, cfg.max_worker_frame_bytes)
        self.workers = WorkerRegistry(cfg.heartbeat_interval, cfg.liveness, cfg.max_inflight_per_worker,
                                      config.INFLIGHT_PER_SEQ_SLOT)
        self.requests: dict[str, Entry] = {}
        self.by_client: dict[bytes, set] = collections.defaultdict(set)
        self.pending: collections.deque[Entry] = collections.deque()
        self.pending_count = 0
        self.stats = BrokerStats()
        self.policy = make_policy(cfg.routing)
        self.control = ControlPlane(self)
        self._bad_frame = RateLimitedLog(log)
        self._unreachable = RateLimitedLog(log)
        self._refused = RateLimitedLog(log)  # READY / CONTROL without the right token
        self._foreign = RateLimitedLog(log)  # outputs for requests the sender does not serve
        self._stop = False
        self._rejected: dict[bytes, float] = {}  # identity -> last DISCONNECT sent to an unknown worker

    def _router(self, endpoint: str, max_frame: int) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # EHOSTUNREACH instead of silent drops
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # backpressure is explicit (bounded pending queue), never HWM drops
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
        if self.cfg.curve_secret_key:
            security.configure_server(sock, security.CurveKeys(self.cfg.curve_public_key, self.cfg.curve_secret_key))
        try:
            runtime_dir.prepare_ipc_bind(endpoint)  # never steal a live broker's socket path
        except runtime_dir.RuntimeDirError:
            sock.close(0)
            raise
        sock.bind(endpoint)
        return sock

    # ------------------------------------------------------------------ loop
    def stop(self) -> None:
        self._stop = True

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        interval = self.cfg.heartbeat_interval
        next_beat = time.monotonic()
        log.info("broker frontend=%s backend=%s", self.cfg.frontend, self.cfg.backend)
        while not self._stop:
            now = time.monotonic()
            if now >= next_beat:
                self._heartbeat_workers()
                next_beat = now + interval
            self._expire(now)
            timeout_ms = max(1, min(int((next_beat - now) * 1000), 100))
            events = dict(poller.poll(timeout_ms))
            if self.backend in events:
                self._drain(self.backend, self._on_backend)
            if self.frontend in events:
                self._drain(self.frontend, self._on_frontend)

    def close(self) -> None:
        """Tell clients their requests are gone (instead of leaving them to time out), then close."""
        for entry in list(self.requests.values()):
            if not entry.orphaned:
                self._error(entry, entry.request_id, 503, "broker shutting down", _E_OVERLOADED)
        for worker in self.workers.all():  # they re-register with the next broker
            self._reject_unknown(worker.identity)
        self.frontend.close(linger=500)
        self.backend.close(linger=500)
        if self._auth is not None:
            self._auth.stop()

    def _drain(self, sock: zmq.Socket, handler, budget: int = 512) -> None:
        # Bounded so one busy socket cannot starve the other or the heartbeats.
        for _ in range(budget):
            try:
                # Weight buckets from clients stay in libzmq's buffers and go out to every worker uncopied.
                frames = framing.recv_frames_zero_copy_payload(sock, routed=True)
            except zmq.Again:
                return
            try:
                handler(frames)
            except FrameError as exc:
                self._bad_frame.warning("dropped malformed message on %s: %s",
                                        "backend" if sock is self.backend else "frontend", exc)
            except Exception:  # a bug must not take the whole cluster down
                log.exception("error handling a message; dropped")

    # ------------------------------------------------------------- sending
    def _to_client(self, client: bytes, frames: list) -> bool:
        try:
            framing.send_frames(self.frontend, [client, *frames])
            return True
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            self._unreachable.warning("client %s unreachable (%s): aborting its requests", client.hex(), exc)
            self._client_gone(client)
            return False

    def _to_worker(self, worker: Worker, frames: list) -> bool:
        try:
            framing.send_frames(self.backend, [worker.identity, *frames])
            return True
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            if self.workers.get(worker.identity) is worker:
                self._worker_gone(worker, f"unreachable ({exc})")
            return False

    def _error(self, entry_or_client, request_id: str, status: int, message: str, type_: str,
               param: Optional[str] = None) -> None:
        client = entry_or_client.client if isinstance(entry_or_client, Entry) else entry_or_client
        err = ErrorMsg(request_id=request_id, status=status, message=message, type=type_, param=param)
        self._to_client(client, framing.message(MsgType.ERROR, err))

    # ------------------------------------------------------------ frontend
    def _on_frontend(self, frames: list) -> None:
        client = frames[0]
        msg_type, rest = framing.split(frames[1:])
        if msg_type == MsgType.GENERATE:
            framing.expect_count(rest, 1, "GENERATE")
            self._on_generate(client, rest[0])
        elif msg_type == MsgType.ABORT:
            framing.expect_count(rest, 1, "ABORT")
            self._on_abort(client, framing.decode(rest[0], Abort).request_ids)
        elif msg_type == MsgType.HEARTBEAT:
            self._to_client(client, framing.message(MsgType.HEARTBEAT))
        elif msg_type == MsgType.INFO:
            framing.expect_count(rest, 1, "INFO")
            nonce = framing.nonce_from(rest[0])
            self._to_client(client, framing.message(MsgType.INFO, self.cluster_info(), framing.nonce_bytes(nonce)))
        elif msg_type == MsgType.CONTROL:
            self.control.on_client(client, rest)
        else:
            raise FrameError(f"message type {msg_type!r} not accepted from clients")

    def cluster_info(self) -> ClusterInfo:
        live = sorted(self.workers.all(), key=lambda w: w.rank)
        self.stats.prefix_routed = getattr(self.policy, "prefix_routed", 0)
        return ClusterInfo(workers=[w.status() for w in live], model=self.workers.last_model,
                           pending=self.pending_count, stats=self.stats, paused=self.control.paused,
                           weight_version=self.control.pool_version, lora_adapters=self.control.lora_adapters)

    def _on_generate(self, client: bytes, body: bytes) -> None:
        try:
            req = framing.decode(body, GenerateRequest)
        except FrameError as exc:
            rid = framing.request_id_of(body)
            if rid is not None:  # well framed, a field of the wrong type: a 400, not a hang
                self._error(client, rid, 400, f"malformed GENERATE request: {exc}", "BadRequestError")
            raise  # logged as a dropped malformed message
        rid = req.request_id
        if rid in self.requests:
            self._error(client, rid, 400, f"request_id {rid!r} is already in flight", "BadRequestError",
                        "request_id")
            return
        vetted = self._vet_transfer(client, req, body)
        if vetted is None:
            return
        req, body = vetted
        session = req.session_id if self.cfg.routing != "least-loaded" else None
        entry = Entry(rid, client, body, max(1, req.params.n), req.data_parallel_rank, session, req.lora_name,
                      prefix_hashes=req.prefix_hashes if self.cfg.routing == "cache-aware" else None)
        if req.data_parallel_rank is None:
            self._plan_legs(entry, req)
        self.requests[rid] = entry
        self.by_client[client].add(rid)
        self._assign(entry)

    def _vet_transfer(self, client: bytes, req: GenerateRequest, body: bytes):
        """A client's transfer parameters (common/transfer_peers.py): bounded JSON naming
        only registered workers' transfer servers, or a 400 before anything is dispatched
        (naming no host or port: no port-scan oracle).  Returns (request, body) with
        ``transfer_trust`` as this broker vouches for it: a client's own value is never
        kept, so only the broker's legs carry TRUST_KV / TRUST_EC."""
        try:
            check_shape(req.kv_transfer_params, KV_PARAM)
            check_shape(req.ec_transfer_params, EC_PARAM)
            peers = [(KV_PARAM, p) for p in [kv_peer(req.kv_transfer_params)] if p is not None]
            peers += [(EC_PARAM, p) for p in ec_peers(req.ec_transfer_params)]
            if peers:
                known = {w.transfer_peer for w in self.workers.all() if w.transfer_peer is not None}
                for param, peer in peers:
                    if peer not in known:
                        raise BadRequest(f"{param}: {UNKNOWN_PEER}", param)
        except BadRequest as exc:
            self._error(client, req.request_id, 400, exc.message, "BadRequestError", exc.param)
            return None
        trust = TRUST_PEERS if peers else 0
        if trust != req.transfer_trust:
            req = msgspec.structs.replace(req, transfer_trust=trust)
            body = framing.encode(req)
        return req, body

    # ------------------------------------------------------------ P/D and E/P/D legs
    def _plan_legs(self, entry: Entry, req: GenerateRequest) -> None:
        """Broker-native disaggregation: an encode leg first for an image request when
        encode workers are up (E/P/D); a prefill leg first when prefill and decode
        workers are up (P/D)."""
        if self.cfg.epd == "auto" and disagg.encode_eligible(req) and \
                any(w.role == disagg.ENCODE_ROLE for w in self.workers.dispatchable()):
            entry.pd_request, entry.leg = req, "encode"
            entry.roles = (disagg.ENCODE_ROLE,)
            entry.body = framing.encode(disagg.encode_leg(req))
            return
        self._plan_whole_or_prefill(entry, req)

    def _plan_whole_or_prefill(self, entry: Entry, req: GenerateRequest) -> None:
        entry.roles = ()
        if not self.workers.num_prefill:  # the common pool: nothing to plan
            return
        live = self.workers.dispatchable()
        roles = {w.role for w in live}
        if "prefill" not in roles:
            return
        if self.cfg.pd == "auto" and "decode" in roles and disagg.eligible(req, live[0].model.kv_block_size):
            entry.pd_request, entry.leg = req, "prefill"
            entry.roles = disagg.PREFILL_ROLES
            entry.body = framing.encode(disagg.prefill_leg(req))
        elif any(w.role != "prefill" for w in live):
            entry.roles = disagg.WHOLE_ROLES

    def _after_encode(self, entry: Entry, ec_transfer_params) -> None:
        """The encode leg is over (answered, or failed: then the request encodes its own
        pixels): the request itself runs next."""
        if entry.worker is not None:
            entry.worker.requests.discard(entry.request_id)
            entry.worker = None
        req = disagg.after_encode(entry.pd_request, ec_transfer_params)
        entry.pd_request, entry.leg = None, None
        entry.body = framing.encode(req)
        self._plan_whole_or_prefill(entry, req)
        self._assign(entry)

    def _run_whole(self, entry: Entry) -> None:
        """A prefill leg that could not run: the request itself goes to a whole/decode worker."""
        if entry.worker is not None:
            entry.worker.requests.discard(entry.request_id)
            entry.worker = None
        req = entry.pd_request
        entry.pd_request, entry.leg = None, None
        entry.body = framing.encode(req)
        entry.roles = disagg.WHOLE_ROLES
        self._assign(entry)

    def _on_leg_outputs(self, worker: Worker, body: bytes) -> None:
        """Deltas of legs: a finished prefill leg hands its request to a decode worker, a
        finished encode leg to a worker that pulls the encodings."""
        for delta in framing.decode(body, Outputs).deltas:
            entry = self.requests.get(delta.request_id)
            if delta.finish_reason is None or entry is None or entry.pd_request is None or entry.worker is not worker:
                continue
            worker.requests.discard(entry.request_id)
            entry.worker = None
            if entry.leg == "encode" and not entry.orphaned and delta.finish_reason != "abort":
                self._after_encode(entry, delta.ec_transfer_params)
                continue
            transfer = disagg.transfer_params(delta.kv_transfer_params)
            if entry.orphaned:
                self._finish(entry)
            elif transfer is None:  # aborted, or the worker could not keep the blocks
                self._finish(entry)
                if delta.finish_reason == "abort":
                    self._to_client(entry.client, framing.message(MsgType.OUTPUTS, Outputs([
                        CompletionDelta(request_id=entry.request_id, index=i, finish_reason="abort",
                                        weight_versions=[]) for i in range(entry.n)])))
                else:
                    self._error(entry, entry.request_id, 500, "prefill leg returned no KV transfer parameters",
                                _E_INTERNAL)
            else:
                entry.body = framing.encode(disagg.decode_leg(entry.pd_request, transfer))
                entry.pd_request, entry.leg = None, None
                entry.roles = disagg.DECODE_ROLES
                self._assign(entry)

    def _assign(self, entry: Entry) -> None:
        """Send ``entry`` to a worker, queue it, or fail it."""
        if self.control.paused:  # waits for /resume (bounded by max_pending)
            self._enqueue(entry)
            return
        while True:
            live = self.workers.dispatchable()
            if entry.roles:
                live = [w for w in live if w.role in entry.roles]
            elif entry.rank is None:  # encoder-only workers produce no tokens: only pinned requests go there
                live = [w for w in live if w.role != disagg.ENCODE_ROLE]
            if not live and entry.leg == "encode":  # no encoder worker (any more): it encodes its own pixels
                self._after_encode(entry, None)
                return
            if not live:
                self._enqueue(entry)
                return
            if entry.rank is not None:
                worker = self.workers.by_rank(entry.rank)
                if worker is not None and worker.stale:
                    self._finish(entry)
                    self._error(entry, entry.request_id, 503,
                                f"data_parallel_rank {entry.rank} holds weights {worker.weight_version!r}, not the "
                                f"pool's {self.control.pool_version!r}: held out until it is updated", _E_OVERLOADED)
                    return
                if worker is None or worker.draining:
                    self._finish(entry)
                    ranks = sorted(w.rank for w in live)
                    self._error(entry, entry.request_id, 400,
                                f"data_parallel_rank {entry.rank} is out of range (live ranks: {ranks})",
                                "BadRequestError", "data_parallel_rank")
                    return
            elif entry.session_id is not None and (sticky := self._session_worker(entry, live)) is not None:
                worker = sticky
            else:
                candidates = [w for w in live if self.workers.has_capacity(w)]
                if entry.lora_name is not None and any(entry.lora_name in w.lora_adapters for w in live) \
                        and not any(entry.lora_name in w.lora_adapters for w in candidates):
                    self._enqueue(entry)  # its adapter's workers are full: wait for one of them
                    return
                worker = self.policy.pick(candidates, entry.lora_name, entry.prefix_hashes)
                if worker is None:
                    self._enqueue(entry)
                    return
            if self._send_generate(worker, entry):
                return
            # The worker vanished under us (EHOSTUNREACH): it is unregistered now, try again.

    def _session_worker(self, entry: Entry, live: list[Worker]) -> Optional[Worker]:
        """The session's worker; cache-aware routing leaves it (None) while that worker is full."""
        worker = sticky_worker(entry.session_id, live)
        if self.cfg.routing == "cache-aware" and worker is not None and (
                worker.saturated() or not self.workers.has_capacity(worker)):
            return None
        return worker

    def _send_generate(self, worker: Worker, entry: Entry) -> bool:
        reply_to = disagg.PD_CLIENT if entry.pd_request is not None else entry.client
        if not self._to_worker(worker, framing.message(MsgType.GENERATE, entry.body, reply_to)):
            return False
        if entry.prefix_hashes and entry.leg != "encode":  # an encode leg caches no KV there
            worker.prefix_index.expect(entry.prefix_hashes)
        entry.worker = worker
        worker.sent += 1
        worker.requests.add(entry.request_id)
        self.stats.dispatched += 1
        return True

    def _enqueue(self, entry: Entry) -> None:
        now = time.monotonic()
        if not self.control.paused and not self.workers.dispatchable() and \
                self.workers.no_worker_for(now) > self.cfg.no_worker_timeout:
            self._finish(entry)
            self._error(entry, entry.request_id, 503, "no worker available", _E_OVERLOADED)
            self.stats.rejected_overloaded += 1
            return
        if self.pending_count >= self.cfg.max_pending:
            self._finish(entry)
            self._error(entry, entry.request_id, 503,
                        f"server overloaded: {self.pending_count} requests already queued", _E_OVERLOADED)
            self.stats.rejected_overloaded += 1
            return
        entry.worker = None
        entry.queued = True
        self.pending.append(entry)
        self.pending_count += 1

    def _dispatch_pending(self) -> None:
        if self.control.paused:
            return
        while self.pending:
            entry = self.pending[0]
            if entry.done:
                self.pending.popleft()
                continue
            live = self.workers.dispatchable()
            if not live:
                return
            if entry.rank is None and entry.session_id is None and not any(
                    self.workers.has_capacity(w) for w in live):
                return
            self.pending.popleft()
            self.pending_count -= 1
            entry.queued = False
            self._assign(entry)
            if entry.worker is None and not entry.done:  # re-queued: still no capacity
                return

    def _on_abort(self, client: bytes, request_ids: list[str]) -> None:
        entries = [self.requests.get(rid) for rid in request_ids]
        # Unknown, finished or another client's: aborting is idempotent.
        self._abort_entries([e for e in entries if e is not None and e.client == client])

    def abort_everywhere(self, request_ids: Optional[list[str]]) -> int:
        """The RL route's abort: the given requests, or every request, of every client."""
        if request_ids is None:
            entries = [e for e in self.requests.values() if not e.orphaned]
        else:
            entries = [e for e in map(self.requests.get, request_ids) if e is not None and not e.orphaned]
        self._abort_entries(entries)
        return len(entries)

    def _abort_entries(self, entries: list[Entry]) -> None:
        per_worker: dict[Worker, list[str]] = {}
        for entry in entries:
            rid = entry.request_id
            if entry.worker is None:  # still queued here: answer for the worker
                self._finish(entry)
                deltas = [CompletionDelta(request_id=rid, index=i, finish_reason="abort", weight_versions=[])
                          for i in range(entry.n)]
                self._to_client(entry.client, framing.message(MsgType.OUTPUTS, Outputs(deltas)))
            else:
                per_worker.setdefault(entry.worker, []).append(rid)
        for worker, rids in per_worker.items():
            self._to_worker(worker, framing.message(MsgType.ABORT, Abort(rids)))

    def _client_gone(self, client: bytes) -> None:
        per_worker: dict[Worker, list[str]] = {}
        for rid in list(self.by_client.get(client, ())):
            entry = self.requests[rid]
            if entry.worker is None:
                self._finish(entry)
            elif not entry.orphaned:
                entry.orphaned = True
                per_worker.setdefault(entry.worker, []).append(rid)
        for worker, rids in per_worker.items():
            self._to_worker(worker, framing.message(MsgType.ABORT, Abort(rids)))

    def _finish(self, entry: Entry) -> None:
        if entry.done:
            return
        entry.done = True
        self.requests.pop(entry.request_id, None)
        rids = self.by_client.get(entry.client)
        if rids is not None:
            rids.discard(entry.request_id)
            if not rids:
                del self.by_client[entry.client]
        if entry.worker is not None:
            entry.worker.requests.discard(entry.request_id)
        if entry.queued:
            entry.queued = False
            self.pending_count -= 1

    # ------------------------------------------------------------- backend
    def _on_backend(self, frames: list) -> None:
        identity = frames[0]
        msg_type, rest = framing.split(frames[1:])
        worker = self.workers.get(identity)
        if msg_type == MsgType.OUTPUTS:
            if worker is None:
                self._reject_unknown(identity)
                return
            worker.last_seen = time.monotonic()
            self._on_outputs(worker, rest)
        elif msg_type == MsgType.HEARTBEAT:
            if worker is None:
                self._reject_unknown(identity)
                return
            framing.expect_count(rest, 1, "HEARTBEAT")
            worker.last_seen = time.monotonic()
            if rest[0]:
                worker.load = framing.decode(rest[0], WorkerLoad)
                if self.pending:
                    self._dispatch_pending()
        elif msg_type == MsgType.READY:
            framing.expect_count(rest, 1, "READY")
            self._on_ready(identity, worker, framing.decode(rest[0], WorkerReady))
        elif msg_type == MsgType.ERROR:
            framing.expect_count(rest, 2, "ERROR")
            if worker is None:
                self._reject_unknown(identity)
                return
            worker.last_seen = time.monotonic()
            err = framing.decode(rest[0], ErrorMsg)
            entry = self.requests.get(err.request_id)
            if entry is not None and entry.worker is worker and entry.leg == "encode" and not entry.orphaned:
                # The request has its pixels: it runs without the encode leg (an error of its
                # own comes back from that run).
                self._after_encode(entry, None)
                if self.pending:
                    self._dispatch_pending()
            elif entry is not None and entry.worker is worker and entry.leg == "prefill" and err.status == 503 \
                    and not entry.orphaned:
                # The prefill worker holds all the KV blocks it may for remote decode
                # (--kv-transfer-max-held): the request runs whole instead of failing.
                self._run_whole(entry)
                if self.pending:
                    self._dispatch_pending()
            elif entry is not None and entry.worker is worker:
                self._finish(entry)
                if not entry.orphaned:
                    self._to_client(entry.client, framing.message(MsgType.ERROR, rest[0]))
                if self.pending:
                    self._dispatch_pending()
            else:  # another worker's request (or one no longer in flight): never reaches its client
                self._drop_foreign(worker, "an error", err.request_id)
        elif msg_type == MsgType.KV_EVENTS:
            if worker is None:
                return  # its snapshot follows its next READY
            framing.expect_count(rest, 1, "KV_EVENTS")
            worker.prefix_index.apply(framing.decode(rest[0], KvEvents))
        elif msg_type == MsgType.CONTROL:
            if worker is None:
                self._reject_unknown(identity)
                return
            framing.expect_count(rest, 1, "CONTROL")
            worker.last_seen = time.monotonic()
            self.control.on_worker_reply(worker, framing.decode(rest[0], RankReply))
        elif msg_type == MsgType.DISCONNECT:
            if worker is None:
                return
            bye = framing.decode(rest[0], Disconnect) if rest and rest[0] else Disconnect()
            if bye.drain:
                log.info("worker rank %d draining", worker.rank)
                worker.draining = True
                worker.last_seen = self.workers.last_alive = time.monotonic()
            else:
                self._worker_gone(worker, "disconnected", notify=False)
        else:
            raise FrameError(f"message type {msg_type!r} not accepted from workers")

    def _on_outputs(self, worker: Worker, rest: list) -> None:
        if len(rest) % 2 != 1:
            raise FrameError(f"OUTPUTS: expected header + identity/body pairs, got {len(rest)} frames")
        header = framing.decode(rest[0], OutputsHeader)
        requests = self.requests
        for rid in header.started:
            entry = requests.get(rid)
            # A prefill leg can still be retried; another worker's request is not this one's to mark.
            if entry is not None and entry.pd_request is None and entry.worker is worker:
                entry.started = True
        msg_type = MsgType.OUTPUTS
        magic = framing.MAGIC
        send, frontend = framing.send_frames, self.frontend
        pd_client = disagg.PD_CLIENT
        for i in range(1, len(rest), 2):
            client = rest[i]
            # Every delta of the body must be of a request dispatched to this worker, for
            # the client it names: else a worker could answer other workers' users.  Set
            # comparisons (C loops): ``worker.requests`` holds exactly the ids whose entry's
            # worker it is, ``by_client`` each client's ids.
            try:
                rids = set(map(_request_id, _outputs_ids.decode(rest[i + 1]).deltas))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._bad_frame.warning("dropped a malformed OUTPUTS body from worker rank %d: %s", worker.rank, exc)
                continue
            if client == pd_client:  # legs answer the broker itself: each must still be a leg
                foreign = next((rid for rid in rids if rid not in worker.requests or
                                getattr(requests.get(rid), "pd_request", None) is None), None)
            elif rids <= worker.requests and rids <= self.by_client.get(client, _NONE):
                foreign = None
            else:  # one of them, for the log
                foreign = min(rids - (worker.requests & self.by_client.get(client, _NONE)))
            if foreign is not None:
                self._drop_foreign(worker, "outputs", foreign)
                continue
            if client == pd_client:
                self._on_leg_outputs(worker, rest[i + 1])
                continue
            try:
                send(frontend, (client, magic, msg_type, rest[i + 1]))
            except zmq.ZMQError as exc:
                if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                    raise
                self._unreachable.warning("client %s unreachable (%s): aborting its requests", client.hex(), exc)
                self._client_gone(client)
        for rid in header.finished:
            entry = requests.get(rid)
            if entry is not None and entry.worker is worker:
                self._finish(entry)
        if header.load is not None:
            worker.load = header.load
        if self.pending and header.finished:
            self._dispatch_pending()

    def _drop_foreign(self, worker: Worker, what: str, request_id: str) -> None:
        self.stats.outputs_foreign_dropped += 1
        self._foreign.warning("dropped %s from worker rank %d (pid %d) for request %r, which is not dispatched to "
                              "it", what, worker.rank, worker.pid, request_id)

    def _on_ready(self, identity: bytes, worker: Optional[Worker], ready: WorkerReady) -> None:
        if not runtime_dir.token_matches(self.cfg.worker_token, ready.worker_token):
            # Not one of ours: it must never receive a prompt.  Checked first, so that a
            # forged READY from a registered worker's identity changes nothing either.
            self.stats.workers_refused += 1
            self._refused.warning("refused a worker registration (rank %d, pid %d): %s worker token; workers read "
                                  "it from the runtime directory or --worker-token-file", ready.rank, ready.pid,
                                  "wrong" if ready.worker_token else "no")
            if worker is None:
                self._reject_unknown(identity)
            return
        if worker is not None:  # re-registration: it dropped whatever it was running
            self._worker_gone(worker, "re-registered", notify=False)
        holder = self.workers.by_rank(ready.rank)
        if holder is not None:
            # Another live process claims this rank (e.g. a restarted worker while the old one is
            # not yet expired).  Ignore it: it re-sends READY after a liveness period without our
            # heartbeats, by which time a dead holder has expired.
            log.error("worker pid %d claims rank %d already held by pid %d; ignored", ready.pid, ready.rank,
                      holder.pid)
            return
        worker = Worker(identity=identity, rank=ready.rank, model=ready.model, load=ready.load, pid=ready.pid,
                        weight_version=ready.weight_version, world_size=ready.world_size,
                        # A worker caches at most its KV blocks; the slack absorbs event lag.
                        prefix_index=PrefixIndex(capacity=max(4096, 2 * ready.load.total_kv_blocks)),
                        role=ready.role)
        worker.transfer_peer = parse_address(ready.transfer_address)
        self.workers.add(worker)
        self.control.on_worker_ready(worker)
        log.info("worker rank %d registered (pid %d, model %s, max_num_seqs %d)", ready.rank, ready.pid,
                 ready.model.name, ready.model.max_num_seqs)
        self._to_worker(worker, framing.message(MsgType.HEARTBEAT))
        self._dispatch_pending()

    def _reject_unknown(self, identity: bytes) -> None:
        """A worker we do not know (e.g. after a broker restart): ask it to re-register.

        At most once per heartbeat interval per identity: a worker's backlog of messages
        must not turn into a burst of re-registrations."""
        now = time.monotonic()
        if now - self._rejected.get(identity, -1e9) < self.cfg.heartbeat_interval:
            return
        if len(self._rejected) > 1024:
            self._rejected = {k: t for k, t in self._rejected.items() if now - t < self.cfg.heartbeat_interval}
        self._rejected[identity] = now
        try:
            framing.send_frames(self.backend, [identity, *framing.message(MsgType.DISCONNECT)])
        except zmq.ZMQError:
            pass

    def _worker_gone(self, worker: Worker, reason: str, notify: bool = True) -> None:
        self.workers.remove(worker)
        self.control.on_worker_gone(worker)
        retried = failed = 0
        for rid in list(worker.requests):
            entry = self.requests[rid]
            if entry.orphaned:
                self._finish(entry)
            elif entry.started or entry.rank is not None:
                # Deltas already reached the client (or it asked for this rank): cannot retry.
                self._finish(entry)
                self._error(entry, rid, 500, f"worker (rank {worker.rank}) died: {reason}", _E_INTERNAL)
                failed += 1
            else:
                worker.requests.discard(rid)
                entry.worker = None
                if entry.leg == "encode":  # the request has its pixels: it runs without the leg
                    self._after_encode(entry, None)
                else:
                    self._assign(entry)
                retried += 1
        self.stats.workers_removed += 1
        self.stats.failed_worker_death += failed
        self.stats.redispatched += retried
        log.warning("worker rank %d (pid %d) removed: %s; %d request(s) failed, %d re-dispatched", worker.rank,
                    worker.pid, reason, failed, retried)
        if notify:  # if it is in fact alive, make it drop its requests and re-register
            self._reject_unknown(worker.identity)

    def _heartbeat_workers(self) -> None:
        beat = framing.message(MsgType.HEARTBEAT)
        for worker in self.workers.all():
            self._to_worker(worker, beat)
            worker.prefix_index.expire()

    def _expire(self, now: float) -> None:
        for worker in self.workers.expired(now):
            self._worker_gone(worker, f"no heartbeat for {now - worker.last_seen:.1f}s")
        if self.pending and not self.control.paused and not self.workers.dispatchable() and \
                self.workers.no_worker_for(now) > self.cfg.no_worker_timeout:
            while self.pending:
                entry = self.pending.popleft()
                if not entry.done:
                    self._finish(entry)
                    self._error(entry, entry.request_id, 503, "no worker available", _E_OVERLOADED)
