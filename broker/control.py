"""The broker's control plane: CONTROL commands fanned out to the worker pool.

A client's ControlRequest goes to every live worker (or the one rank it names);
the client gets one ControlReply once every targeted worker answered or died.
The broker answers some commands itself from what it knows (is_paused, abort of
requests across all clients, weight_info, get_world_size) and keeps the pool's
state that outlives any one worker:

* paused: no request is dispatched while set; new ones wait in the pending queue
  (bounded by max_pending) instead of being refused;
* the pool's weight version, and how to rebuild it: the checkpoint folders of the
  disk updates since start (``lineage``), or None once weights came over the wire.
  A worker that registers with another version is held out of dispatch ("stale");
  the broker replays the lineage to it when it can, else reports it stale in
  weight_info until a trainer brings it to the current version;
* the LoRA adapters the pool serves (name -> path): a worker that registers
  without some of them (restarted after a runtime load) is sent the loads, and
  unloads of those the pool dropped since it started.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Optional

from common import framing, runtime_dir
from common.logging import get_logger
from common.protocol import ControlReply, ControlRequest, MsgType, RankReply

log = get_logger("tokserve.broker")

UNAUTHORIZED = ("control commands need the control token: a client of the same user on the broker's host reads it "
                "from the runtime directory (control.token) by itself; elsewhere give it a copy of that file "
                "(control_token_file= / --control-token-file / TOKSERVE_CONTROL_TOKEN_FILE)")

# Commands that pause dispatch before they fan out (their workers stop serving).
_PAUSING = ("pause", "sleep")


@dataclass(eq=False)
class Fanout:
    """One control command in flight to a set of workers."""

    client: Optional[bytes]  # None: the broker's own (a replay to a restarted worker)
    client_nonce: int
    req: ControlRequest
    waiting: dict  # worker identity -> rank
    replies: list[RankReply] = field(default_factory=list)
    on_done: Optional[Callable[["Fanout", ControlReply], None]] = None


class ControlPlane:
    def __init__(self, broker):
        self.broker = broker
        self.paused = False
        self.pool_version: Optional[str] = None  # None until an update names one
        self.lineage: Optional[list[str]] = []  # disk updates since start; None: not reproducible
        self._update_paths: Optional[list[str]] = []  # of the pool-wide update in progress
        self._in_update = False  # between start_weight_update and finish_weight_update
        self._update_restarts = False  # the update includes a whole checkpoint: lineage starts over
        self.fanouts: dict[int, Fanout] = {}
        self._nonces = itertools.count(1)
        # LoRA adapters the pool serves (name -> path): the first worker's startup
        # adapters, then every pool-wide load / unload that succeeded.
        self.lora_adapters: Optional[dict[str, str]] = None

    # ------------------------------------------------------------ clients
    def on_client(self, client: bytes, rest: list) -> None:
        req = framing.decode(rest[0], ControlRequest)
        # Before anything else: a command without the control token changes nothing (not
        # even the paused flag) and learns nothing.  Any local process may reach the
        # frontend; only holders of the token (trainers, an --enable-rl gateway) steer it.
        if not runtime_dir.token_matches(self.broker.cfg.control_token, req.token):
            self.broker.stats.control_refused += 1
            self.broker._refused.warning("refused CONTROL %r from client %s: %s control token", req.op[:64],
                                         client.hex(), "wrong" if req.token else "no")
            self._reply(client, ControlReply(req.nonce, ok=False, status=401, error_type="Unauthorized",
                                             message=UNAUTHORIZED))
            return
        payload = rest[1:]
        local = getattr(self, "local_" + req.op, None) if req.op.isidentifier() else None
        if local is not None:
            self._reply(client, local(req))
            return
        if req.op in _PAUSING:
            self.paused = True
        targets = self._targets(req.rank)
        if isinstance(targets, ControlReply):
            targets.nonce = req.nonce
            self._reply(client, targets)
            return
        self.fan_out(client, req, payload, targets)

    def _targets(self, rank: Optional[int]):
        workers = sorted(self.broker.workers.all(), key=lambda w: w.rank)
        if rank is not None:
            workers = [w for w in workers if w.rank == rank]
            if not workers:
                live = [w.rank for w in self.broker.workers.all()]
                return ControlReply(0, ok=False, status=400,
                                    message=f"no live worker has rank {rank} (live ranks: {sorted(live)})")
        if not workers:
            return ControlReply(0, ok=False, status=503, message="no worker available")
        return workers

    def fan_out(self, client: Optional[bytes], req: ControlRequest, payload: list, workers: list,
                on_done: Optional[Callable] = None) -> None:
        nonce = next(self._nonces)
        fan = Fanout(client, req.nonce, req, {w.identity: w.rank for w in workers}, on_done=on_done)
        self.fanouts[nonce] = fan
        body = framing.encode(ControlRequest(nonce, req.op, req.args, req.rank))
        for w in workers:
            if not self.broker._to_worker(w, framing.message(MsgType.CONTROL, body, *payload)):
                self._answered(fan, nonce, w.identity, RankReply(nonce, w.rank, ok=False, status=503,
                                                                   message="worker unreachable"))

    def _reply(self, client: Optional[bytes], reply: ControlReply) -> None:
        if client is not None:
            self.broker._to_client(client, framing.message(MsgType.CONTROL, reply))

    # ------------------------------------------------------------ workers
    def on_worker_reply(self, worker, reply: RankReply) -> None:
        worker.weight_version = reply.weight_version
        fan = self.fanouts.get(reply.nonce)
        if fan is not None:
            if reply.ok:
                _track_lora(worker, fan.req)
            self._answered(fan, reply.nonce, worker.identity, reply)
        self.refresh_stale()

    def on_worker_gone(self, worker) -> None:
        for nonce, fan in list(self.fanouts.items()):
            if worker.identity in fan.waiting:
                self._answered(fan, nonce, worker.identity,
                               RankReply(nonce, worker.rank, ok=False, status=500,
                                         message=f"worker rank {worker.rank} died before answering"))

    def on_worker_ready(self, worker) -> None:
        """Hold a worker with other weights out of dispatch; bring it current when possible."""
        worker.lora_adapters = dict(worker.model.lora_adapters or {})
        if self.lora_adapters is None and worker.model.lora_adapters is not None:
            self.lora_adapters = dict(worker.model.lora_adapters)
        self._sync_lora(worker)
        if self.pool_version is None or worker.weight_version == self.pool_version:
            return
        worker.stale = True
        if self.lineage is None:
            log.warning("worker rank %d registered with weights %r, the pool serves %r (updated over the wire): "
                        "held out of dispatch until it is updated", worker.rank, worker.weight_version,
                        self.pool_version)
            return
        log.info("worker rank %d registered with weights %r: replaying %d disk update(s) to reach %r",
                 worker.rank, worker.weight_version, len(self.lineage), self.pool_version)
        worker.replaying = True
        req = ControlRequest(0, "reload_weights", {"paths": list(self.lineage), "weight_version": self.pool_version},
                             worker.rank)

        def done(fan: Fanout, reply: ControlReply) -> None:
            worker.replaying = False
            if not reply.ok:
                log.error("replaying the weights to worker rank %d failed: %s", worker.rank, reply.message)

        self.fan_out(None, req, [], [worker], on_done=done)

    def _sync_lora(self, worker) -> None:
        """Send a joining worker the adapter loads / unloads it missed."""
        if self.lora_adapters is None or worker.model.lora_adapters is None:
            return  # the pool or this worker serves no LoRA
        have, want = worker.lora_adapters, self.lora_adapters
        ops = [("unload_lora_adapter", {"lora_name": n}) for n in have if n not in want]
        ops += [("load_lora_adapter", {"lora_name": n, "lora_path": p, "load_inplace": True})
                for n, p in want.items() if have.get(n) != p]
        for op, args in ops:
            log.info("worker rank %d: %s %s (pool's adapters)", worker.rank, op, args["lora_name"])

            def done(fan: Fanout, reply: ControlReply) -> None:
                if not reply.ok:
                    log.error("worker rank %d: %s %s failed: %s", worker.rank, fan.req.op,
                              fan.req.args["lora_name"], reply.message)

            self.fan_out(None, ControlRequest(0, op, args, worker.rank), [], [worker], on_done=done)

    def refresh_stale(self) -> None:
        changed = False
        for w in self.broker.workers.all():
            stale = self.pool_version is not None and w.weight_version != self.pool_version
            if stale != w.stale:
                w.stale, changed = stale, True
                log.info("worker rank %d %s (weights %r, pool %r)", w.rank,
                         "held out of dispatch" if stale else "back in dispatch", w.weight_version, self.pool_version)
        if changed and not self.paused:
            self.broker._dispatch_pending()

    # ---------------------------------------------------------- aggregation
    def _answered(self, fan: Fanout, nonce: int, identity: bytes, reply: RankReply) -> None:
        if fan.waiting.pop(identity, None) is None:
            return
        fan.replies.append(reply)
        if fan.waiting:
            return
        del self.fanouts[nonce]
        replies = sorted(fan.replies, key=lambda r: r.rank)
        failed = [r for r in replies if not r.ok]
        out = ControlReply(fan.client_nonce, ok=not failed, ranks=replies)
        if failed:
            out.status = max(r.status for r in failed)
            out.message = "; ".join(f"rank {r.rank}: {r.message}" for r in failed)
            types = {r.error_type for r in failed if r.status == out.status}
            out.error_type = types.pop() if len(types) == 1 else ""
        else:
            self._after(fan.req, replies)
        if fan.on_done is not None:
            fan.on_done(fan, out)
        self._reply(fan.client, out)

    def _after(self, req: ControlRequest, replies: list[RankReply]) -> None:
        """Pool state once every targeted worker did ``req``."""
        if req.rank is not None:  # one rank: an operator bringing it current, not a pool change
            return
        op, args = req.op, req.args
        fully_awake = op == "wake_up" and all(isinstance(r.result, dict) and r.result.get("fully_awake")
                                              for r in replies)
        if op == "resume" or fully_awake:
            self.paused = False
            self.broker._dispatch_pending()
        elif op == "start_weight_update":
            self._update_paths, self._update_restarts = [], False
        elif op == "update_weights":
            info = args.get("update_info")
            path = info.get("path") if isinstance(info, dict) else None
            complete = all(isinstance(r.result, dict) and r.result.get("complete") for r in replies)
            if path is not None and complete:
                self._update_paths, self._update_restarts = [path], True  # a whole checkpoint
            elif self._update_paths is not None and path is not None:
                self._update_paths.append(path)
            elif path is None:
                self._update_paths = None
            if not self._in_update:
                self._commit_lineage()
        elif op == "finish_weight_update":
            self._commit_lineage()
            if args.get("weight_version"):
                self.pool_version = args["weight_version"]
        elif op == "update_weight_version":
            self.pool_version = args.get("new_version")
        elif op == "load_lora_adapter" and self.lora_adapters is not None:
            self.lora_adapters[args["lora_name"]] = args["lora_path"]
        elif op == "unload_lora_adapter" and self.lora_adapters is not None:
            self.lora_adapters.pop(args["lora_name"], None)
        elif op == "weight_checker" and args.get("action") == "reset":
            self.lineage = None
        if op == "start_weight_update":
            self._in_update = True
        elif op == "finish_weight_update":
            self._in_update = False
        self.refresh_stale()

    def _commit_lineage(self) -> None:
        if self._update_paths is None:
            self.lineage = None
        elif self._update_restarts:
            self.lineage = list(self._update_paths)
        elif self.lineage is not None:
            self.lineage.extend(self._update_paths)
        self._update_paths, self._update_restarts = [], False

    # ------------------------------------------------------- broker-local
    def local_is_paused(self, req: ControlRequest) -> ControlReply:
        return ControlReply(req.nonce, result={"is_paused": self.paused})

    def local_abort(self, req: ControlRequest) -> ControlReply:
        ids = req.args.get("request_ids")
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
            return ControlReply(req.nonce, ok=False, status=400, message="request_ids must be a list of strings")
        return ControlReply(req.nonce, result={"aborted": self.broker.abort_everywhere(ids or None)})

    def local_weight_info(self, req: ControlRequest) -> ControlReply:
        ranks = [{"rank": w.rank, "weight_version": w.weight_version, "stale": w.stale, "replaying": w.replaying}
                 for w in sorted(self.broker.workers.all(), key=lambda w: w.rank)]
        version = self.pool_version
        if version is None:
            versions = {r["weight_version"] for r in ranks}
            version = versions.pop() if len(versions) == 1 else None
        return ControlReply(req.nonce, result={"weight_version": version, "ranks": ranks,
                                               "reproducible_from_disk": self.lineage is not None})

    def local_get_world_size(self, req: ControlRequest) -> ControlReply:
        workers = self.broker.workers.all()
        if not workers:
            return ControlReply(req.nonce, ok=False, status=503, message="no worker available")
        include_dp = req.args.get("include_dp", True)
        sizes = [w.world_size for w in workers]
        return ControlReply(req.nonce, result={"world_size": sum(sizes) if include_dp else max(sizes)})



def _track_lora(worker, req: ControlRequest) -> None:
    """A worker's registered adapters after it did ``req``."""
    if req.op == "load_lora_adapter":
        worker.lora_adapters[req.args["lora_name"]] = req.args["lora_path"]
    elif req.op == "unload_lora_adapter":
        worker.lora_adapters.pop(req.args["lora_name"], None)
