"""The broker: one thread, two ROUTER sockets, and the components that do the work.

Owns the sockets (setup, CURVE, binding), the event loop (polling, heartbeat timer,
expiry), and frame dispatch: each message type goes to the component for that job.

  broker/links.py       sending to clients and workers, and what a failed send means
  broker/requests.py    the request table: entries, pending queue, finishing, aborts, errors
  broker/admission.py   a client's GENERATE: checks (transfer peers), entry, legs, routing
  broker/router.py      choosing a worker (pins, sessions, roles, adapters, prefixes), the queue drain
  broker/legs.py        the P/D and E/P/D leg state machine (helpers: broker/disagg.py)
  broker/membership.py  READY (worker token), heartbeats, draining, expiry, a worker's departure
  broker/outputs.py     OUTPUTS (the hot path) and ERRORs from workers, the foreign-output check
  broker/control.py     CONTROL commands fanned out to the pool
  broker/kv_publisher.py  the cell's KV events for an outside router (vllm-router kv_aware), optional

Frame layouts are documented in common/framing.py.  The hot path (worker OUTPUTS ->
clients) decodes only the small OutputsHeader and the deltas' request ids, and
forwards delta bodies as-is.
"""
from __future__ import annotations

import time
import uuid
from typing import Optional

import zmq

from broker.admission import Admission
from broker.control import ControlPlane
from broker.dispatch import make_policy
from broker.kv_publisher import CellKvPublisher
from broker.legs import Legs
from broker.links import Links
from broker.membership import Membership
from broker.outputs import OutputsRelay
from broker.requests import E_OVERLOADED, RequestTable
from broker.router import Router
from broker.settings import BrokerConfig  # re-exported: broker.main, tests and embedders build it from here
from broker.workers import WorkerRegistry
from common import config, framing, link_heartbeats, runtime_dir, security
from common.framing import FrameError
from common.logging import RateLimitedLog, get_logger
from common.protocol import Abort, BrokerStats, ClusterInfo, KvEvents, MsgType, RankReply, WorkerReady

log = get_logger("tokserve.broker")


