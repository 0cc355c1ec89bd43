"""The per-step batch layout: built once on the host by ``StepLayout.build`` (the
only builder: the model runner, the tensor-parallel followers and the tests all use
it), moved to the device by ``StepLayout.to_device``, read by every attention layer.

A step runs a flat batch of T new tokens belonging to B sequences.  Sequence i
contributes ``query_lens[i]`` new tokens (a prefill chunk, or 1 for decode) that
are appended after ``context_lens[i]`` tokens already in its KV blocks, so after
the step it holds ``seq_lens[i] = context_lens[i] + query_lens[i]`` tokens.
Tokens of sequence i occupy rows ``query_start_loc[i]:query_start_loc[i+1]`` of
the flat batch.  ``slot_mapping[t]`` is the flat KV slot
(``block_id * block_size + offset``) where token t's K/V is written.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B+1] int32, device
    seq_lens: torch.Tensor  # [B] int32, device
    context_lens: torch.Tensor  # [B] int32, device
    slot_mapping: torch.Tensor  # [T] int64, device
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, device, padded with 0
    # Host copies: backends plan with these without device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    context_lens_cpu: Optional[list[int]] = None
    positions: Optional[torch.Tensor] = None  # [T] int64, device: context_lens[i] + j
    # The backend's per-step plan (``AttentionBackend.plan``), computed once and read
    # by every layer; None for backends that plan nothing.
    plan: Any = field(default=None, repr=False, compare=False)
    # Bidirectional spans (Gemma 3's images): sequence index -> token ranges [lo, hi) within
    # which every query sees every key (the causal mask opened there).  torch SDPA builds
    # that mask (the native CPU backend hands such steps to it); the selector refuses the
    # CUDA kernels' backends for such models.
    attn_spans: Optional[dict[int, list[tuple[int, int]]]] = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_cpu))

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


ToDevice = Callable[[np.ndarray, str], torch.Tensor]


@dataclass
class StepLayout:
    """Host (numpy) arrays of one step: what a step is, independent of any device.
    Small enough to broadcast to tensor-parallel followers as is."""

    input_ids: np.ndarray  # [T] int64
    query_lens: np.ndarray  # [B] int64
    context_lens: np.ndarray  # [B] int64
    block_tables: np.ndarray  # [B, W] int32, rows padded with 0
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    block_size: int
    attn_spans: Optional[dict[int, list[tuple[int, int]]]] = None  # AttentionMetadata.attn_spans

    @classmethod
    def build(cls, query_lens: Sequence[int] | np.ndarray, context_lens: Sequence[int] | np.ndarray,
              block_tables: Sequence[Sequence[int]] | np.ndarray, block_size: int, *,
              input_ids: Optional[np.ndarray] = None, table_width: Optional[int] = None,
              check: bool = True) -> "StepLayout":
        """Layout from per-sequence lengths and block id lists.

        ``block_tables[i]`` lists the KV block ids of sequence i in order and must
        cover its ``context_lens[i] + query_lens[i]`` tokens (or is row i of a padded
        [B, W] int32 array, taken as is: no coverage check); ``table_width`` pads
        every row to a fixed width (CUDA-graph buffers).  ``input_ids`` defaults to
        zeros (tests that only exercise attention).  Vectorised numpy: a few tens
        of microseconds for a typical batch.
        """
        q = np.asarray(query_lens, dtype=np.int64)
        c = np.asarray(context_lens, dtype=np.int64)
        num_seqs = len(q)
        if not (len(c) == len(block_tables) == num_seqs) or num_seqs == 0:
            raise ValueError(
                f"query_lens, context_lens and block_tables need the same non-zero length, got "
                f"{num_seqs}, {len(c)}, {len(block_tables)}")
        if check and ((q < 1).any() or (c < 0).any()):
            raise ValueError("query_lens must be >= 1 and context_lens >= 0")
        s = q + c
        if isinstance(block_tables, np.ndarray) and block_tables.ndim == 2:
            # Rows already padded (the runner's persistent batch gathers them): used as is,
            # widened to ``table_width``; the caller vouches for their coverage.
            table = block_tables.astype(np.int32, copy=False)
            if table_width and table_width > table.shape[1]:
                table = np.pad(table, ((0, 0), (0, table_width - table.shape[1])))
            check = False
        else:
            width = table_width or max(1, max(len(bt) for bt in block_tables))
            table = np.zeros((num_seqs, width), dtype=np.int32)
            for i, bt in enumerate(block_tables):
                table[i, :len(bt)] = bt
        if check:
            have = np.fromiter((len(bt) for bt in block_tables), dtype=np.int64, count=num_seqs)
            short = np.flatnonzero(have * block_size < s)
            if len(short):
                i = int(short[0])
                raise ValueError(f"sequence {i} holds {s[i]} tokens but its block table has only "
                                 f"{have[i]} blocks of {block_size}")
        num_tokens = int(q.sum())
        cu = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q, out=cu[1:])
        # Token t belongs to sequence seq_of[t] and sits at position context + (t - start).
        seq_of = np.repeat(np.arange(num_seqs), q)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu[:-1] - c, q)
        slots = (table[seq_of, positions // block_size].astype(np.int64) * block_size
                 + positions % block_size)
        if input_ids is None:
            input_ids = np.zeros(num_tokens, dtype=np.int64)
        return cls(input_ids=input_ids, query_lens=q, context_lens=c, block_tables=table,
                   positions=positions, slot_mapping=slots, block_size=block_size)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def query_start_loc(self) -> np.ndarray:
        cu = np.zeros(len(self.query_lens) + 1, dtype=np.int64)
        np.cumsum(self.query_lens, out=cu[1:])
        return cu

    def to_device(self, device: torch.device | str = "cpu",
                  to_device: Optional[ToDevice] = None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) on ``device``.  ``to_device(array, name)``
        overrides the copy (the runner stages CUDA copies through pinned buffers)."""
        if to_device is None:
            def to_device(a: np.ndarray, _name: str) -> torch.Tensor:
                return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        seq_lens = self.context_lens + self.query_lens
        positions = to_device(self.positions, "positions")
        attn = AttentionMetadata(
            query_start_loc=to_device(self.query_start_loc.astype(np.int32), "query_start_loc"),
            seq_lens=to_device(seq_lens.astype(np.int32), "seq_lens"),
            context_lens=to_device(self.context_lens.astype(np.int32), "context_lens"),
            slot_mapping=to_device(self.slot_mapping, "slot_mapping"),
            block_tables=to_device(self.block_tables, "block_tables"),
            query_lens_cpu=self.query_lens.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            max_query_len=int(self.query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            context_lens_cpu=self.context_lens.tolist(),
            positions=positions,
            attn_spans=self.attn_spans,
        )
        return to_device(self.input_ids, "input_ids"), positions, attn


def build_attention_metadata(query_lens: Sequence[int], context_lens: Sequence[int],
                             block_tables: Sequence[Sequence[int]], block_size: int,
                             device: torch.device | str = "cpu") -> AttentionMetadata:
    """Metadata only (attention-level tests and benchmarks): ``StepLayout.build`` then
    ``to_device``, the same path the model runner takes."""
    return StepLayout.build(query_lens, context_lens, block_tables, block_size).to_device(device)[2]
