"""Rank 0 drives the tensor-parallel followers; each follower mirrors its model runner.

Rank 0 broadcasts a small int64 header (op + a few integers) and, for a step, the
step's host layout packed into one int64 buffer over the gloo group; followers
rebuild the same ``StepLayout``, make their own device tensors and run the same
forward, meeting rank 0 in every all-reduce / all-gather of the model.  Ops mirror
what rank 0's runner does that involves the model: steps, logits (the vocabulary
gather), KV sizing, KV allocation and CUDA-graph capture.  A follower whose rank 0
dies sees the broadcast fail and exits; followers are daemonic as well.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from worker.engine.attention.metadata import StepLayout
from worker.engine.component import EngineComponent
from worker.engine.config import EngineConfig
from worker.engine.models.config import ModelConfig
from worker.engine.parallel.sharding import expert_shards, head_shard, split
from worker.engine.parallel.state import destroy_tensor_parallel, get_tp, init_tensor_parallel
from worker.engine.runner.hooks import LocalRun

log = logging.getLogger(__name__)

OP_STOP, OP_STEP, OP_LOGITS, OP_PROFILE, OP_ALLOC, OP_CAPTURE = range(6)
_HEADER = 8  # op, payload length, then up to six integers


def check_shardable(mc: ModelConfig, world: int) -> None:
    """Refuse a size the model cannot be split into, before any process starts."""
    if world > 1:
        if mc.is_multimodal:
            lm_only = getattr(mc.family.model_class(), "serves_language_model_only", False)
            raise ValueError(f"{mc.architecture}: tensor parallelism of vision-language models is not "
                             f"implemented; serve it with --tensor-parallel-size 1"
                             + (" or as its language model alone (--limit-mm-per-prompt '{\"image\": 0}': "
                                "image input refused)" if lm_only else ""))
        if mc.moe is not None:  # experts are split along their intermediate dimension (models/moe.py)
            expert_shards(mc.moe, 0, world)
        if not mc.family.tensor_parallel:  # the registry says which families shard
            raise ValueError(f"{mc.architecture}: tensor parallelism of this model family is not implemented; "
                             f"serve it with --tensor-parallel-size 1")
        head_shard(mc.num_attention_heads, mc.num_key_value_heads, 0, world)
        split(mc.intermediate_size, 0, world, "intermediate_size")


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    dev = config.resolved_device
    return torch.device("cuda", dev.index + rank) if dev.type == "cuda" else dev


def pack_layout(layout: StepLayout) -> tuple[list[int], np.ndarray]:
    b, w = layout.block_tables.shape
    buf = np.concatenate([layout.input_ids, layout.query_lens, layout.context_lens, layout.positions,
                          layout.slot_mapping, layout.block_tables.reshape(-1).astype(np.int64)])
    return [layout.num_tokens, b, w, layout.block_size], buf


def unpack_layout(ints: Sequence[int], buf: np.ndarray) -> StepLayout:
    t, b, w, block_size = ints[:4]
    parts = np.split(buf, np.cumsum([t, b, b, t, t]))
    return StepLayout(input_ids=parts[0], query_lens=parts[1], context_lens=parts[2], positions=parts[3],
                      slot_mapping=parts[4], block_tables=parts[5].astype(np.int32).reshape(b, w),
                      block_size=block_size)


def _broadcast_header(op: int, ints: Sequence[int] = (), payload_len: int = 0) -> None:
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0], header[1] = op, payload_len
    header[2:2 + len(ints)] = torch.tensor(list(ints), dtype=torch.int64)
    dist.broadcast(header, 0, group=get_tp().cpu_group)


def _receive() -> tuple[int, list[int], Optional[np.ndarray]]:
    header = torch.empty(_HEADER, dtype=torch.int64)
    dist.broadcast(header, 0, group=get_tp().cpu_group)
    op, n = int(header[0]), int(header[1])
    payload = None
    if n:
        buf = torch.empty(n, dtype=torch.int64)
        dist.broadcast(buf, 0, group=get_tp().cpu_group)
        payload = buf.numpy()
    return op, header[2:].tolist(), payload


def min_across_ranks(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=get_tp().cpu_group)
    return int(t.item())


def agree_on_graphs(runner) -> None:
    """After a lockstep capture: decode runs graphed only if every rank captured
    (rank 0 and the followers must take the same path at every step)."""
    if not min_across_ranks(int(runner.has_cuda_graphs)):
        runner.drop_cuda_graphs()


class TPFollower(LocalRun):
    """A follower rank's runner hook (``runner.hooks.ParallelHook``): its runner's calls
    come from ``serve_follower``, in lockstep with rank 0 (which also agrees on the
    captured graphs after a capture)."""

    lockstep = True


class TPLeader:
    """Rank 0's handle on its followers, and its runner's hook
    (``runner.hooks.ParallelHook``): every model call of rank 0's runner is mirrored
    to the followers (sizing, allocation and capture run on every rank in lockstep)."""

    lockstep = True
    broadcasts_inputs = True

    def __init__(self, procs: list, init_dir: str):
        self.procs = procs
        self.init_dir = init_dir
        self._paused = 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A phase every rank runs on its own in lockstep (after one op): no broadcasts."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @property
    def sending(self) -> bool:
        return self._paused == 0

    def send(self, op: int, ints: Sequence[int] = (), payload: Optional[np.ndarray] = None) -> None:
        _broadcast_header(op, ints, 0 if payload is None else len(payload))
        if payload is not None:
            dist.broadcast(torch.from_numpy(np.ascontiguousarray(payload, dtype=np.int64)), 0,
                           group=get_tp().cpu_group)

    def step(self, layout: StepLayout) -> None:
        ints, buf = pack_layout(layout)
        self.send(OP_STEP, ints, buf)

    def logits(self, rows: Sequence[int]) -> None:
        self.send(OP_LOGITS, (), np.asarray(rows, dtype=np.int64))

    # --- the runner's hook ----------------------------------------------------------
    def decide_num_blocks(self, decide: Callable[[], int]) -> int:
        """KV blocks: every rank sizes its own cache (in lockstep) and the smallest count wins."""
        self.send(OP_PROFILE)
        with self.paused():
            return min_across_ranks(decide())

    def before_alloc(self, num_blocks: int, max_model_len: int) -> None:
        if self.sending:
            self.send(OP_ALLOC, (num_blocks, max_model_len))

    def before_step(self, layout: StepLayout) -> None:
        if self.sending:
            self.step(layout)

    def before_logits(self, rows: Sequence[int]) -> None:
        if self.sending:
            self.logits(rows)

    def capture_cuda_graphs(self, runner, capture: Callable[[], None]) -> None:
        if not self.sending:
            capture()
            return
        self.send(OP_CAPTURE)  # every rank captures the same graphs in the same order
        with self.paused():
            capture()
            agree_on_graphs(runner)  # a rank that fell back to eager makes every rank eager

    def shutdown(self, timeout: float = 10.0) -> None:
        try:
            self.send(OP_STOP)
        except Exception:  # a follower already gone: the group is broken, just reap
            log.warning("tensor-parallel followers did not take the stop message")
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.terminate()
                p.join(5)
        destroy_tensor_parallel()
        shutil.rmtree(self.init_dir, ignore_errors=True)


def start_tensor_parallel(config: EngineConfig, device: torch.device) -> Optional[TPLeader]:
    """Start ranks 1..N-1 and join the group as rank 0; None at tensor_parallel_size 1."""
    world = config.tensor_parallel_size
    if world == 1:
        return None
    check_shardable(ModelConfig.from_dir(config.model, language_model_only=config.language_model_only), world)
    if device.type == "cuda" and device.index + world > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {world} from {device} needs {device.index + world} GPUs, "
                         f"{torch.cuda.device_count()} visible")
    init_dir = tempfile.mkdtemp(prefix="tokserve-tp-")
    init_method = f"file://{os.path.join(init_dir, 'rendezvous')}"
    ctx = mp.get_context("spawn")  # a fresh interpreter: no forked CUDA context or OpenMP pool
    procs = [ctx.Process(target=follower_main, args=(config, rank, world, init_method), daemon=True,
                         name=f"tokserve-tp{rank}") for rank in range(1, world)]
    for p in procs:
        p.start()
    init_tensor_parallel(0, world, init_method, device)
    log.info("tensor parallel: %d ranks (%s)", world, "nccl" if device.type == "cuda" else "gloo")
    return TPLeader(procs, init_dir)


def follower_main(config: EngineConfig, rank: int, world: int, init_method: str) -> None:
    from worker.engine.runner.model_runner import ModelRunner
    from worker.engine.loading.model_setup import build_model

    logging.basicConfig(level=logging.WARNING, format=f"tp{rank} %(levelname)s %(name)s: %(message)s")
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif config.num_threads:
        torch.set_num_threads(config.num_threads)
    init_tensor_parallel(rank, world, init_method, device)
    try:
        mc = ModelConfig.from_dir(config.model, language_model_only=config.language_model_only)
        model, backend, _ = build_model(config, mc, device)
        runner = ModelRunner(config, mc, model, config.resolve_max_model_len(mc.max_position_embeddings), backend,
                             device=device)
        runner.set_parallel(TPFollower())
        serve_follower(runner)
    except RuntimeError as e:  # rank 0 went away mid-collective
        log.warning("tensor-parallel rank %d stops: %s", rank, e)
    finally:
        destroy_tensor_parallel()


@torch.inference_mode()
def serve_follower(runner) -> None:
    hidden = None
    while True:
        op, ints, payload = _receive()
        if op == OP_STOP:
            return
        if op == OP_STEP:
            hidden = runner.run_layout(unpack_layout(ints, payload))
        elif op == OP_LOGITS:
            runner.compute_logits(hidden, payload.tolist())
        elif op == OP_PROFILE:
            min_across_ranks(runner.decide_num_blocks())
        elif op == OP_ALLOC:
            runner.set_max_model_len(ints[1])
            runner.allocate_kv_cache(ints[0])
        elif op == OP_CAPTURE:
            runner.capture_cuda_graphs()
            agree_on_graphs(runner)
        else:
            raise RuntimeError(f"unknown tensor-parallel op {op}")


def maybe_start(config: EngineConfig, ctx) -> Optional[TPLeader]:
    """Before the model is built (every rank loads only its shard): the followers, and
    this process as rank 0; None at tensor_parallel_size 1."""
    check_shardable(ctx.model_config, config.tensor_parallel_size)
    return start_tensor_parallel(config, ctx.device)


class TensorParallelRanks(EngineComponent):
    """The engine component of tensor parallelism: the followers stop with the engine
    (last: after every other component closed)."""

    name = "tensor_parallel"

    def __init__(self, leader: TPLeader):
        self.leader: Optional[TPLeader] = leader

    def close(self) -> None:
        if self.leader is not None:
            self.leader.shutdown()
            self.leader = None