class Broker:
    def __init__(self, cfg: BrokerConfig, ctx: Optional[zmq.Context] = None):
        self.cfg = cfg
        self.ctx = ctx or zmq.Context.instance()
        for flag, endpoint in (("--frontend", cfg.frontend), ("--backend", cfg.backend)):
            security.refuse_plaintext_beyond_host(flag, endpoint, bool(cfg.curve_secret_key))
        authenticated = bool(cfg.curve_secret_key and cfg.curve_authorized_dir)
        security.refuse_unauthenticated_tcp_frontend(cfg.frontend, authenticated,
                                                     cfg.allow_unauthenticated_tcp_frontend)
        # ZAP must answer before the sockets bind, else early handshakes go unauthenticated.
        self._auth = (security.start_authenticator(self.ctx, cfg.curve_authorized_dir)
                      if cfg.curve_secret_key and cfg.curve_authorized_dir else None)
        # Client links too: a gateway that is stopped or cut off is unroutable after the link
        # liveness, and its requests are aborted (broker/links.py).
        self.frontend = self._router(cfg.frontend, cfg.max_client_frame_bytes, watch_links=True)
        # Worker links are watched by libzmq (no GIL needed on either side); a dropped one
        # is acted on at once: the next heartbeat round finds its worker unroutable.
        self.backend = self._router(cfg.backend, cfg.max_worker_frame_bytes, watch_links=True)
        self._backend_drops = link_heartbeats.disconnect_monitor(self.backend)
        link_expiry = cfg.heartbeat_interval * cfg.liveness
        self.workers = WorkerRegistry(max(cfg.unresponsive_timeout, link_expiry), cfg.max_inflight_per_worker,
                                      config.INFLIGHT_PER_SEQ_SLOT)
        self.stats = BrokerStats()
        self._bad_frame = RateLimitedLog(log)
        self._refused = RateLimitedLog(log)  # READY / CONTROL without the right token
        # The control plane reaches its collaborators through this broker when called, never while built.
        self.control = ControlPlane(self)
        # Built in dependency order; the two callbacks close the loops (a failed send
        # aborts a client's requests or unregisters a worker, both of which send).
        self.links = Links(self.frontend, self.backend, self.workers, RateLimitedLog(log))
        self.table = RequestTable(self.links)
        self.router = Router(cfg, self.workers, self.table, self.links, make_policy(cfg.routing), self.control,
                             self.stats)
        self.legs = Legs(cfg, self.workers, self.table, self.router)
        self.router.encode_fallback = self.legs.without_encoder
        self.admission = Admission(cfg, self.workers, self.table, self.legs, self.router)
        self.membership = Membership(cfg, self.workers, self.table, self.links, self.router, self.legs,
                                     self.control, self.stats, self._refused)
        self.outputs = OutputsRelay(self.table, self.links, self.router, self.legs, self.stats, self._bad_frame,
                                    RateLimitedLog(log))
        self.links.on_client_gone = self.table.client_gone
        self.links.on_worker_unreachable = self.membership.worker_gone
        self.kv_publisher = (CellKvPublisher(self.ctx, cfg.kv_events_endpoint, cfg.kv_events_allow_tcp,
                                             cfg.kv_events_allow_remote)
                             if cfg.kv_events_endpoint else None)
        if self.kv_publisher is not None:
            self.membership.on_worker_removed = self.kv_publisher.on_worker_gone
        self.instance_id = uuid.uuid4().hex  # a new cell to outside routers after each start
        self._stop = False

    def _router(self, endpoint: str, max_frame: int, watch_links: bool = False) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        if watch_links:  # before bind: the listener copies the options its connections get
            link_heartbeats.enable(sock, self.cfg.heartbeat_interval, self.cfg.liveness)
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
        poller.register(self._backend_drops, zmq.POLLIN)
        kv_pub = self.kv_publisher
        if kv_pub is not None:
            poller.register(kv_pub.sock, zmq.POLLIN)  # subscriptions: a late router gets the cell's blocks
        interval = self.cfg.heartbeat_interval
        next_beat = time.monotonic()
        log.info("broker frontend=%s backend=%s", self.cfg.frontend, self.cfg.backend)
        while not self._stop:
            now = time.monotonic()
            link_dropped = link_heartbeats.drain_disconnects(self._backend_drops)
            if now >= next_beat or link_dropped:  # a dropped link's worker is found unroutable now
                self.membership.heartbeat_workers()
                next_beat = now + interval
            self.membership.expire(now)
            timeout_ms = max(1, min(int((next_beat - now) * 1000), 100))
            if kv_pub is not None and kv_pub.replaying:
                timeout_ms = 0  # a batch of the re-announcement per turn, between the sockets' work
            events = dict(poller.poll(timeout_ms))
            if self.backend in events:
                self._drain(self.backend, self._on_backend)
            if self.frontend in events:
                self._drain(self.frontend, self._on_frontend)
            if kv_pub is not None:
                if kv_pub.sock in events:
                    kv_pub.on_subscriptions()
                if kv_pub.replaying:
                    kv_pub.pump()

    def close(self) -> None:
        """Tell clients their requests are gone (instead of leaving them to time out), then close."""
        for entry in list(self.table.requests.values()):
            if not entry.orphaned:
                self.table.error(entry, entry.request_id, 503, "broker shutting down", E_OVERLOADED)
        for worker in self.workers.all():  # they re-register with the next broker
            self.membership.reject_unknown(worker.identity)
        self.frontend.close(linger=500)
        self.backend.disable_monitor()
        self._backend_drops.close(0)
        self.backend.close(linger=500)
        if self.kv_publisher is not None:
            self.kv_publisher.close()
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

    # ------------------------------------------------------------ frontend
    def _on_frontend(self, frames: list) -> None:
        client = frames[0]
        msg_type, rest = framing.split(frames[1:])
        if msg_type == MsgType.GENERATE:
            framing.expect_count(rest, 1, "GENERATE")
            self.admission.on_generate(client, rest[0])
        elif msg_type == MsgType.ABORT:
            framing.expect_count(rest, 1, "ABORT")
            self.table.on_abort(client, framing.decode(rest[0], Abort).request_ids)
        elif msg_type == MsgType.HEARTBEAT:
            self.links.to_client(client, framing.message(MsgType.HEARTBEAT))
        elif msg_type == MsgType.INFO:
            framing.expect_count(rest, 1, "INFO")
            nonce = framing.nonce_from(rest[0])
            self.links.to_client(client, framing.message(MsgType.INFO, self.cluster_info(),
                                                         framing.nonce_bytes(nonce)))
        elif msg_type == MsgType.CONTROL:
            self.control.on_client(client, rest)
        else:
            raise FrameError(f"message type {msg_type!r} not accepted from clients")

    def cluster_info(self) -> ClusterInfo:
        live = sorted(self.workers.all(), key=lambda w: w.rank)
        self.stats.prefix_routed = getattr(self.router.policy, "prefix_routed", 0)
        return ClusterInfo(workers=[w.status() for w in live], model=self.workers.last_model,
                           pending=self.table.pending_count, stats=self.stats, paused=self.control.paused,
                           weight_version=self.control.pool_version, lora_adapters=self.control.lora_adapters,
                           kv_events_endpoint=self.kv_publisher.endpoint if self.kv_publisher else None,
                           instance_id=self.instance_id)

    # ------------------------------------------------------------- backend
    def _on_backend(self, frames: list) -> None:
        identity = frames[0]
        msg_type, rest = framing.split(frames[1:])
        worker = self.workers.get(identity)
        if msg_type == MsgType.OUTPUTS:
            if worker is None:
                self.membership.reject_unknown(identity)
                return
            worker.last_seen = time.monotonic()
            self.outputs.on_outputs(worker, rest)
        elif msg_type == MsgType.HEARTBEAT:
            if worker is None:
                self.membership.reject_unknown(identity)
                return
            self.membership.on_heartbeat(worker, rest)
        elif msg_type == MsgType.READY:
            framing.expect_count(rest, 1, "READY")
            self.membership.on_ready(identity, worker, framing.decode(rest[0], WorkerReady))
        elif msg_type == MsgType.ERROR:
            framing.expect_count(rest, 2, "ERROR")
            if worker is None:
                self.membership.reject_unknown(identity)
                return
            self.outputs.on_error(worker, rest)
        elif msg_type == MsgType.KV_EVENTS:
            if worker is None:
                return  # its snapshot follows its next READY
            framing.expect_count(rest, 1, "KV_EVENTS")
            events = framing.decode(rest[0], KvEvents)
            worker.prefix_index.apply(events)
            if self.kv_publisher is not None:
                self.kv_publisher.on_events(identity, events, worker.model.kv_block_size,
                                            worker.prefix_index.capacity)
        elif msg_type == MsgType.CONTROL:
            if worker is None:
                self.membership.reject_unknown(identity)
                return
            framing.expect_count(rest, 1, "CONTROL")
            worker.last_seen = time.monotonic()
            self.control.on_worker_reply(worker, framing.decode(rest[0], RankReply))
        elif msg_type == MsgType.DISCONNECT:
            if worker is None:
                return
            self.membership.on_disconnect(worker, rest)
        else:
            raise FrameError(f"message type {msg_type!r} not accepted from workers")
