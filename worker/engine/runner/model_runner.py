"""Runs the model for one scheduled step: lays the step's tokens out as a flat batch
(input ids, positions, KV slot mapping, block tables), runs the forward pass under
``torch.inference_mode`` and computes logits only for the rows that need them.

Features (LoRA, images, routing capture, tensor parallelism) are not known here: they
contribute through the small interfaces of ``runner.hooks`` (installed with
``install`` / ``set_parallel``).

Host-side layout is vectorised numpy over the whole batch (no per-token Python);
on CUDA the arrays travel through pinned buffers and decode-only batches replay
CUDA graphs captured per padded batch size.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from worker.engine.attention.backends.base import AttentionBackend
from worker.engine.attention.backends.torch_sdpa import TorchSDPABackend
from worker.engine.attention.metadata import AttentionMetadata, StepLayout
from worker.engine.config import DEFAULT_CPU_KV_CACHE_GB, EngineConfig
from worker.engine.models.llama import kv_bytes_per_block, kv_cache_shape
from worker.engine.runner.persistent_batch import PersistentBatch
from worker.engine.runner.hooks import (LOCAL, InputContributor, KVCacheHook, MemoryProfileHook, ParallelHook,
                                        StepExtras)
from worker.engine.step_plan import ScheduledSeq

log = logging.getLogger(__name__)

_GIB = 1 << 30


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    attn: AttentionMetadata
    num_tokens: int
    layout: StepLayout  # the host arrays the tensors were made from


@dataclass
class RunPlan:
    """A step as the host laid it out, frozen before the device runs it (async
    scheduling plans the next step meanwhile, so nothing here may read the sequences
    again): the batch's host arrays, the contributors' inputs, and the input positions
    whose token is still in flight (filled on the device, see core/inflight.py)."""
    layout: StepLayout
    extras: Optional[StepExtras]
    holes: list[int]  # input positions whose token the step in flight samples
    hole_seqs: list  # ... the sequence each belongs to
    inputs: Optional[StepInputs] = None  # an eager step's tensors and attention plan, made with the plan


def cuda_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (capped at 512), vLLM-style."""
    cap = min(max_num_seqs, 512)
    sizes = [b for b in (1, 2, 4) if b <= cap] + list(range(8, cap + 1, 8))
    if cap not in sizes:
        sizes.append(cap)
    return sorted(set(sizes))


# A block costs a few array entries in the block manager; past this many blocks a
# tiny model on a large GPU would spend seconds and gigabytes of host memory on
# bookkeeping for a cache no batch can fill.
MAX_KV_BLOCKS = 1 << 22


def _cap_blocks(num: int) -> int:
    if num > MAX_KV_BLOCKS:
        log.info("KV cache capped at %d blocks (memory for %d)", MAX_KV_BLOCKS, num)
        return MAX_KV_BLOCKS
    return num


