"""The worker's end of the control plane: the CONTROL commands the broker fans out.

Commands run on the engine thread between two steps (WorkerServer drains the pipe
before it steps), so none of them races a forward pass.  Pause state lives here:

* ``abort``: every request of this worker ends now (abort deltas are shipped);
* ``wait``: the reply is held back until this worker's requests have finished;
* ``keep``: the engine stops stepping; requests keep their KV cache and continue on resume.

Weight updates come in three transports: tensors in the CONTROL frames (direct
client, ``update_info`` without ``path``, no init needed), a torch.distributed
group (after ``init_weight_transfer_engine``: gloo on CPU, NCCL on CUDA), and a
checkpoint folder (``update_info: {"path": ...}``).  While paused, buckets are
written in place as they arrive (no extra memory); otherwise they are staged and
written together by ``finish_weight_update``, so serving never sees half an update.

A pool-wide finish is the broker's two-phase commit (broker/control.py):
``prepare_weight_update`` only checks this rank could commit, then every rank gets
``finish_weight_update``, or, when one refused, ``abort_weight_update`` (staged
buckets dropped, in-place ones undone from the checkpoints the weights came from).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from common.errors import BadRequest, ServingError
from common.protocol import ControlRequest, RankReply
from common import tensor_frames
from worker.engine.api import EngineAPI

log = logging.getLogger("tokserve.worker")

PAUSE_MODES = ("abort", "wait", "keep")


@dataclass
class _UpdateSession:
    staged: dict = field(default_factory=dict)  # name -> tensor, written at finish
    written: int = 0  # tensors written in place (while paused)
    from_disk: Optional[str] = None  # the checkpoint folder, when every bucket came from one
    over_wire: bool = False
    failed: Optional[str] = None  # why a bucket was refused: the update cannot finish
    # The checkpoints the weights came from when it started (None: not reproducible): what an
    # abort rebuilds them from once buckets were written in place.
    lineage_before: Optional[list] = None


@dataclass
class _Deferred:
    """A reply that waits until this worker has no requests left (pause/sleep with mode=wait)."""

    nonce: int
    then: Callable[[], Any]


class WorkerControl:
    def __init__(self, server):
        self.server = server  # WorkerServer: engine, rank, tracks, abort and ship helpers
        self.paused: Optional[str] = None  # pause mode while paused
        self.session: Optional[_UpdateSession] = None
        self.receiver = None  # common.dist_weight_transfer.WeightReceiver
        self.deferred: list[_Deferred] = []

    @property
    def engine(self) -> EngineAPI:
        return self.server.engine

    @property
    def frozen(self) -> bool:
        """The engine must not step: paused with keep, or its memory released."""
        return self.paused == "keep" or self.engine.rl.is_asleep

    # ------------------------------------------------------------------ entry
    def handle(self, req: ControlRequest, payload: list) -> Optional[RankReply]:
        """Run one command; None when the reply is deferred (sent by ``poll_deferred``)."""
        handler = getattr(self, "op_" + req.op, None) if req.op.isidentifier() else None
        started = time.perf_counter()
        try:
            if handler is None:
                raise BadRequest(f"unknown control command {req.op!r}", "op")
            result = handler(req, payload) if req.op == "update_weights" else handler(req)
        except ServingError as exc:
            if req.op == "update_weights" and self.session is not None:
                self.session.failed = exc.message
            return self.reply(req.nonce, ok=False, status=exc.status, message=exc.message, error_type=exc.type)
        except Exception as exc:
            log.exception("control command %s failed", req.op)
            return self.reply(req.nonce, ok=False, status=500, message=f"{req.op} failed: {exc}")
        finally:
            took = time.perf_counter() - started
            (log.info if took > 1.0 else log.debug)("control %s took %.3f s", req.op, took)
        if isinstance(result, _Deferred):
            self.deferred.append(result)
            return None
        return self.reply(req.nonce, result=result)

    def reply(self, nonce: int, *, ok: bool = True, status: int = 200, message: str = "",
              result: Any = None, error_type: str = "") -> RankReply:
        return RankReply(nonce=nonce, rank=self.server.rank, ok=ok, status=status, message=message, result=result,
                         weight_version=self.engine.rl.weight_version, error_type=error_type)

    def poll_deferred(self) -> list[RankReply]:
        """Replies whose wait is over (no request left on this worker)."""
        if not self.deferred or self.server.tracks or self.engine.has_unfinished():
            return []
        ready, self.deferred = self.deferred, []
        out = []
        for d in ready:
            try:
                out.append(self.reply(d.nonce, result=d.then()))
            except ServingError as exc:
                out.append(self.reply(d.nonce, ok=False, status=exc.status, message=exc.message))
        return out

    # ------------------------------------------------------------- pausing
    def _pause(self, nonce: int, mode: Any, then: Callable[[], Any]):
        if mode not in PAUSE_MODES:
            raise BadRequest(f"unknown pause mode {mode!r}: expected one of {', '.join(PAUSE_MODES)}", "mode")
        self.paused = mode
        if mode == "abort":
            self.server.abort_all()
        elif mode == "wait" and (self.server.tracks or self.engine.has_unfinished()):
            return _Deferred(nonce, then)
        return then()

    def op_pause(self, req: ControlRequest):
        clear = req.args.get("clear_cache", True)

        def done():
            if clear and self.paused != "keep":
                self.engine.rl.reset_prefix_cache()
            return None

        return self._pause(req.nonce, req.args.get("mode", "abort"), done)

    def op_resume(self, req: ControlRequest):
        s = self.session
        if s is not None and s.written:
            raise BadRequest(f"a weight update is in progress ({s.written} tensor(s) written in place since "
                             f"/start_weight_update): POST /finish_weight_update before /resume", None)
        self.paused = None

    def op_reset_prefix_cache(self, req: ControlRequest):
        return {"success": self.engine.rl.reset_prefix_cache()}

    def op_sleep(self, req: ControlRequest):
        level = req.args.get("level", 1)
        if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level <= 2:
            raise BadRequest(f"sleep level must be 0, 1 or 2, got {level!r}", "level")
        if level >= 1:
            self.engine.rl.require_single_rank("sleep mode")
        return self._pause(req.nonce, req.args.get("mode", "abort"), lambda: self.engine.rl.sleep(level))

    def op_wake_up(self, req: ControlRequest):
        tags = req.args.get("tags")
        fully_awake = self.engine.rl.wake_up(tags)
        if fully_awake:
            self.paused = None  # vLLM resumes scheduling once everything is resident again
        return {"fully_awake": fully_awake}

    def op_is_sleeping(self, req: ControlRequest):
        # vLLM: a paused scheduler counts as sleeping (sleep level 0).
        return {"is_sleeping": self.engine.rl.is_asleep or self.paused is not None}

    # ------------------------------------------------------ weight transfer
    def op_init_weight_transfer_engine(self, req: ControlRequest):
        from common.dist_weight_transfer import DistInitInfo, WeightReceiver

        self.engine.rl.require_single_rank("weight transfer")
        try:
            info = DistInitInfo.from_dict(req.args.get("init_info"))
        except ValueError as exc:
            raise BadRequest(str(exc), "init_info") from None
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        try:
            self.receiver = WeightReceiver(info, self.server.rank, self.engine.rl.device)
        except ValueError as exc:
            raise BadRequest(str(exc), "init_info") from None
        except Exception as exc:  # rendezvous timeout, unreachable store
            raise BadRequest(f"could not join the weight-transfer group at {info.master_address}:"
                             f"{info.master_port}: {exc}", "init_info") from None

    def op_shutdown_weight_transfer_engine(self, req: ControlRequest):
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None

    def op_start_weight_update(self, req: ControlRequest):
        self.engine.rl.weights  # refuses TP>1 / released weights now rather than at the first bucket
        if self.session is not None and self.session.staged:
            log.warning("start_weight_update: dropping %d staged tensor(s) of an unfinished update",
                        len(self.session.staged))
        lineage = self.engine.rl.disk_lineage
        self.session = _UpdateSession(lineage_before=list(lineage) if lineage is not None else None)

    def op_update_weights(self, req: ControlRequest, payload: list):
        if self.session is not None and self.session.failed:
            raise BadRequest(f"an earlier bucket of this update was refused ({self.session.failed}): "
                             f"POST /start_weight_update to start over", "update_info")
        info = req.args.get("update_info")
        if isinstance(info, list):  # vLLM accepts a list of per-bucket payloads
            if payload:
                raise BadRequest("a list update_info cannot carry tensor frames", "update_info")
            for item in info:
                self.op_update_weights(ControlRequest(req.nonce, req.op, {"update_info": item}), [])
            return None
        if not isinstance(info, dict):
            raise BadRequest("update_info must be a JSON object", "update_info")
        engine = self.engine
        if "path" in info:
            path = info["path"]
            if not isinstance(path, str) or not os.path.isdir(path):
                raise BadRequest(f"update_info.path {path!r} is not a directory on the worker", "update_info")
            tensors = engine.rl.read_checkpoint(path)
            self._apply(tensors, from_disk=path)
            # complete: every weight of the model, so the folder alone reproduces them
            return {"tensors": len(tensors), "complete": engine.rl.weights.spec.keys() <= tensors.keys()}
        entries = self._entries(info)
        if payload:
            try:
                received = dict(tensor_frames.decode_frames(entries, payload))
            except ValueError as exc:
                raise BadRequest(str(exc), "update_info") from None
        else:
            if self.receiver is None:
                raise BadRequest("no weight-transfer group: POST /init_weight_transfer_engine first "
                                 "(or send the tensors with the direct client)", None)
            packed, buffer_bytes = info.get("packed"), info.get("packed_buffer_size_bytes")
            if packed is not None and not isinstance(packed, bool):
                raise BadRequest("update_info.packed must be a boolean", "update_info")
            if buffer_bytes is not None and not (isinstance(buffer_bytes, int) and not isinstance(buffer_bytes, bool)
                                                 and buffer_bytes > 0):
                raise BadRequest("update_info.packed_buffer_size_bytes must be a positive integer", "update_info")
            stream = self.receiver.receive(entries, packed, buffer_bytes)
            if self.paused is None:
                # Not paused (TRL's VLLMClient never pauses): the engine thread receives the
                # whole bucket, so no step runs meanwhile (vLLM applies it between steps too);
                # then it is staged in the open update, or written at once without one, so no
                # step ever sees half an update.
                self._apply(dict(stream), from_disk=None)
                return {"tensors": len(entries)}
            for name, tensor in stream:
                # paused: in place, one tensor at a time
                engine.rl.write_weights({name: tensor}, more_to_come=self.session is not None)
                if self.session is not None:
                    self.session.written += 1
            if self.session is not None:
                self.session.over_wire = True
            return {"tensors": len(entries)}
        self._apply(received, from_disk=None)
        return {"tensors": len(entries)}

    def _entries(self, info: dict) -> list:
        try:
            names, dtypes, shapes = info["names"], info["dtype_names"], info["shapes"]
        except KeyError as exc:
            raise BadRequest(f"update_info lacks {exc.args[0]!r} (expected names, dtype_names, shapes, "
                             f"or path)", "update_info") from None
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise BadRequest("update_info names, dtype_names and shapes must be lists", "update_info")
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest(f"update_info lists differ in length: {len(names)} names, {len(dtypes)} "
                             f"dtype_names, {len(shapes)} shapes", "update_info")
        if len(set(names)) != len(names):
            raise BadRequest("update_info names a tensor twice", "update_info")
        if not all(isinstance(s, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                               for d in s) for s in shapes):
            raise BadRequest("update_info shapes must be lists of non-negative integers", "update_info")
        return self.engine.rl.weights.check(zip(names, dtypes, shapes))

    def _apply(self, tensors: dict, from_disk: Optional[str]) -> None:
        """One bucket: staged in an open update unless paused; written at once otherwise."""
        s = self.session
        if s is None or self.paused is not None:
            self.engine.rl.write_weights(tensors, from_disk=from_disk, more_to_come=s is not None)
            if s is not None:
                s.written += len(tensors)
        else:
            s.staged.update(tensors)  # views of the received frames: kept alive, not copied
        if s is not None:
            if from_disk is None:
                s.over_wire = True
            elif s.from_disk is None and not s.over_wire:
                s.from_disk = from_disk

    def op_prepare_weight_update(self, req: ControlRequest):
        """Phase one of a pool-wide finish (the broker's): can this rank commit?  Changes nothing."""
        s = self._finishable(req)
        if s.failed:
            raise BadRequest(f"a bucket of this update was refused ({s.failed})", None)
        return {"staged": len(s.staged), "written": s.written}

    def _finishable(self, req: ControlRequest) -> _UpdateSession:
        version = req.args.get("weight_version")
        if version is not None and (not isinstance(version, str) or not version):
            raise BadRequest("weight_version must be a non-empty string", "weight_version")
        if self.session is None:
            raise BadRequest("no weight update in progress: POST /start_weight_update first", None)
        return self.session

    def op_abort_weight_update(self, req: ControlRequest):
        """Drop the open update (another rank refused it): staged tensors go; tensors written
        in place (while paused) are undone by reloading the checkpoints the weights came from.
        When they came over the wire that is impossible: the rank then labels its weights as
        partial, so the broker holds it out of dispatch until it gets the weights again."""
        s, self.session = self.session, None
        if s is None:
            return {"dropped": 0, "restored": True}
        restored = True
        if s.written:
            restored = False
            if s.lineage_before is not None:
                try:
                    for path in s.lineage_before:
                        self.engine.rl.write_weights(self.engine.rl.read_checkpoint(path), from_disk=path,
                                                  more_to_come=True)
                    restored = True
                except ServingError as exc:
                    log.error("abort_weight_update: cannot restore the weights from %s: %s", s.lineage_before,
                              exc.message)
            self.engine.rl.end_weight_writes()
            if not restored:
                self.engine.rl.set_weight_version(f"{self.engine.rl.weight_version}+partial-update")
        log.info("weight update dropped: %d staged tensor(s), %d written in place (%s)", len(s.staged), s.written,
                 "restored" if restored else "NOT restored")
        return {"dropped": len(s.staged) + s.written, "restored": restored}

    def op_finish_weight_update(self, req: ControlRequest):
        version = req.args.get("weight_version")
        s = self._finishable(req)
        if s.failed:
            self.engine.rl.end_weight_writes()
            self.session = None if not s.written else s
            raise BadRequest(f"a bucket of this update was refused ({s.failed}); nothing staged was applied: "
                             f"start over with /start_weight_update", None)
        if s.staged:
            self.engine.rl.write_weights(s.staged, from_disk=s.from_disk if not s.over_wire else None)
        self.engine.rl.end_weight_writes()
        self.session = None
        if version is not None:
            self.engine.rl.set_weight_version(version)
        return {"tensors": s.written + len(s.staged)}

    def op_load_lora_adapter(self, req: ControlRequest):
        a = req.args
        self._lora().load(a.get("lora_name") or "", a.get("lora_path") or "", bool(a.get("load_inplace")))

    def op_unload_lora_adapter(self, req: ControlRequest):
        self._lora().unload(req.args.get("lora_name") or "")

    def _lora(self):
        """The engine's LoRA component (refused when LoRA is off)."""
        lora = self.engine.lora
        if lora is None:
            raise BadRequest("LoRA is not enabled on this server (start it with --enable-lora)", "lora_name")
        return lora

    def op_update_weight_version(self, req: ControlRequest):
        self.engine.rl.set_weight_version(req.args.get("new_version"))

    def op_reload_weights(self, req: ControlRequest):
        """Broker replay for a (re)started worker: the pool's disk updates, then its version."""
        paths = req.args.get("paths") or []
        for path in paths:
            self.engine.rl.write_weights(self.engine.rl.read_checkpoint(path), from_disk=path)
        self.engine.rl.set_weight_version(req.args.get("weight_version"))

    def op_weight_checker(self, req: ControlRequest):
        action = req.args.get("action")
        if action == "reset":
            self.engine.rl.zero_weights()
            return None
        if action not in ("checksum", "compare"):
            raise BadRequest(f"unknown weight_checker action {action!r}: expected checksum, reset or compare",
                             "action")
        return {"checksums": self.engine.rl.weight_checksums(f"dp{self.server.rank}:pp0:pcp0:tp0:")}
