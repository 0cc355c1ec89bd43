"""The worker process around the engine: broker link in an IO thread, engine loop
in the main thread.

Threads and sockets:
  * IO thread (``BrokerLink``) owns the DEALER to the broker.  It answers nothing
    itself but keeps heartbeats flowing even while the engine is inside a long
    step, notices a silent broker (then rebuilds its socket and asks the engine
    loop to re-register), and relays messages to/from the engine loop over an
    inproc PAIR pipe.
  * Main thread (``WorkerServer``) owns the engine: drain everything that arrived,
    step once, ship one OUTPUTS frame set per step (deltas grouped per client;
    layout in common/framing.py), then at most one KV_EVENTS message with the
    prefix-cache changes of that step.  Idle: blocks on the pipe, no spinning.

KV events: the broker's picture of this worker's prefix cache starts exact and stays
so, since every message travels one ordered pipe -> DEALER path: READY is followed
at once by a snapshot (``cleared`` + every cached key), at registration and at every
re-registration; afterwards each loop iteration sends the changes it made (after its
OUTPUTS), and a control command's cache changes go out before its reply.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Optional

import zmq

from common import config, framing, link_heartbeats, runtime_dir, security
from common.readiness import ReadyFile
from common.errors import ServingError
from common.framing import FrameError
from common.logging import RateLimitedLog, get_logger
from common.malloc_tuning import PeriodicTrim
from common.protocol import (MAGIC, Abort, CompletionDelta, ControlRequest, Disconnect, ErrorMsg, GenerateRequest,
                             KvEvents, MsgType, Outputs, OutputsHeader, WorkerLoad, WorkerReady)
from worker.control import WorkerControl
from worker.engine.api import EngineAPI

log = get_logger("tokserve.worker")

_CTL = b"CTL"  # first frame of pipe-only control messages (never leaves the process)
_RESET = b"reset"  # IO -> engine loop: broker lost or forgot us; drop requests, re-register
_STOP = b"stop"  # engine loop -> IO: flush and exit


def _send(sock: zmq.Socket, frames: list) -> None:
    """Fast non-blocking send; if the socket cannot take it now, wait (never drop)."""
    try:
        framing.send_frames(sock, frames)
    except zmq.Again:
        sock.send_multipart(frames)


class BrokerLink(threading.Thread):
    def __init__(self, ctx: zmq.Context, broker: str, pipe_addr: str, interval: float, liveness: int,
                 curve_server_key: Optional[bytes] = None, curve_client_keys: Optional[security.CurveKeys] = None,
                 ready_file: Optional[ReadyFile] = None, unresponsive_timeout: float = config.UNRESPONSIVE_TIMEOUT_S):
        super().__init__(name="broker-link", daemon=True)
        self.ctx, self.broker, self.pipe_addr = ctx, broker, pipe_addr
        self.interval, self.liveness = interval, liveness
        # A dead link is libzmq's to notice (it reconnects; the broker then asks us to
        # register again); this bound is for a broker whose link is up but which says nothing.
        self.expiry = max(unresponsive_timeout, interval * liveness)
        self.curve_server_key = curve_server_key
        self.curve_client_keys = curve_client_keys
        self.load = WorkerLoad()  # latest snapshot, replaced (never mutated) by the engine loop
        self.registered = False  # READY sent: heartbeats may flow
        self.welcomed = False  # the broker answered our last READY (it heartbeats a worker it registers)
        self.ready_file = ready_file  # --ready-file: fresh while the broker heartbeats us (common/readiness.py)
        self._refused = RateLimitedLog(log, 30.0)
        self._bad = RateLimitedLog(log)

    def _connect(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 2000)  # let a final DISCONNECT/OUTPUTS leave on exit
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        link_heartbeats.enable(sock, self.interval, self.liveness)
        if self.curve_server_key:
            security.configure_client(sock, self.curve_server_key, self.curve_client_keys)
        sock.connect(self.broker)
        return sock

    def run(self) -> None:
        pipe = self.ctx.socket(zmq.PAIR)
        pipe.setsockopt(zmq.SNDHWM, 0)
        pipe.setsockopt(zmq.RCVHWM, 0)
        pipe.connect(self.pipe_addr)
        dealer = self._connect()
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(pipe, zmq.POLLIN)
        last_heard = time.monotonic()
        next_beat = last_heard
        beat_head = [MAGIC, MsgType.HEARTBEAT]
        try:
            while True:
                now = time.monotonic()
                if now >= next_beat:
                    if self.registered:
                        dealer.send_multipart([*beat_head, framing.encode(self.load)])
                    next_beat = now + self.interval
                if now - last_heard > self.expiry:
                    # Paranoid Pirate: the broker is gone (or restarted).  A fresh socket drops
                    # whatever was queued for the old one; the engine loop then re-registers.
                    log.warning("no message from broker for %.1fs: reconnecting", now - last_heard)
                    poller.unregister(dealer)
                    dealer.close(0)
                    dealer = self._connect()
                    poller.register(dealer, zmq.POLLIN)
                    self.registered = False
                    self._not_ready()
                    pipe.send_multipart([_CTL, _RESET])
                    last_heard = now
                timeout = max(1, int(min(next_beat - now, self.expiry - (now - last_heard)) * 1000))
                for sock, _ in poller.poll(timeout):
                    if sock is dealer:
                        while True:
                            try:
                                frames = framing.recv_frames_zero_copy_payload(dealer)
                            except zmq.Again:
                                break
                            last_heard = time.monotonic()
                            self._from_broker(frames, pipe)
                    else:
                        while True:
                            try:
                                frames = framing.recv_frames(pipe)
                            except zmq.Again:
                                break
                            if frames[0] == _CTL:
                                if frames[1] == _STOP:
                                    self._not_ready()
                                    return
                                continue
                            if frames[1] == MsgType.READY:
                                self.registered = True
                                self.welcomed = False
                            elif not self.registered and frames[1] != MsgType.DISCONNECT:
                                # Sent by the engine loop before it saw the reset: outputs and
                                # errors of requests the broker already failed, control replies,
                                # KV changes the snapshot after READY supersedes.  Ahead of our
                                # READY the broker would take them for an unknown peer's and
                                # answer DISCONNECT: a needless second registration, and a
                                # warning that blames the worker token.
                                continue
                            _send(dealer, frames)
        finally:
            dealer.close()
            pipe.close(0)

    def _not_ready(self) -> None:
        if self.ready_file is not None:
            try:
                self.ready_file.clear()
            except OSError as exc:
                self._bad.warning("cannot remove the ready file %s: %s", self.ready_file.path, exc)

    def _from_broker(self, frames: list, pipe: zmq.Socket) -> None:
        try:
            msg_type, _ = framing.split(frames)
        except FrameError as exc:
            self._bad.warning("dropped malformed message from broker: %s", exc)
            return
        if msg_type in (MsgType.GENERATE, MsgType.ABORT, MsgType.CONTROL):
            _send(pipe, frames)
        elif msg_type == MsgType.DISCONNECT:  # the broker does not know us (restart, or declared us dead)
            if self.registered and not self.welcomed:
                # Sent straight back for our READY: a broker that refuses to register us, whose
                # log says why; the usual reason is a worker token that is not the broker's.
                self._refused.warning("the broker refused our registration: is our worker token the broker's? "
                                      "(--worker-token-file, TOKSERVE_WORKER_TOKEN_FILE, or the same runtime "
                                      "directory)")
            self.registered = False
            self._not_ready()
            pipe.send_multipart([_CTL, _RESET])
        elif msg_type == MsgType.HEARTBEAT:
            self.welcomed = True
            if self.ready_file is not None:
                try:
                    self.ready_file.mark()
                except OSError as exc:  # never let the probe's file stop the heartbeats
                    self._bad.warning("cannot update the ready file %s: %s", self.ready_file.path, exc)
        else:
            self._bad.warning("unexpected message type %r from broker", msg_type)


@dataclass
class _Track:
    client: bytes
    remaining: int  # choices not finished yet
    started: bool = False


class WorkerServer:
    """Runs ``engine`` (worker/engine/api.py: EngineAPI) for the broker at ``broker``."""

    def __init__(self, engine: EngineAPI, broker: str, rank: int = 0, *, interval: float = config.HEARTBEAT_INTERVAL_S,
                 liveness: int = config.HEARTBEAT_LIVENESS, drain_timeout: float = 30.0,
                 curve_server_key: Optional[bytes] = None, curve_client_keys: Optional[security.CurveKeys] = None,
                 ctx: Optional[zmq.Context] = None, role: str = "both", worker_token: str = "",
                 ready_file: Optional[str] = None, unresponsive_timeout: float = config.UNRESPONSIVE_TIMEOUT_S,
                 malloc_trim_interval: float = 0.0):
        runtime_dir.check_before_connect(broker)  # never serve a socket someone else planted
        self.engine = engine
        self.worker_token = worker_token  # proves to the broker that we are one of its workers
        self.rank = rank
        self.role = role  # P/D disaggregation: what the broker sends here (prefill | decode | both)
        self.drain_timeout = drain_timeout
        self.ctx = ctx or zmq.Context.instance()
        pipe_addr = f"inproc://worker-link-{id(self)}"
        self.pipe = self.ctx.socket(zmq.PAIR)
        self.pipe.setsockopt(zmq.LINGER, 0)
        self.pipe.setsockopt(zmq.SNDHWM, 0)  # unbounded: the engine loop never blocks on the IO thread
        self.pipe.setsockopt(zmq.RCVHWM, 0)
        self.pipe.bind(pipe_addr)
        self.ready_file = ReadyFile(ready_file, rank=rank, broker=broker) if ready_file else None
        if self.ready_file is not None:
            self.ready_file.clear()  # a previous process's file (a restarted container) says nothing about us
        self.link = BrokerLink(self.ctx, broker, pipe_addr, interval, liveness, curve_server_key, curve_client_keys,
                               self.ready_file, unresponsive_timeout)
        self.tracks: dict[str, _Track] = {}
        self.received = 0
        self._drain_requested = False
        self._drain_deadline: Optional[float] = None
        self._bad = RateLimitedLog(log)
        self._gen_decoder = framing._decoders[GenerateRequest]
        self.control = WorkerControl(self)
        # bounds the freed memory a CPU worker keeps (common/malloc_tuning.py: PeriodicTrim)
        self.trim = PeriodicTrim(malloc_trim_interval)

    # ---------------------------------------------------------------- control
    def request_drain(self, *_args) -> None:
        """SIGTERM handler: finish running requests, then leave."""
        self._drain_requested = True

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.request_drain)
        signal.signal(signal.SIGINT, self.request_drain)

    def _send(self, frames: list) -> None:
        _send(self.pipe, frames)

    def _ready(self) -> None:
        self._refresh_load()
        ready = WorkerReady(rank=self.rank, model=self.engine.model_info, load=self.link.load, pid=os.getpid(),
                            weight_version=self.engine.rl.weight_version,
                            world_size=self.engine.config.tensor_parallel_size, role=self.role,
                            worker_token=self.worker_token, transfer_address=self._transfer_address())
        self._send(framing.message(MsgType.READY, ready))
        # the broker's view of our cache starts exact (cleared + all keys)
        self._send_kv_events(self.engine.snapshot_kv_events())

    def _transfer_address(self) -> Optional[str]:
        return self.engine.transfer_address()

    def _send_kv_events(self, events: Optional[KvEvents]) -> None:
        if events is not None:
            self._send(framing.message(MsgType.KV_EVENTS, events))

    def _ship_kv_events(self) -> None:
        """The prefix-cache changes since the last report, if any (one message)."""
        self._send_kv_events(self.engine.drain_kv_events())

    def _refresh_load(self) -> WorkerLoad:
        load = self.engine.load()
        load.num_received = self.received
        self.link.load = load
        return load

    # ------------------------------------------------------------------- loop
    def run(self) -> int:
        self.link.start()
        self._ready()
        log.info("worker rank %d serving %s", self.rank, self.engine.model_info.name)
        try:
            while True:
                if self._drain_requested and self._drain_deadline is None:
                    log.info("draining: finishing %d request(s) within %.0fs", len(self.tracks), self.drain_timeout)
                    self._drain_deadline = time.monotonic() + self.drain_timeout
                    if self.ready_file is not None:
                        self.ready_file.retire()  # no new requests come: out of the Service's endpoints
                    self._send(framing.message(MsgType.DISCONNECT, Disconnect(drain=True)))
                if self._drain_deadline is not None:
                    if not self.tracks and not self.engine.has_unfinished():
                        break
                    if time.monotonic() > self._drain_deadline:
                        log.warning("drain timeout: aborting %d request(s)", len(self.tracks))
                        self._ship(self._abort_ids(list(self.tracks)))
                        break
                busy = self.engine.has_unfinished() and not self.control.frozen
                if not busy and not self.pipe.poll(100):  # idle: block (wakes to notice signals)
                    self._kv_transfer_tick()  # held KV blocks freed by their decode side or expired
                    self._refresh_load()  # e.g. after a failed step shipped nothing
                    self._send_deferred_replies()
                    self.trim.tick()
                    continue
                deltas = self._drain_pipe()
                if self.engine.has_unfinished() and not self.control.frozen:
                    deltas.extend(self._step())
                if deltas:
                    self._ship(deltas)
                self._ship_kv_events()  # after the step's OUTPUTS: at most one message per step
                self._send_deferred_replies()
                self.trim.tick()  # between steps: the step's buffers are freed
        finally:
            if self.ready_file is not None:
                self.ready_file.retire()
            self._send(framing.message(MsgType.DISCONNECT, Disconnect(drain=False)))
            self._send([_CTL, _STOP])
            self.link.join(timeout=5)
            self.pipe.close(0)
            self.engine.close()  # tensor-parallel followers stop with their worker
        log.info("worker rank %d stopped", self.rank)
        return 0

    def _drain_pipe(self) -> list[CompletionDelta]:
        """Handle every message that arrived; returns abort deltas to ship."""
        out: list[CompletionDelta] = []
        while True:
            try:
                frames = framing.recv_frames_zero_copy_payload(self.pipe)
            except zmq.Again:
                return out
            try:
                if frames[0] == _CTL:
                    if frames[1] == _RESET:
                        self._reset()
                    continue
                msg_type = frames[1]
                if msg_type == MsgType.GENERATE:
                    framing.expect_count(frames[2:], 2, "GENERATE")
                    self._on_generate(frames[2], frames[3])
                elif msg_type == MsgType.ABORT:
                    out.extend(self._abort_ids(framing.decode(frames[2], Abort).request_ids))
                elif msg_type == MsgType.CONTROL:
                    if out:  # deltas before the command stay ahead of what it ships
                        self._ship(out)
                        out = []
                    self._on_control(framing.decode(frames[2], ControlRequest), frames[3:])
            except FrameError as exc:
                self._bad.warning("dropped malformed message: %s", exc)

    def _on_generate(self, body: bytes, client: bytes) -> None:
        self.received += 1
        try:
            req = self._gen_decoder.decode(body)
        except Exception as exc:
            self._bad.warning("undecodable GENERATE body: %s", exc)
            return
        rid = req.request_id
        if rid in self.tracks:
            self._error(client, rid, 400, f"request_id {rid!r} is already running on this worker",
                        "BadRequestError")
            return
        try:
            self.engine.add_request(req)
        except ServingError as exc:
            self._error(client, rid, exc.status, exc.message, exc.type, exc.param)
            return
        except Exception as exc:
            log.exception("add_request failed for %s", rid)
            self._error(client, rid, 500, f"engine failed to add the request: {exc}", "InternalServerError")
            return
        self.tracks[rid] = _Track(client, max(1, req.params.n))

    def _on_control(self, req: ControlRequest, payload: list) -> None:
        reply = self.control.handle(req, payload)
        self._refresh_load()  # sleep/wake change the KV blocks the broker sees
        self._ship_kv_events()  # e.g. reset_prefix_cache: the broker hears it before the reply
        if reply is not None:
            self._send(framing.message(MsgType.CONTROL, reply))

    def _send_deferred_replies(self) -> None:
        replies = self.control.poll_deferred()
        if replies:
            self._ship_kv_events()  # what the deferred commands changed goes first
        for reply in replies:
            self._send(framing.message(MsgType.CONTROL, reply))

    def abort_all(self) -> None:
        """pause(mode=abort): every request of this worker ends now, its clients told."""
        deltas = self._abort_ids(list(self.tracks))
        if deltas:
            self._ship(deltas)

    def _abort_ids(self, request_ids: list[str]) -> list[CompletionDelta]:
        out = []
        for rid in request_ids:
            if rid not in self.tracks:
                continue
            try:
                out.extend(self.engine.abort(rid))
            except Exception:
                log.exception("engine.abort(%s) failed", rid)
            track = self.tracks.get(rid)
            if track is not None and not any(d.request_id == rid and d.finish_reason for d in out):
                # The engine produced no terminal delta: still tell the client it ended.
                out.extend(CompletionDelta(request_id=rid, index=i, finish_reason="abort")
                           for i in range(track.remaining))
        return out

    def _reset(self) -> None:
        """The broker forgot us: its clients were told; drop everything and re-register."""
        if self.tracks:
            log.warning("broker lost or re-registration requested: dropping %d request(s)", len(self.tracks))
        for rid in list(self.tracks):
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("engine.abort(%s) failed", rid)
        self.tracks.clear()
        self._ready()

    def _kv_transfer_tick(self) -> None:
        try:
            self.engine.tick()
        except Exception:
            log.exception("KV transfer housekeeping failed")
        self._ship_request_errors()

    def _ship_request_errors(self) -> None:
        """Requests the engine failed outside its outputs (a KV or encoder-output pull failed)."""
        for rid, status, message, param in self.engine.take_request_errors():
            track = self.tracks.get(rid)
            if track is not None:
                self._error(track.client, rid, status, message,
                            "BadRequestError" if status < 500 else "ServiceUnavailableError", param)

    def _step(self) -> list[CompletionDelta]:
        try:
            deltas = self.engine.step()
            self._ship_request_errors()
            return deltas
        except Exception as exc:
            log.exception("engine step failed; failing %d request(s)", len(self.tracks))
            for rid, track in list(self.tracks.items()):
                self._error(track.client, rid, 500, f"engine failure: {exc}", "InternalServerError")
                try:
                    self.engine.abort(rid)
                except Exception:
                    log.exception("engine.abort(%s) failed after a step failure", rid)
            self.tracks.clear()
            return []

    def _error(self, client: bytes, rid: str, status: int, message: str, type_: str,
               param: Optional[str] = None) -> None:
        self.tracks.pop(rid, None)
        err = ErrorMsg(request_id=rid, status=status, message=message, type=type_, param=param)
        self._send(framing.message(MsgType.ERROR, err, client))

    def _ship(self, deltas: list[CompletionDelta]) -> None:
        """One OUTPUTS frame set: header + one Outputs body per client."""
        groups: dict[bytes, list[CompletionDelta]] = {}
        started, finished = [], []
        tracks = self.tracks
        for d in deltas:
            track = tracks.get(d.request_id)
            if track is None:
                continue  # dropped by a reset or an error
            if not track.started:
                track.started = True
                started.append(d.request_id)
            if d.finish_reason is not None:
                track.remaining -= 1
                if track.remaining <= 0:
                    finished.append(d.request_id)
                    del tracks[d.request_id]
            group = groups.get(track.client)
            if group is None:
                groups[track.client] = group = []
            group.append(d)
        if not groups:
            return
        header = OutputsHeader(started=started, finished=finished, load=self._refresh_load())
        frames = [MAGIC, MsgType.OUTPUTS, framing.encode(header)]
        for client, group in groups.items():
            frames.append(client)
            frames.append(framing.encode(Outputs(group)))
        self._send(frames)
