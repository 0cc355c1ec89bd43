"""Per-step batch layout shared by the model runner (builds it) and the attention
layers (consume it).

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
from typing import Optional, Sequence

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B+1] int32, device
    seq_lens: torch.Tensor  # [B] int32, device
    context_lens: torch.Tensor  # [B] int32, device
    slot_mapping: torch.Tensor  # [T] int64, device
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, device, padded with 0
    # Host copies: the CPU attention path loops/pads with these without syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    # Extensions (optional so hand-built metadata keeps working).
    context_lens_cpu: Optional[list[int]] = None
    positions: Optional[torch.Tensor] = None  # [T] int64, device: context_lens[i] + j
    # Per-step scratch computed once by the attention backend and reused by every
    # layer (e.g. the decode padding mask); never part of the contract.
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_cpu))

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Metadata for one step from plain Python lists.

        ``block_tables[i]`` lists the KV block ids of sequence i in order and must
        cover its ``context_lens[i] + query_lens[i]`` tokens.  Everything is
        computed with numpy on the host and moved to ``device`` in one copy per
        tensor, so building costs a few tens of microseconds for a typical batch.
        """
        num_seqs = len(query_lens)
        if not (len(context_lens) == len(block_tables) == num_seqs) or num_seqs == 0:
            raise ValueError(
                f"query_lens, context_lens and block_tables need the same non-zero length, got "
                f"{num_seqs}, {len(context_lens)}, {len(block_tables)}")
        q = np.asarray(query_lens, dtype=np.int64)
        c = np.asarray(context_lens, dtype=np.int64)
        if (q < 1).any() or (c < 0).any():
            raise ValueError("query_lens must be >= 1 and context_lens >= 0")
        s = q + c
        max_blocks = max(len(bt) for bt in block_tables)
        needed = (s + block_size - 1) // block_size
        table = np.zeros((num_seqs, max(max_blocks, 1)), dtype=np.int64)
        for i, bt in enumerate(block_tables):
            if len(bt) < needed[i]:
                raise ValueError(
                    f"sequence {i} holds {s[i]} tokens but its block table has only {len(bt)} "
                    f"blocks of {block_size}")
            table[i, :len(bt)] = bt
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(q, out=qsl[1:])
        if int(q.max()) == 1:  # decode-only: one token per sequence at position c
            seq_of_token = np.arange(num_seqs)
            positions = c
        else:
            seq_of_token = np.repeat(np.arange(num_seqs), q)
            positions = np.arange(int(qsl[-1])) - qsl[seq_of_token] + c[seq_of_token]
        slots = table[seq_of_token, positions // block_size] * block_size + positions % block_size

        def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

        q_list = q.tolist()
        s_list = s.tolist()
        return cls(
            query_start_loc=dev(qsl, torch.int32),
            seq_lens=dev(s, torch.int32),
            context_lens=dev(c, torch.int32),
            slot_mapping=dev(slots, torch.int64),
            block_tables=dev(table, torch.int32),
            query_lens_cpu=q_list,
            seq_lens_cpu=s_list,
            max_query_len=max(q_list),
            max_seq_len=max(s_list),
            context_lens_cpu=c.tolist(),
            positions=dev(positions, torch.int64),
        )
