"""Runs the model for one scheduled step: lays the step's tokens out as a flat batch
(input ids, positions, KV slot mapping, block tables), runs the forward pass under
``torch.inference_mode`` and computes logits only for the rows that need them.

Host-side layout is vectorised numpy over the whole batch (no per-token Python);
on CUDA the arrays travel through pinned buffers and decode-only batches replay
CUDA graphs captured per padded batch size.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from worker.engine.attn_metadata import AttentionMetadata
from worker.engine.config import DEFAULT_CPU_KV_CACHE_GB, EngineConfig
from worker.engine.models.llama import kv_bytes_per_block
from worker.engine.scheduler import ScheduledSeq

log = logging.getLogger(__name__)

_GIB = 1 << 30


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    attn: AttentionMetadata
    num_tokens: int


def cuda_graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (capped at 512), vLLM-style."""
    cap = min(max_num_seqs, 512)
    sizes = [b for b in (1, 2, 4) if b <= cap] + list(range(8, cap + 1, 8))
    if cap not in sizes:
        sizes.append(cap)
    return sorted(set(sizes))


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: Any, model: torch.nn.Module, max_model_len: int):
        self.config = config
        self.model_config = model_config
        self.model = model
        self.device = config.torch_device
        self.dtype = config.torch_dtype
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
        self._graph_pool = None

    def set_max_model_len(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.token_budget = self.config.step_token_budget(max_model_len)
        self.max_blocks_per_seq = self.config.max_blocks_per_seq(max_model_len)

    # --- KV cache ------------------------------------------------------------
    def decide_num_blocks(self) -> int:
        cfg = self.config
        per_block = kv_bytes_per_block(self.model_config, self.block_size, self.dtype)
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        if cfg.kv_cache_memory_gb is not None:
            return max(1, int(cfg.kv_cache_memory_gb * _GIB) // per_block)
        if self.device.type == "cuda":
            return self._profile_cuda_blocks(per_block)
        # CPU: a fixed memory budget, but no more than a full batch of full-length sequences needs.
        needed = cfg.max_num_seqs * self.max_blocks_per_seq
        return max(1, min(int(DEFAULT_CPU_KV_CACHE_GB * _GIB) // per_block, needed))

    def _profile_cuda_blocks(self, per_block: int) -> int:
        """Run the largest step once; what remains under gpu_memory_utilization is KV cache."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        # The dummy step splits into max_model_len sequences, each wasting < 1 block.
        blocks = -(-self.token_budget // self.block_size) + -(-self.token_budget // self.max_model_len)
        self.allocate_kv_cache(blocks)
        self._dummy_run(self.token_budget)
        torch.cuda.synchronize(self.device)
        # Peak of weights + activations: the temporary cache itself does not count.
        peak = torch.cuda.max_memory_allocated(self.device) - self.kv_cache.numel() * self.kv_cache.element_size()
        self.kv_cache = None
        torch.cuda.empty_cache()
        _free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * self.config.gpu_memory_utilization) - peak
        num = budget // per_block
        if num < 1:
            raise RuntimeError(
                f"no memory left for the KV cache: peak use {peak / _GIB:.2f} GiB of "
                f"{total / _GIB:.2f} GiB at gpu_memory_utilization={self.config.gpu_memory_utilization}")
        return int(num)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """``num_blocks`` usable blocks; on CUDA one more, a scratch block that padded
        rows of a CUDA-graph batch write into (never handed to a sequence)."""
        mc = self.model_config
        extra = 1 if self.device.type == "cuda" else 0
        shape = (2, mc.num_hidden_layers, num_blocks + extra, self.block_size, mc.num_key_value_heads,
                 mc.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks

    # --- batch layout ---------------------------------------------------------
    def prepare(self, scheduled: Sequence[ScheduledSeq], *, pad_block_table_to: Optional[int] = None) -> StepInputs:
        if self._copies_done is not None:
            self._copies_done.synchronize()  # the pinned staging buffers are free again
        num_seqs = len(scheduled)
        query_lens = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=num_seqs)
        context_lens = np.fromiter((s.seq.num_computed_tokens for s in scheduled), dtype=np.int64,
                                   count=num_seqs)
        seq_lens = context_lens + query_lens
        num_tokens = int(query_lens.sum())
        cu = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu[1:])

        input_ids = np.empty(num_tokens, dtype=np.int64)
        width = pad_block_table_to or max(len(s.seq.block_ids) for s in scheduled)
        block_tables = np.zeros((num_seqs, width), dtype=np.int32)
        for i, s in enumerate(scheduled):
            seq = s.seq
            start = seq.num_computed_tokens
            if s.num_new_tokens == 1:
                input_ids[cu[i]] = seq.token_ids[start]
            else:
                input_ids[cu[i]:cu[i + 1]] = seq.token_ids[start:start + s.num_new_tokens]
            block_tables[i, :len(seq.block_ids)] = seq.block_ids

        # Positions and slots of every token at once: token t belongs to sequence seq_of[t].
        seq_of = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu[:-1] - context_lens, query_lens)
        slots = (block_tables[seq_of, positions // self.block_size].astype(np.int64) * self.block_size
                 + positions % self.block_size)

        attn = AttentionMetadata(
            query_start_loc=self._to_device(cu.astype(np.int32), "query_start_loc"),
            seq_lens=self._to_device(seq_lens.astype(np.int32), "seq_lens"),
            context_lens=self._to_device(context_lens.astype(np.int32), "context_lens"),
            slot_mapping=self._to_device(slots, "slot_mapping"),
            block_tables=self._to_device(block_tables, "block_tables"),
            query_lens_cpu=query_lens.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            context_lens_cpu=context_lens.tolist(),
        )
        positions_t = self._to_device(positions, "positions")
        attn.positions = positions_t
        inputs = StepInputs(self._to_device(input_ids, "input_ids"), positions_t, attn, num_tokens)
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
        """Hidden states [T, H] of the step's tokens (the K/V are written to the cache)."""
        graph = self._graph_for(scheduled)
        if graph is not None:
            return graph.run(self, scheduled)
        inputs = self.prepare(scheduled)
        return self.model(inputs.input_ids, inputs.positions, inputs.attn, self.kv_cache)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """float32 logits [len(rows), V] of the selected batch rows."""
        index = torch.tensor(rows, dtype=torch.long)
        if self.device.type != "cpu":
            index = index.to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden.index_select(0, index))

    @torch.inference_mode()
    def _dummy_run(self, num_tokens: int) -> None:
        """A prefill of ``num_tokens`` tokens split into max_model_len sequences (profiling)."""
        from worker.engine.request import EngineSequence as Seq

        scheduled = []
        block = 0
        remaining = num_tokens
        while remaining > 0:
            n = min(remaining, self.max_model_len)
            seq = Seq.__new__(Seq)  # bare: prepare() only reads tokens, progress and blocks
            seq.token_ids = [0] * n
            seq.num_computed_tokens = 0
            nb = -(-n // self.block_size)
            seq.block_ids = list(range(block, block + nb))
            block += nb
            scheduled.append(ScheduledSeq(seq, n))
            remaining -= n
        inputs = self.prepare(scheduled)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn, self.kv_cache)
        self.model.compute_logits(hidden[:min(num_tokens, self.config.max_num_seqs)])

    # --- CUDA graphs --------------------------------------------------------------
    def capture_cuda_graphs(self) -> None:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return
        if not getattr(self.model, "supports_cuda_graphs", True):
            log.info("model does not support CUDA graphs; running eager")
            return
        sizes = cuda_graph_batch_sizes(self.config.max_num_seqs)
        self._graph_pool = torch.cuda.graph_pool_handle()
        try:
            for bs in reversed(sizes):  # largest first: smaller graphs reuse its pool memory
                self._graphs[bs] = _DecodeGraph.capture(self, bs, self._graph_pool)
        except Exception as e:  # a model whose attention can't be captured falls back to eager
            log.warning("CUDA graph capture failed (%s); running decode eagerly", e)
            self._graphs.clear()
        torch.cuda.synchronize(self.device)

    def _graph_for(self, scheduled: Sequence[ScheduledSeq]) -> Optional["_DecodeGraph"]:
        if not self._graphs or any(s.num_new_tokens != 1 for s in scheduled):
            return None
        n = len(scheduled)
        for size in sorted(self._graphs):
            if size >= n:
                return self._graphs[size]
        return None


class _DecodeGraph:
    """A captured decode step for a fixed (padded) batch size.

    Static buffers are refilled before each replay; padding rows are 1-token
    sequences living in the runner's scratch block, so they never touch a live
    sequence's KV."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size

    @classmethod
    @torch.inference_mode()
    def capture(cls, runner: ModelRunner, batch_size: int, pool: Any) -> "_DecodeGraph":
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
        model, kv = runner.model, runner.kv_cache
        # Warm up outside the graph (lazy initialisations), then capture.
        model(self.input_ids, self.positions, self.attn, kv)
        torch.cuda.synchronize(dev)
        # Per-step index tensors the attention caches on the metadata must be computed
        # inside the graph (from the static buffers), not reused from the warm-up.
        self.attn.cache.clear()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = model(self.input_ids, self.positions, self.attn, kv)
        return self

    def run(self, runner: ModelRunner, scheduled: Sequence[ScheduledSeq]) -> torch.Tensor:
        n = len(scheduled)
        inputs = runner.prepare(scheduled, pad_block_table_to=runner.max_blocks_per_seq)
        self.input_ids[:n].copy_(inputs.input_ids)
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
