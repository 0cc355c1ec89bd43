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

from dataclasses import dataclass

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

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
