"""The runner's persistent batch: one row per sequence of the last step, kept across
steps (vLLM's ``InputBatch`` / ``BlockTable``, vllm/v1/worker/gpu_input_batch.py and
block_table.py).

Rebuilding a step's block table from every sequence's Python block list costs a numpy
row write per sequence per step; a decode step changes almost nothing of it.  Here
each sequence keeps its row: a step appends only the blocks its sequence grew by, a
sequence joins with its whole list, and the rows of sequences the step does not run
(finished, aborted, preempted, waiting for their turn) are released, as vLLM's
runner drops the requests a step does not schedule from its batch.

Rows are not kept in step order: a step reads its rows through an index array
(``sync``), one gather that also copies them, so the layout the device reads is
frozen while the next step updates the table (async scheduling).

The one rule the block lists must follow (``BlockManager`` does): a sequence's list
only ever grows in place (``append`` / ``extend``); anything else replaces the list
object (``free`` after preemption, a fork's copy).  A row remembers which list object
it mirrors and how much of it, so a replaced list is rewritten whole.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np


class PersistentBatch:
    """Block-table rows of the sequences a step runs, updated incrementally."""

    def __init__(self, max_rows: int, max_blocks_per_seq: int):
        max_rows = max(1, max_rows)
        self.max_blocks_per_seq = max(1, max_blocks_per_seq)
        self.block_table = np.zeros((max_rows, self.max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(max_rows, dtype=np.int64)  # blocks written in each row
        self._counts: list[int] = [0] * max_rows  # the same, as Python ints (read per sequence per step)
        self._lists: list[Any] = [None] * max_rows  # the block list object each row mirrors
        self._seqs: list[Any] = [None] * max_rows  # row -> sequence (None: a free row)
        self._seen = np.full(max_rows, -1, dtype=np.int64)  # the last step that ran each row (-1: free)
        self.row_of: dict[Any, int] = {}  # sequence -> row
        self._free: list[int] = list(range(max_rows - 1, -1, -1))  # lowest row popped first
        self._step = 0

    @property
    def num_rows(self) -> int:
        return len(self.row_of)

    def sync(self, seqs: Sequence[Any]) -> np.ndarray:
        """The rows of ``seqs`` (a step's sequences, in step order), each brought up to
        date with its sequence's blocks; rows of sequences not in ``seqs`` are released."""
        self._step += 1
        step = self._step
        row_of, lists, counts = self.row_of, self._lists, self._counts
        rows: list[int] = []
        joining: list[int] = []
        for seq in seqs:
            row = row_of.get(seq)
            if row is None:
                joining.append(len(rows))
                rows.append(-1)
                continue
            blocks = seq.block_ids
            if lists[row] is not blocks or counts[row] != len(blocks):
                # grown in place: only the new blocks; a replaced list: all of it
                self._write(row, blocks, counts[row] if lists[row] is blocks and counts[row] < len(blocks) else 0)
            rows.append(row)
        if len(row_of) > len(seqs) - len(joining):  # first free the rows of those that left
            known = np.fromiter((r for r in rows if r >= 0), dtype=np.int64, count=len(rows) - len(joining))
            self._seen[known] = step
            self._release_unseen(step)
        for i in joining:
            seq = seqs[i]
            row = rows[i] = self._add(seq)
            self._write(row, seq.block_ids, 0)
        out = np.array(rows, dtype=np.int64)
        self._seen[out] = step
        return out

    def table(self, rows: np.ndarray, width: int | None = None) -> np.ndarray:
        """A copy of the rows' block tables, ``width`` columns (default: the widest row's)."""
        if width is None:
            width = max(1, int(self.num_blocks[rows].max())) if len(rows) else 1
        if width > self.max_blocks_per_seq:
            self._widen(width)
        return self.block_table[rows, :width]

    def blocks_of(self, seq: Any) -> list[int]:
        """The row of a sequence as a list (tests, debugging)."""
        row = self.row_of[seq]
        return self.block_table[row, :self._counts[row]].tolist()

    # --- rows ------------------------------------------------------------------
    def _add(self, seq: Any) -> int:
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.row_of[seq] = row
        self._seqs[row] = seq
        self._lists[row] = None
        return row

    def _write(self, row: int, blocks: list[int], start: int) -> None:
        """Blocks ``start:`` of a sequence's list into its row (the list object is now the row's)."""
        n = len(blocks)
        if n > self.block_table.shape[1]:
            self._widen(n)
        old = self._counts[row]
        if old > n:  # a shorter list replaced the row's: rows stay zero-padded, as the rebuilt layout's
            self.block_table[row, n:old] = 0
        if n > start:
            self.block_table[row, start:n] = blocks[start:] if start else blocks
        self.num_blocks[row] = n
        self._counts[row] = n
        self._lists[row] = blocks

    def _release_unseen(self, step: int) -> None:
        seen = self._seen
        for row in np.flatnonzero((seen >= 0) & (seen != step)).tolist():
            self.release(self._seqs[row])

    def release(self, seq: Any) -> None:
        """Drop a sequence's row (it finished or left the batch); no-op without one."""
        row = self.row_of.pop(seq, None)
        if row is None:
            return
        self._seqs[row] = None
        self._lists[row] = None  # the list is not kept alive by a free row
        self.block_table[row, :self._counts[row]] = 0
        self.num_blocks[row] = 0
        self._counts[row] = 0
        self._seen[row] = -1
        self._free.append(row)

    def _grow(self) -> None:
        """Twice the rows (forked choices join the running set past max_num_seqs)."""
        old = len(self._seqs)
        self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros(old, dtype=np.int64)])
        self._seen = np.concatenate([self._seen, np.full(old, -1, dtype=np.int64)])
        self._lists += [None] * old
        self._seqs += [None] * old
        self._counts += [0] * old
        self._free = list(range(2 * old - 1, old - 1, -1)) + self._free

    def _widen(self, width: int) -> None:
        """Wider rows: a caller's table width past max_blocks_per_seq (a CUDA graph's static width)."""
        table = np.zeros((self.block_table.shape[0], width), dtype=np.int32)
        table[:, :self.block_table.shape[1]] = self.block_table
        self.block_table = table
        self.max_blocks_per_seq = width
