"""The broker's control plane: CONTROL commands fanned out to the worker pool.

A client's ControlRequest goes to every live worker (or the one rank it names);
the client gets one ControlReply once every targeted worker answered or died.
The broker answers some commands itself from what it knows (is_paused, abort of
requests across all clients, weight_info, get_world_size) and keeps the pool's
state that outlives any one worker:

* paused: no request is dispatched while set.  As vLLM 0.33 (EngineCoreProc
  ``pause_generation`` / ``_reject_add_while_paused``): after ``pause`` in ``abort``
  or ``wait`` mode (``rejecting``) a new request is refused at admission with a
  retryable 503 (``PAUSED_MESSAGE``, ServiceUnavailableError) until ``resume`` (or a
  full ``wake_up``); after ``pause`` in ``keep`` mode, and during ``sleep`` (which
  leaves that policy as it was), new ones wait in the pending queue (bounded by
  max_pending).  Requests admitted before the pause are not refused: ``abort`` (of
  ``pause`` or ``sleep``) ends them, the queued ones here included (vLLM aborts its
  waiting queue too); ``wait`` and ``keep`` keep the queued ones for after the resume;
* the pool's weight version, and how to rebuild it: the checkpoint folders of the
  disk updates since start (``lineage``), or None once weights came over the wire.
  A worker that registers with another version is held out of dispatch ("stale");
  the broker replays the lineage to it when it can, else reports it stale in
  weight_info until a trainer brings it to the current version;
* the LoRA adapters the pool serves (name -> path): a worker that registers
  without some of them (restarted after a runtime load) is sent the loads, and
  unloads of those the pool dropped since it started.

A refused or failed command leaves the pool as it was:

* the broker checks what it can before anything moves (the rank exists, a live
  worker to run it, pause / sleep arguments): a refusal sends nothing;
* ``pause`` / ``sleep`` stop dispatch before they fan out (their workers stop
  serving); when they fail, dispatch is restored, and the ranks that did pause or
  sleep are resumed / woken first (unless the pool was paused already);
* a ``start_weight_update`` that some rank refused is dropped on the ranks that
  started it (an open session would make their later updates stage);
* a rank that dies before answering ``resume``, ``wake_up`` or
  ``update_weight_version`` does not fail it: the pool follows what the survivors did
  (else a resumed pool would stay paused here, relabelled ranks be held out as stale),
  and the result names ``lost_ranks``.

A pool-wide weight update is a transaction over the ranks that started it (its
members).  ``update_weights`` goes to the members only (a worker that joins mid-update
is brought current after the commit), and ``finish_weight_update`` runs in two phases:

1. prepare: every live member checks it can commit (its session exists, no bucket was
   refused).  Any refusal aborts the update on every member (staged weights dropped,
   weights written in place while paused restored from their checkpoints) and the
   reply is an error that says nothing was committed: retry from
   ``start_weight_update``.
2. commit: the members swap the update in.  From the moment one rank committed the
   pool's version is the new one.

A member that dies (or is lost at any point of the update) does not abort it: the
survivors commit, the pool version advances, and the reply is a success whose result
says ``{"committed": true, "weight_version", "lost_ranks": [...],
"reproducible_from_disk"}``.  The lost rank's replacement registers with other
weights and is held out of dispatch: when the update came from disk the broker
replays the lineage to it (so the pool heals by itself); when it came over the wire it
stays ``stale`` in weight_info until the trainer pushes the weights to that rank
(``?rank=N``), which ``reproducible_from_disk: false`` tells it to do.  Survivors are
never left on weights the pool does not record.  Only when no member is left does the
finish fail (503, nothing committed).  A pool-wide finish without ``weight_version``
is labelled ``update-N`` by the broker: the version is how a restarted rank is told
from the committed ones.  A pool-wide ``update_weights`` outside start/finish (applied at
once, as vLLM) runs as such a transaction of its own (start, the bucket, prepare, commit
without a new label, or abort).
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
# What puts back a rank that did a pausing command another rank failed.
_UNDO_PAUSING = {"pause": "resume", "sleep": "wake_up"}
# Pool-wide commands whose effect on the survivors the pool must follow when a rank dies before
# answering (else a resumed pool stays paused in the broker, relabelled ranks are held out as stale).
_SURVIVABLE = ("resume", "wake_up", "update_weight_version")
# worker/control.py's modes, checked here too so that a bad one is refused before dispatch stops.
PAUSE_MODES = ("abort", "wait", "keep")
# vLLM 0.33's RequestError(code="engine_paused", retryable=True) for a request added while a user
# pause in abort / wait mode holds (vllm/v1/engine/core.py ``_reject_add_while_paused``): HTTP 503.
PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."


@dataclass(eq=False)
class Fanout:
    """One control command in flight to a set of workers."""

    client: Optional[bytes]  # None: the broker's own (a replay to a restarted worker)
    client_nonce: int
    req: ControlRequest
    waiting: dict  # worker identity -> rank
    replies: list[RankReply] = field(default_factory=list)
    # Called with the aggregate instead of replying to ``client``: it answers when it is done.
    on_done: Optional[Callable[["Fanout", ControlReply], None]] = None
    done_ok: list[bytes] = field(default_factory=list)  # identities that answered ok
    lost: list[int] = field(default_factory=list)  # ranks that died before answering


class ControlPlane:
    def __init__(self, broker):
        self.broker = broker
        self.paused = False
        self.rejecting = False  # paused by pause(abort | wait): new requests get 503 (PAUSED_MESSAGE)
        self.pool_version: Optional[str] = None  # None until an update names one
        self.lineage: Optional[list[str]] = []  # disk updates since start; None: not reproducible
        self._update_paths: Optional[list[str]] = []  # of the pool-wide update in progress
        self._in_update = False  # between start_weight_update and finish_weight_update
        self._update_restarts = False  # the update includes a whole checkpoint: lineage starts over
        self._update_members: set[bytes] = set()  # identities of the ranks that started the update
        self._update_lost: set[int] = set()  # ranks of members that died since
        self._labels = itertools.count(1)  # names of pool-wide updates finished without a version
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
        # Everything the broker can check is checked before any state moves: a refusal changes nothing.
        targets = self._targets(req.rank)
        if not isinstance(targets, ControlReply):
            targets = self._refuse(req) or targets
        if isinstance(targets, ControlReply):
            targets.nonce = req.nonce
            self._reply(client, targets)
            return
        on_done = None
        if req.op in _PAUSING:
            on_done = self._pausing_done(self.paused, self.rejecting)
            self._pausing(req)
        elif req.rank is None and req.op == "finish_weight_update":
            self._finish_update(client, req)
            return
        elif req.rank is None and req.op == "start_weight_update":
            on_done = self._start_done
        elif req.rank is None and req.op in _SURVIVABLE:
            on_done = self._survivors_done
        elif req.rank is None and req.op == "update_weights" and self._in_update:
            targets = self._members()
            if not targets:
                self._reply(client, ControlReply(req.nonce, ok=False, status=503, message=(
                    f"every rank of this weight update died (ranks {sorted(self._update_lost)}): "
                    f"start over with /start_weight_update")))
                return
            on_done = self._bucket_done
        elif req.rank is None and req.op == "update_weights":
            self._lone_update(client, req, payload, targets)
            return
        self.fan_out(client, req, payload, targets, on_done=on_done)

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

    @staticmethod
    def _refuse(req: ControlRequest) -> Optional[ControlReply]:
        """The arguments the broker can judge alone (the workers check them again)."""
        args, why = req.args, None
        if req.op in _PAUSING and args.get("mode", "abort") not in PAUSE_MODES:
            why = f"unknown pause mode {args.get('mode')!r}: expected one of {', '.join(PAUSE_MODES)}"
        elif req.op == "sleep" and not (isinstance(args.get("level", 1), int)
                                        and not isinstance(args.get("level", 1), bool)
                                        and 0 <= args.get("level", 1) <= 2):
            why = f"sleep level must be 0, 1 or 2, got {args.get('level')!r}"
        elif req.op == "update_weight_version" and not (isinstance(args.get("new_version"), str)
                                                        and args["new_version"]):
            why = "new_version must be a non-empty string"
        elif req.op == "finish_weight_update" and args.get("weight_version") is not None and not (
                isinstance(args["weight_version"], str) and args["weight_version"]):
            why = "weight_version must be a non-empty string"
        if why is None:
            return None
        log.info("control %s refused: %s", req.op, why)
        return ControlReply(0, ok=False, status=400, message=why, error_type="BadRequestError")

    def fan_out(self, client: Optional[bytes], req: ControlRequest, payload: list, workers: list,
                on_done: Optional[Callable] = None) -> None:
        nonce = next(self._nonces)
        fan = Fanout(client, req.nonce, req, {w.identity: w.rank for w in workers}, on_done=on_done)
        self.fanouts[nonce] = fan
        body = framing.encode(ControlRequest(nonce, req.op, req.args, req.rank))
        for w in workers:
            if not self.broker.links.to_worker(w, framing.message(MsgType.CONTROL, body, *payload)):
                self._answered(fan, nonce, w.identity, RankReply(nonce, w.rank, ok=False, status=503,
                                                                   message="worker unreachable"))

    def _reply(self, client: Optional[bytes], reply: ControlReply) -> None:
        if client is not None:
            self.broker.links.to_client(client, framing.message(MsgType.CONTROL, reply))

    def _live(self, identities) -> list:
        return sorted((w for i in identities if (w := self.broker.workers.get(i)) is not None), key=lambda w: w.rank)

    def _pausing(self, req: ControlRequest) -> None:
        """pause / sleep, as it starts (before the fan-out): dispatch stops; a pause in
        abort / wait mode rejects new requests from now on (vLLM 0.33 ``pause_generation``,
        ``keep`` queues them; sleep leaves the policy as it was); abort mode also ends the
        requests queued here, as vLLM's pause aborts its waiting queue with the running."""
        self.paused = True
        mode = req.args.get("mode", "abort")
        if req.op == "pause":
            self.rejecting = mode != "keep"
        if mode == "abort" and req.rank is None:
            table = self.broker.table
            table.abort_entries([e for e in table.pending if not e.done and not e.orphaned])

    # ------------------------------------------------- undoing failed commands
    def _pausing_done(self, was_paused: bool, was_rejecting: bool) -> Callable:
        """pause / sleep: a failure leaves dispatch as it was, and the ranks that did stop
        are put back first (resumed / woken), unless the pool was paused already."""

        def done(fan: Fanout, out: ControlReply) -> None:
            if not out.ok:
                self.rejecting = was_rejecting
            if out.ok or was_paused:
                self._reply(fan.client, out)
                return
            did = self._live(fan.done_ok)

            def restored(undo: Optional[Fanout], res: ControlReply) -> None:
                self.paused = self.rejecting = False
                self.broker.router.dispatch_pending()
                if not res.ok:
                    log.error("undoing a failed %s on ranks %s failed: %s", fan.req.op, [w.rank for w in did],
                              res.message)
                    out.message += f" (putting back rank(s) {[w.rank for w in did]} failed: {res.message})"
                self._reply(fan.client, out)

            if not did:
                restored(None, ControlReply(0))
                return
            log.info("%s failed on some ranks: %s on ranks %s", fan.req.op, _UNDO_PAUSING[fan.req.op],
                     [w.rank for w in did])
            self.fan_out(None, ControlRequest(0, _UNDO_PAUSING[fan.req.op], {}, fan.req.rank), [], did,
                         on_done=restored)

        return done

    def _start_done(self, fan: Fanout, out: ControlReply) -> None:
        """A pool-wide start: its members, or (refused somewhere) dropped where it started,
        since an open session makes a rank stage what the others write at once."""
        if out.ok:
            self._update_members, self._update_lost = set(fan.done_ok), set()
            self._reply(fan.client, out)
            return
        self._end_update()
        started = self._live(fan.done_ok)
        if not started:
            self._reply(fan.client, out)
            return

        def dropped(_: Fanout, res: ControlReply) -> None:
            if not res.ok:
                out.message += f" (dropping it on the other ranks failed: {res.message})"
            self._reply(fan.client, out)

        self.fan_out(None, ControlRequest(0, "abort_weight_update", {}, None), [], started, on_done=dropped)

    def _survivors_done(self, fan: Fanout, out: ControlReply) -> None:
        """A rank that died before answering does not fail the command: what the live ranks
        did is the pool's state (the reply names the lost ranks)."""
        live = [r for r in out.ranks if r.rank not in fan.lost]
        if not out.ok and live and all(r.ok for r in live):
            self._after(fan.req, live)
            out = ControlReply(fan.client_nonce, ranks=live, result={"lost_ranks": sorted(set(fan.lost))})
        self._reply(fan.client, out)

    def _bucket_done(self, fan: Fanout, out: ControlReply) -> None:
        """A bucket of a pool-wide update: a member that died does not fail it (the update
        goes on with the survivors; see the module docstring)."""
        if out.ok:
            if self._update_lost:  # lost before this bucket went out
                out.result = {"lost_ranks": sorted(self._update_lost)}
            self._reply(fan.client, out)
            return
        live = [r for r in out.ranks if r.rank not in fan.lost]
        if live and all(r.ok for r in live):
            self._after(fan.req, live)
            self._reply(fan.client, ControlReply(fan.client_nonce, ranks=live,
                                                 result={"lost_ranks": sorted(self._update_lost)}))
            return
        self._reply(fan.client, out)

    def _lone_update(self, client, req: ControlRequest, payload: list, workers: list) -> None:
        """A pool-wide update_weights outside start/finish (written at once, vLLM) runs as
        its own transaction: start, the bucket, then finish's prepare and commit (no new
        label) or abort, so a rank that refuses it leaves no other rank on other weights."""

        def started(fan: Fanout, out: ControlReply) -> None:
            if not out.ok:
                out.message += "; nothing was committed (the update is dropped on every rank): send it again"
                self._start_done(fan, out)  # dropped where it started; the client gets the refusal
                return
            self._in_update, self._update_paths, self._update_restarts = True, [], False
            self._update_members, self._update_lost = set(fan.done_ok), set()
            self.fan_out(None, req, payload, self._members(), on_done=bucketed)

        def bucketed(fan: Fanout, out: ControlReply) -> None:
            live = [r for r in out.ranks if r.rank not in fan.lost]
            if not (live and all(r.ok for r in live)):
                self._abort_update(client, req.nonce, out, sorted(self._update_lost), self._members(),
                                   retry="send it again")
                return
            if not out.ok:  # only deaths: the bucket stands for the survivors
                self._after(req, live)
            self._finish_update(client, ControlRequest(req.nonce, "finish_weight_update", {}, None), label=False)

        self.fan_out(client, ControlRequest(req.nonce, "start_weight_update", {}, None), [], workers,
                     on_done=started)

    # ------------------------------------------------- finishing an update
    def _members(self) -> list:
        return self._live(self._update_members)

    def _end_update(self) -> None:
        self._in_update = False
        self._update_members, self._update_lost = set(), set()
        self._update_paths, self._update_restarts = [], False

    def _finish_update(self, client: bytes, req: ControlRequest, label: bool = True) -> None:
        """Pool-wide finish: prepare on every live member, then commit (module docstring)."""
        if self._in_update:
            members, lost = self._members(), sorted(self._update_lost)
        else:
            # No pool-wide start seen (e.g. per-rank starts): every live worker is asked, and
            # the prepare phase refuses for all of them if any has nothing to commit.
            members, lost = sorted(self.broker.workers.all(), key=lambda w: w.rank), []
        if not members:
            if self._in_update:
                self._end_update()
                message = f"every rank of this weight update died (ranks {lost}): nothing committed"
            else:
                message = "no worker available"
            self._reply(client, ControlReply(req.nonce, ok=False, status=503, message=message))
            return
        args = dict(req.args)
        if label and not args.get("weight_version"):
            # The label is how a restarted rank's weights are told from the committed ones.
            args["weight_version"] = f"update-{next(self._labels)}"
        ids = [w.identity for w in members]
        self.fan_out(None, ControlRequest(0, "prepare_weight_update", args, None), [], members,
                     on_done=lambda fan, out: self._prepared(client, req.nonce, args, lost, ids, fan, out))

    def _prepared(self, client, nonce: int, args: dict, lost: list, ids: list, fan: Fanout,
                  out: ControlReply) -> None:
        lost = sorted(set(lost) | set(fan.lost))
        refused = [r for r in out.ranks if not r.ok and r.rank not in fan.lost]
        ready = self._live(fan.done_ok)
        if refused or not ready:
            self._abort_update(client, nonce, out, lost, self._live(ids))
            return
        self.fan_out(None, ControlRequest(0, "finish_weight_update", args, None), [], ready,
                     on_done=lambda f, o: self._committed(client, nonce, args, lost, f, o))

    def _abort_update(self, client, nonce: int, out: ControlReply, lost: list, workers: list,
                      retry: str = "start over with /start_weight_update") -> None:
        """Nothing commits: the update is dropped on every live rank that may hold part of it."""
        if not out.ok and not any(r.ok for r in out.ranks) and all(r.rank in lost for r in out.ranks):
            status, message = 503, f"every rank of this weight update died (ranks {lost})"
        else:
            status, message = out.status, out.message
        if lost and status != 503:
            message += f"; ranks {lost} died during the update"
        message += f"; nothing was committed (the update is dropped on every rank): {retry}"
        before = next((r.weight_version for r in out.ranks if r.ok), None)

        def aborted(_: Optional[Fanout], res: ControlReply) -> None:
            self._end_update()
            # A rank whose in-place writes could not be undone labels itself apart: the pool
            # must have a version for it to be held out.
            if self.pool_version is None and before is not None and any(
                    r.ok and not r.result.get("restored", True) for r in res.ranks):
                self.pool_version = before
            self.refresh_stale()
            if not res.ok:
                log.error("dropping a refused weight update failed: %s", res.message)
            self._reply(client, ControlReply(nonce, ok=False, status=status, message=message,
                                             error_type=out.error_type if status == out.status else "",
                                             ranks=out.ranks))

        if not workers:
            aborted(None, ControlReply(0))
            return
        self.fan_out(None, ControlRequest(0, "abort_weight_update", {}, None), [], workers, on_done=aborted)

    def _committed(self, client, nonce: int, args: dict, lost: list, fan: Fanout, out: ControlReply) -> None:
        lost = sorted(set(lost) | set(fan.lost))
        committed = [r for r in out.ranks if r.ok]
        failed = [r.rank for r in out.ranks if not r.ok and r.rank not in fan.lost]
        if not committed:
            self._end_update()
            self.refresh_stale()
            self._reply(client, ControlReply(nonce, ok=False, status=out.status, ranks=out.ranks,
                                             message=out.message + "; nothing was committed"))
            return
        if not out.ok:  # (a full success was recorded by _after already)
            self._commit_update(args)
        self.refresh_stale()
        # Ranks that are not on the committed version (replacements of lost ones, workers that
        # joined mid-update) are brought to it where the pool can rebuild it from disk.
        members = {r.rank for r in committed} | set(failed)
        for w in self.broker.workers.all():
            if w.stale and not w.replaying and w.rank not in members:
                self._bring_current(w)
        if lost or failed:
            log.warning("weight update %r committed on ranks %s; lost ranks %s, failed ranks %s",
                        self.pool_version, [r.rank for r in committed], lost, failed)
        result = {"committed": True, "weight_version": self.pool_version, "lost_ranks": lost,
                  "reproducible_from_disk": self.lineage is not None}
        if failed:
            result["failed_ranks"] = failed
        self._reply(client, ControlReply(nonce, result=result, ranks=committed))

    def _commit_update(self, args: dict) -> None:
        self._commit_lineage()
        if args.get("weight_version"):
            self.pool_version = args["weight_version"]
        self._end_update()

    # ------------------------------------------------------------ workers
    def on_worker_reply(self, worker, reply: RankReply) -> None:
        worker.weight_version = reply.weight_version
        fan = self.fanouts.get(reply.nonce)
        if fan is not None:
            if reply.ok:
                _track_lora(worker, fan.req)
                _track_sleep(worker, fan.req, reply)
            self._answered(fan, reply.nonce, worker.identity, reply)
        self.refresh_stale()

    def on_worker_gone(self, worker) -> None:
        if worker.identity in self._update_members:
            self._update_members.discard(worker.identity)
            self._update_lost.add(worker.rank)
        for nonce, fan in list(self.fanouts.items()):
            if worker.identity in fan.waiting:
                fan.lost.append(worker.rank)
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
        self._bring_current(worker)

    def _bring_current(self, worker) -> None:
        """Replay the pool's disk lineage to a worker on other weights (else it stays stale)."""
        if self.lineage is None:
            log.warning("worker rank %d holds weights %r, the pool serves %r (updated over the wire): "
                        "held out of dispatch until it is updated", worker.rank, worker.weight_version,
                        self.pool_version)
            return
        log.info("worker rank %d holds weights %r: replaying %d disk update(s) to reach %r",
                 worker.rank, worker.weight_version, len(self.lineage), self.pool_version)
        worker.replaying = True
        req = ControlRequest(0, "reload_weights", {"paths": list(self.lineage), "weight_version": self.pool_version},
                             worker.rank)

        def done(fan: Fanout, reply: ControlReply) -> None:
            worker.replaying = False
            if not reply.ok:
                log.error("replaying the weights to worker rank %d failed: %s", worker.rank, reply.message)
            elif self.broker.workers.get(worker.identity) is worker and worker.stale:
                self._bring_current(worker)  # the pool moved on while it replayed

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
            self.broker.router.dispatch_pending()

    # ---------------------------------------------------------- aggregation
    def _answered(self, fan: Fanout, nonce: int, identity: bytes, reply: RankReply) -> None:
        if fan.waiting.pop(identity, None) is None:
            return
        fan.replies.append(reply)
        if reply.ok:
            fan.done_ok.append(identity)
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
            fan.on_done(fan, out)  # it answers the client (if any) once it is done
        else:
            self._reply(fan.client, out)

    def _after(self, req: ControlRequest, replies: list[RankReply]) -> None:
        """Pool state once every targeted worker did ``req``."""
        if req.rank is not None:  # one rank: an operator bringing it current, not a pool change
            return
        op, args = req.op, req.args
        fully_awake = op == "wake_up" and all(isinstance(r.result, dict) and r.result.get("fully_awake")
                                              for r in replies)
        if op == "resume" or fully_awake:  # vLLM: wake_up resumes the scheduler, which ends rejecting too
            self.paused = self.rejecting = False
            self.broker.router.dispatch_pending()
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
            self._commit_update(args)
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
        return ControlReply(req.nonce, result={"aborted": self.broker.table.abort_everywhere(ids or None)})

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



def _track_sleep(worker, req: ControlRequest, reply: RankReply) -> None:
    """The worker's sleep level (vllm:engine_sleep_state) as soon as it answered a sleep or
    wake-up, before the client gets its 200: its next load report, which says the same, may
    come a step later."""
    if req.op == "sleep":
        worker.load.sleep_level = req.args.get("level", 1)
    elif req.op == "wake_up" and isinstance(reply.result, dict) and reply.result.get("fully_awake"):
        worker.load.sleep_level = -1


def _track_lora(worker, req: ControlRequest) -> None:
    """A worker's registered adapters after it did ``req``."""
    if req.op == "load_lora_adapter":
        worker.lora_adapters[req.args["lora_name"]] = req.args["lora_path"]
    elif req.op == "unload_lora_adapter":
        worker.lora_adapters.pop(req.args["lora_name"], None)