def kv_blocks_for_memory(*, total: int, free: int, activations: int, graph_pool: int, sampler: int,
                         utilization: float, per_block: int, weights_hint: int = 0, vision: int = 0,
                         encoder_cache: int = 0) -> int:
    """KV blocks that fit in ``utilization`` of the device.

    ``total - free`` (measured with the profiling cache freed) is everything already
    on the device: weights, the CUDA context, communication buffers and other
    processes.  The step's activation peak, the graph pool and the sampler's
    temporaries come on top while serving; the rest of the budget is KV cache.

    Vision-language models: ``vision`` is the vision tower's peak on the largest
    batch one call encodes; a step encodes its images before the LM forward, so the
    two peaks do not add up and the larger counts.  ``encoder_cache`` is the image
    embeddings the encoder cache may hold, reserved as a whole.
    """
    budget = int(total * utilization)
    in_use = total - free
    peak = max(activations, vision)
    num = (budget - in_use - peak - graph_pool - sampler - encoder_cache) // per_block
    if num < 1:
        mm = (f", the vision tower {vision / _GIB:.2f} GiB (its peak and the step's do not add up) and the "
              f"encoder cache {encoder_cache / _GIB:.2f} GiB" if vision or encoder_cache else "")
        raise RuntimeError(
            f"no memory left for the KV cache at gpu_memory_utilization={utilization}: of "
            f"{total / _GIB:.2f} GiB, {in_use / _GIB:.2f} GiB are in use (weights ~{weights_hint / _GIB:.2f} GiB, "
            f"the rest CUDA context and other processes), activations need {activations / _GIB:.2f} GiB, "
            f"CUDA graphs {graph_pool / _GIB:.2f} GiB and the sampler {sampler / _GIB:.2f} GiB{mm}; raise "
            f"--gpu-memory-utilization, lower --max-num-batched-tokens / --max-num-seqs, or set "
            f"--kv-cache-memory-bytes")
    return _cap_blocks(int(num))


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: Any, model: torch.nn.Module, max_model_len: int,
                 backend: Optional[AttentionBackend] = None, *, device: Optional[torch.device] = None):
        self.config = config
        self.model_config = model_config
        self.model = model
        self.device = device if device is not None else config.resolved_device
        # Tensor parallelism: the parallel package's hook (rank 0 mirrors model calls to the followers).
        self.parallel: ParallelHook = LOCAL
        self.backend = backend if backend is not None else TorchSDPABackend()
        self.dtype = config.torch_dtype
        # What the KV cache stores: the model dtype, or FP8 under --kv-cache-dtype (half of
        # bf16's bytes per token: twice the tokens in the same memory).
        self.kv_dtype = config.kv_dtype or self.dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.token_budget = config.step_token_budget(max_model_len)
        self.kv_cache: Optional[torch.Tensor] = None
        self.num_blocks = 0
        self.scratch_block = 0
        self.max_blocks_per_seq = config.max_blocks_per_seq(max_model_len)
        self._pinned: dict[str, torch.Tensor] = {}  # CUDA: host staging buffers
        self._copies_done: Optional[torch.cuda.Event] = None
        self._graphs: dict[int, "_DecodeGraph"] = {}
        # With a GraphInputs contributor (LoRA serving): decode steps that carry its inputs.
        self._lora_graphs: dict[int, "_DecodeGraph"] = {}
        self._graph_pool = None
        # Routed experts of every KV slot ([slots, moe layers, top_k]), written by the
        # MoE layers in the forward, read when a sequence finishes (set by routing capture).
        self.routing_store: Optional[torch.Tensor] = None
        self.extra_bytes_per_block = 0  # KV of another model per block (a draft model's): counted in sizing
        self.encoder_cache: Optional[Any] = None  # vision-language models: set by multimodal.MultimodalInputs
        self.hooks: list[Any] = []  # everything installed, in order
        self._contributors: list[InputContributor] = []
        self._graph_inputs: Optional[Any] = None  # the contributor whose inputs decode graphs take
        self._kv_hooks: list[KVCacheHook] = []
        self._profilers: list[MemoryProfileHook] = []
        self._extras: Optional[StepExtras] = None  # the last forward's (its logits rows reuse them)
        # Block tables of the running sequences, kept across steps (persistent_batch.py).
        self.batch = PersistentBatch(config.max_num_seqs, self.max_blocks_per_seq)

    # --- features -----------------------------------------------------------
    def install(self, hook: Any) -> None:
        """Install a feature's hook: an ``InputContributor`` (and ``GraphInputs``), a
        ``KVCacheHook`` and/or a ``MemoryProfileHook`` (see ``runner.hooks``)."""
        self.hooks.append(hook)
        if isinstance(hook, InputContributor):
            self._contributors.append(hook)
            if hasattr(hook, "static_inputs"):
                assert self._graph_inputs is None, "one contributor gives decode graphs static inputs"
                self._graph_inputs = hook
        if isinstance(hook, KVCacheHook):
            self._kv_hooks.append(hook)
        if isinstance(hook, MemoryProfileHook):
            self._profilers.append(hook)

    def set_parallel(self, hook: ParallelHook) -> None:
        """Tensor parallelism: the parallel package's hook for this rank."""
        self.parallel = hook

    def set_max_model_len(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.token_budget = self.config.step_token_budget(max_model_len)
        self.max_blocks_per_seq = self.config.max_blocks_per_seq(max_model_len)

    # --- KV cache ------------------------------------------------------------
    def decide_num_blocks(self) -> int:
        """KV blocks to allocate; under tensor parallelism every rank sizes its own
        cache (in lockstep) and the smallest count wins."""
        return self.parallel.decide_num_blocks(self._decide_num_blocks)

    def _decide_num_blocks(self) -> int:
        cfg = self.config
        per_block = kv_bytes_per_block(self.model_config, self.block_size, self.kv_dtype) + self.extra_bytes_per_block
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if cfg.mm_encoder_only:  # no language-model step ever runs: one sequence's worth keeps the invariants
            return self.max_blocks_per_seq
        if cfg.kv_cache_memory_bytes is not None:
            return _cap_blocks(max(1, cfg.kv_cache_memory_bytes // per_block))
        if cfg.kv_cache_memory_gb is not None:
            return _cap_blocks(max(1, int(cfg.kv_cache_memory_gb * _GIB) // per_block))
        if self.device.type == "cuda":
            return self._profile_cuda_blocks(per_block)
        # CPU: a fixed memory budget, but no more than a full batch of full-length sequences needs.
        needed = cfg.max_num_seqs * self.max_blocks_per_seq
        return max(1, min(int(DEFAULT_CPU_KV_CACHE_GB * _GIB) // per_block, needed))

    def _profile_cuda_blocks(self, per_block: int) -> int:
        """Run the largest step (and, unless eager, capture the largest decode graph)
        against a small temporary cache; vision-language models also run the vision
        tower on its largest batch (the larger peak counts) and reserve a full encoder
        cache.  What remains of ``gpu_memory_utilization`` of the device, after
        everything else on it, is KV cache."""
        dev = self.device
        log.info("profiling GPU memory with a %d-token step to size the KV cache", self.token_budget)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        # The dummy step splits into max_model_len sequences, each wasting < 1 block.
        blocks = -(-self.token_budget // self.block_size) + -(-self.token_budget // self.max_model_len)
        self.allocate_kv_cache(blocks)
        kv_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        before = torch.cuda.memory_allocated(dev)  # weights + the temporary cache
        self._dummy_run(self.token_budget)
        torch.cuda.synchronize(dev)
        activations = torch.cuda.max_memory_allocated(dev) - before
        vision = max((h.profile_peak() for h in self._profilers), default=0)
        graph_pool = self._profile_graph_pool()
        self.kv_cache = None
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        # Sampler temporaries of a full batch: fp32 logits, probabilities, sorted values
        # and int64 sort indices for top-p/top-k, per row of the vocabulary.
        sampler = self.config.max_num_seqs * self.model_config.vocab_size * 24
        encoder_cache = sum(h.profile_reserve() for h in self._profilers)
        return kv_blocks_for_memory(total=total, free=free, activations=activations, graph_pool=graph_pool,
                                    sampler=sampler, utilization=self.config.gpu_memory_utilization,
                                    per_block=per_block, weights_hint=before - kv_bytes, vision=vision,
                                    encoder_cache=encoder_cache)

    def _profile_graph_pool(self) -> int:
        """Memory the CUDA-graph pool takes: the largest decode graph captured once
        (smaller ones share its pool) on the temporary cache, then dropped."""
        if self.config.enforce_eager or not self.backend.supports_cuda_graphs:
            return 0
        if self.parallel.lockstep:  # a lone capture would wait on the other ranks' all-reduces
            log.info("graph-pool memory not profiled under tensor parallelism")
            return 0
        dev = self.device
        size = cuda_graph_batch_sizes(self.config.max_num_seqs)[-1]
        reserved = torch.cuda.memory_reserved(dev)
        try:
            graph = _DecodeGraph.capture(self, size, torch.cuda.graph_pool_handle())
        except Exception as e:  # capture_cuda_graphs will log it and run eager
            log.info("graph-pool profiling skipped: capture failed (%s)", e)
            return 0
        torch.cuda.synchronize(dev)
        used = torch.cuda.memory_reserved(dev) - reserved
        del graph
        torch.cuda.empty_cache()
        return max(used, 0)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """``num_blocks`` usable blocks; on CUDA one more, a scratch block that padded
        rows of a CUDA-graph batch write into (never handed to a sequence)."""
        self.parallel.before_alloc(num_blocks, self.max_model_len)
        mc = self.model_config
        extra = 1 if self.device.type == "cuda" else 0
        self.kv_cache = torch.zeros(kv_cache_shape(mc, num_blocks + extra, self.block_size), dtype=self.kv_dtype,
                                    device=self.device)
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks
        for hook in self._kv_hooks:
            hook.on_kv_allocated(self, num_blocks + extra)

    def routed_experts(self, block_ids: Sequence[int], num_positions: int, start: int = 0) -> np.ndarray:
        """Routed experts of positions ``[start, num_positions)`` of a sequence with
        these blocks: ``[n, moe layers, top_k]``, uint8 (<= 256 experts, as vLLM) or uint16."""
        n = max(num_positions - start, 0)
        positions = np.arange(start, start + n)
        blocks = np.asarray(block_ids, dtype=np.int64)[positions // self.block_size]
        slots = torch.from_numpy(blocks * self.block_size + positions % self.block_size).to(self.device)
        rows = self.routing_store.index_select(0, slots).cpu().numpy()
        return rows if rows.dtype == np.uint8 else rows.astype(np.uint16)

    @property
    def has_cuda_graphs(self) -> bool:
        return bool(self._graphs)

    def drop_cuda_graphs(self) -> None:
        """Decode runs eager from now on (until the next capture)."""
        self._graphs.clear()
        self._lora_graphs.clear()

    def release_kv_cache(self) -> None:
        """Sleep: give the KV cache memory back (CUDA graphs hold its address: dropped too)."""
        self.drop_cuda_graphs()
        self._graph_pool = None
        self.kv_cache = None
        for hook in self._kv_hooks:
            hook.on_kv_released(self)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # --- batch layout ---------------------------------------------------------
    def layout(self, scheduled: Sequence[ScheduledSeq], *, table_width: Optional[int] = None) -> StepLayout:
        """Host arrays of the step (the shared ``StepLayout.build``); every token known."""
        layout, holes, _ = self._layout(scheduled, table_width)
        assert not holes, "a token in flight: lay the step out with plan()"
        return layout

    def _layout(self, scheduled: Sequence[ScheduledSeq], table_width: Optional[int] = None
                ) -> tuple[StepLayout, list[int], list]:
        num_seqs = len(scheduled)
        seqs = [s.seq for s in scheduled]
        # Block tables: the persistent batch's rows (only the blocks a sequence grew by
        # are written), gathered in step order -- a copy, so the step's layout stays
        # frozen while the next step updates the rows.
        rows = self.batch.sync(seqs)
        table = self.batch.table(rows, table_width)
        holes: list[int] = []
        hole_seqs: list = []
        if all(s.num_new_tokens == 1 for s in scheduled):
            # Decode: one input id per sequence, the token at its first uncomputed position.
            query_lens = np.ones(num_seqs, dtype=np.int64)
            ids, starts = [], []
            for t, seq in enumerate(seqs):
                tokens = seq.token_ids
                start = seq.num_computed_tokens
                starts.append(start)
                if start < len(tokens):
                    ids.append(tokens[start])
                else:  # sampled by the step in flight (async scheduling)
                    ids.append(0)
                    holes.append(t)
                    hole_seqs.append(seq)
            input_ids = np.array(ids, dtype=np.int64)
            context_lens = np.array(starts, dtype=np.int64)
        else:
            context_lens = np.fromiter((seq.num_computed_tokens for seq in seqs), dtype=np.int64, count=num_seqs)
            query_lens = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
            input_ids = np.empty(int(query_lens.sum()), dtype=np.int64)
            t = 0
            for s in scheduled:
                seq, n = s.seq, s.num_new_tokens
                start = seq.num_computed_tokens
                if n == 1:
                    if start < len(seq.token_ids):
                        input_ids[t] = seq.token_ids[start]
                    else:  # sampled by the step in flight (async scheduling)
                        input_ids[t] = 0
                        holes.append(t)
                        hole_seqs.append(seq)
                elif s.spec:  # the last token, then the drafts to verify
                    input_ids[t] = seq.token_ids[start]
                    input_ids[t + 1:t + n] = s.spec
                else:
                    # A chunk may end in the token in flight: a choice forked in the step in flight
                    # computes its prompt's partial last block and that token together.
                    known = seq.token_ids[start:start + n]
                    input_ids[t:t + len(known)] = known
                    for hole in range(t + len(known), t + n):
                        input_ids[hole] = 0
                        holes.append(hole)
                        hole_seqs.append(seq)
                t += n
        # The scheduler allocated every sequence's blocks: no coverage check on the hot path.
        layout = StepLayout.build(query_lens, context_lens, table, self.block_size,
                                  input_ids=input_ids, table_width=table_width, check=False)
        return layout, holes, hole_seqs

    def prepare(self, scheduled: Sequence[ScheduledSeq], *, pad_block_table_to: Optional[int] = None) -> StepInputs:
        return self.to_inputs(self.layout(scheduled, table_width=pad_block_table_to))

    def to_inputs(self, layout: StepLayout) -> StepInputs:
        """Device tensors of a layout and the attention backend's plan for it."""
        inputs = self.to_device_only(layout)
        inputs.attn.plan = self.backend.plan(inputs.attn, self.block_size)
        return inputs

    def to_device_only(self, layout: StepLayout) -> StepInputs:
        """Device tensors without a plan (a CUDA-graph replay planned at capture)."""
        if self._copies_done is not None:
            self._copies_done.synchronize()  # the pinned staging buffers are free again
        input_ids, positions, attn = layout.to_device(self.device, self._to_device)
        inputs = StepInputs(input_ids, positions, attn, layout.num_tokens, layout)
        if self.device.type == "cuda":
            self._copies_done = torch.cuda.Event()
            self._copies_done.record()
        return inputs

    def _to_device(self, array: np.ndarray, name: str) -> torch.Tensor:
        """CPU: a zero-copy view.  CUDA: staged through a preallocated pinned buffer
        (one per input kind, grown on demand) and copied asynchronously; ``prepare``
        waits for the previous step's copies before overwriting the buffers."""
        t = torch.from_numpy(array)
        if self.device.type == "cpu":
            return t
        buf = self._pinned.get(name)
        if buf is None or buf.dtype != t.dtype or buf.numel() < t.numel():
            buf = torch.empty(max(t.numel(), 2 * (buf.numel() if buf is not None else 0), 1024),
                              dtype=t.dtype, pin_memory=True)
            self._pinned[name] = buf
        staged = buf[:t.numel()].view(t.shape)
        staged.copy_(t)
        return staged.to(self.device, non_blocking=True)

    # --- execution ------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, scheduled: Sequence[ScheduledSeq]) -> torch.Tensor:
        """Hidden states [T, H] of the step's tokens (the K/V are written to the cache):
        ``run(plan(scheduled))``."""
        return self.run(self.plan(scheduled))

    def plan(self, scheduled: Sequence[ScheduledSeq]) -> RunPlan:
        """The host side of a step: its layout and the installed contributors' inputs.
        Reads the sequences; nothing after it does."""
        layout, holes, hole_seqs = self._layout(scheduled)
        extras = None
        if self._contributors:
            extras = StepExtras()
            for contributor in self._contributors:
                contributor.contribute(scheduled, layout, extras)
        plan = RunPlan(layout, extras, holes, hole_seqs)
        if self.device.type == "cpu" and self.parallel is LOCAL and \
                (extras is None or (extras.lora is None and not extras.eager)):
            # The input tensors (zero-copy views on CPU) and the attention backend's plan
            # are host work too: made here, they overlap the step in flight (async
            # scheduling) instead of following it.  (CUDA stages them through pinned
            # buffers the device side owns: made there.)
            plan.inputs = self.to_inputs(layout)
        return plan

    @torch.inference_mode()
    def run(self, plan: RunPlan, fill: Optional[Callable[[torch.Tensor], None]] = None) -> torch.Tensor:
        """The device side: decode-only steps replay a CUDA graph.  A step the
        contributors mark eager runs without one, one with adapter inputs replays the
        graph set captured with them.  ``fill`` writes the placeholders' input ids
        (``plan.holes``) on the device, before the forward."""
        layout, extras = plan.layout, plan.extras
        self._extras = extras
        if plan.inputs is not None:
            return self.execute(self._filled(plan.inputs, fill))
        if extras is None or (extras.lora is None and not extras.eager):
            return self.run_layout(layout, fill)
        if extras.eager:
            inputs = self._filled(self.to_inputs(layout), fill)
            positions = inputs.positions if extras.positions is None else \
                torch.from_numpy(extras.positions).to(self.device)
            return self.model(inputs.input_ids, positions, inputs.attn, self.kv_cache, extras.lora,
                              **extras.model_kwargs)
        graph = self._graph_for(layout, self._lora_graphs)
        if graph is not None:
            return graph.run(self, layout, extras, fill)
        return self.execute(self._filled(self.to_inputs(layout), fill), extras.lora)

    def run_layout(self, layout: StepLayout, fill: Optional[Callable[[torch.Tensor], None]] = None) -> torch.Tensor:
        """Hidden states of a step given as host arrays (tensor-parallel followers
        enter here with the layout rank 0 broadcast)."""
        if fill is not None and self.parallel.broadcasts_inputs:
            # The other ranks get the step's host arrays: the tokens in flight go in them
            # (a copy: the plan stays frozen).
            layout = replace(layout, input_ids=fill.host_ids(layout.input_ids))
            fill = None
        self.parallel.before_step(layout)
        graph = self._graph_for(layout)
        if graph is not None:
            return graph.run(self, layout, fill=fill)
        return self.execute(self._filled(self.to_inputs(layout), fill))

    @staticmethod
    def _filled(inputs: StepInputs, fill: Optional[Callable[[torch.Tensor], None]]) -> StepInputs:
        if fill is not None:
            fill(inputs.input_ids)
        return inputs

    def execute(self, inputs: StepInputs, lora: Optional[Any] = None) -> torch.Tensor:
        """The forward pass of prepared inputs (``lora``: the step's adapter argument)."""
        if lora is None:
            return self.model(inputs.input_ids, inputs.positions, inputs.attn, self.kv_cache)
        return self.model(inputs.input_ids, inputs.positions, inputs.attn, self.kv_cache, lora)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, rows: Sequence[int], plan: Optional[RunPlan] = None
                       ) -> torch.Tensor:
        """float32 logits [len(rows), V] of the selected batch rows (``plan``: the step's,
        whose contributed inputs the logits rows reuse; default: the last run's)."""
        self.parallel.before_logits(rows)
        n = len(rows)
        if n == hidden.shape[0] and rows == list(range(n)):
            selected = hidden  # every row, in order (a decode step): no gather
        else:
            index = torch.tensor(rows, dtype=torch.long)
            if self.device.type != "cpu":
                index = index.to(self.device, non_blocking=True)
            selected = hidden.index_select(0, index)
        extras = self._extras if plan is None else plan.extras
        lora = None if extras is None or extras.logits_inputs is None else extras.logits_inputs(rows)
        return self.model.compute_logits(selected, lora)

    @torch.inference_mode()
    def _dummy_run(self, num_tokens: int) -> None:
        """A prefill of ``num_tokens`` tokens split into max_model_len sequences (profiling)."""
        scheduled = []
        block = 0
        remaining = num_tokens
        while remaining > 0:
            n = min(remaining, self.max_model_len)
            nb = -(-n // self.block_size)
            seq = _ProfileSeq([0] * n, list(range(block, block + nb)))
            block += nb
            scheduled.append(ScheduledSeq(seq, n))
            remaining -= n
        hidden = self.run_layout(self.layout(scheduled))
        self.model.compute_logits(hidden[:min(num_tokens, self.config.max_num_seqs)])

    # --- CUDA graphs --------------------------------------------------------------
    def capture_cuda_graphs(self) -> None:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return
        # Tensor parallelism: every rank captures the same graphs in the same order.
        self.parallel.capture_cuda_graphs(self, self._capture_cuda_graphs)

    def _capture_cuda_graphs(self) -> None:
        if not self.backend.supports_cuda_graphs:
            log.info("%s attention plans on the host; decode runs without CUDA graphs", self.backend.name)
            return
        if not getattr(self.model, "supports_cuda_graphs", True):
            log.info("model does not support CUDA graphs; running eager")
            return
        sizes = cuda_graph_batch_sizes(self.config.max_num_seqs)
        log.info("capturing CUDA graphs for %d decode batch sizes (1..%d)", len(sizes), sizes[-1])
        started = time.monotonic()
        self._graph_pool = torch.cuda.graph_pool_handle()
        try:
            for bs in reversed(sizes):  # largest first: smaller graphs reuse its pool memory
                self._graphs[bs] = _DecodeGraph.capture(self, bs, self._graph_pool)
                # With LoRA serving, a second set for steps with adapter rows (vLLM's
                # cudagraph_specialize_lora): base-only steps skip the LoRA launches.
                if self._graph_inputs is not None:
                    self._lora_graphs[bs] = _DecodeGraph.capture(self, bs, self._graph_pool, self._graph_inputs)
        except Exception as e:  # a model whose attention can't be captured falls back to eager
            log.warning("CUDA graph capture failed (%s); running decode eagerly", e)
            self._graphs.clear()
            self._lora_graphs.clear()
        torch.cuda.synchronize(self.device)
        if self._graphs:
            log.info("captured %d CUDA graphs in %.1f s", len(self._graphs) + len(self._lora_graphs),
                     time.monotonic() - started)

    def _graph_for(self, layout: StepLayout, graphs: Optional[dict] = None) -> Optional["_DecodeGraph"]:
        graphs = self._graphs if graphs is None else graphs
        if not graphs or layout.num_tokens != len(layout.query_lens):  # decode-only steps only
            return None
        n = len(layout.query_lens)
        for size in sorted(graphs):
            if size >= n:
                return graphs[size]
        return None


class _ProfileSeq:
    """A stand-in sequence of the profiling step: the layout reads only its tokens,
    progress and blocks."""

    __slots__ = ("token_ids", "num_computed_tokens", "block_ids")

    def __init__(self, token_ids: list[int], block_ids: list[int]):
        self.token_ids, self.num_computed_tokens, self.block_ids = token_ids, 0, block_ids


class _DecodeGraph:
    """A captured decode step for a fixed (padded) batch size.

    Static buffers are refilled before each replay; padding rows are 1-token
    sequences living in the runner's scratch block, so they never touch a live
    sequence's KV."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size

    @classmethod
    @torch.inference_mode()
    def capture(cls, runner: ModelRunner, batch_size: int, pool: Any, inputs: Optional[Any] = None
                ) -> "_DecodeGraph":
        """``inputs``: a ``GraphInputs`` contributor; the step applies its static
        adapter argument (each row's LoRA adapter)."""
        self = cls(batch_size)
        dev = runner.device
        width = runner.max_blocks_per_seq
        scratch = runner.scratch_block
        self.input_ids = torch.zeros(batch_size, dtype=torch.long, device=dev)
        self.positions = torch.zeros(batch_size, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((batch_size,), scratch * runner.block_size, dtype=torch.long, device=dev)
        self.block_tables = torch.full((batch_size, width), scratch, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(batch_size, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(batch_size, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(batch_size + 1, dtype=torch.int32, device=dev)
        self.attn = AttentionMetadata(
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens, context_lens=self.context_lens,
            slot_mapping=self.slot_mapping, block_tables=self.block_tables,
            query_lens_cpu=[1] * batch_size, seq_lens_cpu=[runner.max_model_len] * batch_size,
            max_query_len=1, max_seq_len=runner.max_model_len,
            context_lens_cpu=[runner.max_model_len - 1] * batch_size, positions=self.positions)
        model, kv, backend = runner.model, runner.kv_cache, runner.backend
        self.inputs = inputs
        self.lora = None if inputs is None else inputs.static_inputs(batch_size, dev)
        # Warm up outside the graph (lazy initialisations, kernel compilation), then capture.
        self.attn.plan = backend.plan(self.attn, runner.block_size)
        model(self.input_ids, self.positions, self.attn, kv, self.lora)
        torch.cuda.synchronize(dev)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            # The plan is the backend's own, built from the static buffers inside the
            # capture: replays read each row's real length from ``seq_lens``.
            self.attn.plan = backend.plan(self.attn, runner.block_size)
            self.output = model(self.input_ids, self.positions, self.attn, kv, self.lora)
        return self

    def run(self, runner: ModelRunner, layout: StepLayout, extras: Optional[StepExtras] = None,
            fill: Optional[Any] = None) -> torch.Tensor:
        """``extras``: the step's contributed inputs (graphs captured with ``inputs``);
        ``fill``: writes the placeholders' input ids (async scheduling)."""
        n = len(layout.query_lens)
        if extras is not None:
            self.inputs.fill_static(self.lora, extras)
        if layout.block_tables.shape[1] != runner.max_blocks_per_seq:  # the graph's static table width
            table = np.zeros((n, runner.max_blocks_per_seq), dtype=np.int32)
            table[:, :layout.block_tables.shape[1]] = layout.block_tables
            layout.block_tables = table
        inputs = runner.to_device_only(layout)
        self.input_ids[:n].copy_(inputs.input_ids)
        if fill is not None:
            fill(self.input_ids[:n])
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(inputs.attn.slot_mapping)
        self.block_tables[:n].copy_(inputs.attn.block_tables)
        self.seq_lens[:n].copy_(inputs.attn.seq_lens)
        self.context_lens[:n].copy_(inputs.attn.context_lens)
        if n < self.batch_size:  # padding rows: harmless 1-token sequences in the scratch block
            scratch = runner.scratch_block
            self.input_ids[n:].zero_()
            self.positions[n:].zero_()
            self.slot_mapping[n:].fill_(scratch * runner.block_size)
            self.block_tables[n:].fill_(scratch)
            self.seq_lens[n:].fill_(1)
            self.context_lens[n:].zero_()
        self.graph.replay()
        return self.output[:n]
