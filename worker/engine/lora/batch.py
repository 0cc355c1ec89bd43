"""One step's token -> adapter-slot mapping and the batched LoRA products.

``y += (x @ A[slot].T) @ B[slot].T`` per row, for rows of many adapters (and rows
of none) in one forward, as punica's SGMV: rows are grouped by slot once per step
and every projection reuses the grouping.

CPU: one shrink matmul and one expand matmul per (slot, sub-module) on the slot's
rows (a contiguous run when its sequences are adjacent, else gathered and
scattered back), in float32 whatever the model's dtype, as peft (``_add_rows``).
CUDA (and Triton's interpreter): the segmented kernels of kernels/triton/lora.py,
one shrink launch and one expand launch per sub-module.

A CUDA-graph decode step uses a static batch (``LoRABatch.static``): fixed-shape
device buffers, one segment per slot (empty for slots the step does not use) and a
grid sized for the whole padded batch, refilled by ``fill`` before each replay.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import numpy as np
import torch

from worker.engine.lora.weights import EmbeddingLoRA, LoRAGroup

Rows = Union[slice, torch.Tensor]


@dataclass
class LoRABatch:
    # CPU path: (slot, rows) per slot present
    groups: list[tuple[int, Rows]]
    num_tokens: int
    # Triton path: token ids sorted by slot, and per active slot its start / count there
    sorted_tokens: Optional[torch.Tensor] = None  # [T'] int32
    slot_ids: Optional[torch.Tensor] = None  # [G] int32
    seg_start: Optional[torch.Tensor] = None  # [G] int32
    seg_len: Optional[torch.Tensor] = None  # [G] int32
    max_seg_len: int = 0
    use_triton: bool = False
    token_slots: Optional[np.ndarray] = None  # [T] slot of every token (-1: base), on the host
    device: torch.device = torch.device("cpu")
    # Modules any adapter of the step targets: a group none of them targets is skipped.
    targets: frozenset = field(default_factory=frozenset)
    token_slot_dev: Optional[torch.Tensor] = None  # static batches: [T] slot per token, >= 0 (int32)
    _packed: Optional[torch.Tensor] = None  # static batches: the buffer the device tensors view

    @classmethod
    def static(cls, batch_size: int, num_slots: int, device: torch.device) -> "LoRABatch":
        """A graph-mode batch for ``batch_size`` decode rows: nothing but device
        buffers of fixed shape, so a captured step replays whatever the adapters."""
        packed = torch.zeros(2 * batch_size + 2 * num_slots, dtype=torch.int32, device=device)
        sorted_tokens, token_slot = packed[:batch_size], packed[batch_size:2 * batch_size]
        seg_start, seg_len = packed[2 * batch_size:2 * batch_size + num_slots], packed[2 * batch_size + num_slots:]
        batch = cls([], batch_size, sorted_tokens, torch.arange(num_slots, dtype=torch.int32, device=device),
                    seg_start, seg_len, batch_size, True, token_slots=np.full(batch_size, -1, dtype=np.int64),
                    device=device, token_slot_dev=token_slot, _packed=packed)
        return batch

    def fill(self, token_slots: np.ndarray) -> None:
        """Load a step's token -> slot map (its first ``len(token_slots)`` rows; the
        rest are padding of no adapter) into a static batch's buffers, one copy."""
        t, num_slots = self.num_tokens, self.slot_ids.numel()
        padded = np.full(t, -1, dtype=np.int64)
        padded[:len(token_slots)] = token_slots
        order = np.argsort(padded, kind="stable")
        sorted_slots = padded[order]
        slots = np.arange(num_slots)
        starts = np.searchsorted(sorted_slots, slots, side="left")
        ends = np.searchsorted(sorted_slots, slots, side="right")
        host = np.concatenate([order, np.maximum(padded, 0), starts, ends - starts]).astype(np.int32)
        self._packed.copy_(torch.from_numpy(host), non_blocking=False)
        self.token_slots = padded

    @classmethod
    def build(cls, token_slots: np.ndarray, device: torch.device, use_triton: bool,
              targets: frozenset = frozenset()) -> Optional["LoRABatch"]:
        """From the slot of every token of the step (-1: base model); None when no
        token uses an adapter.  ``targets``: the modules the present adapters target
        (empty: assume every module)."""
        batch = cls._build(token_slots, device, use_triton)
        if batch is not None:
            batch.token_slots, batch.targets, batch.device = token_slots, targets, device
        return batch

    def rows(self, rows: np.ndarray) -> Optional["LoRABatch"]:
        """The batch of a subset of the step's rows (the logits rows, for lm_head)."""
        return LoRABatch.build(self.token_slots[rows], self.device, self.use_triton, self.targets)

    def targets_any(self, modules: tuple[str, ...]) -> bool:
        return not self.targets or any(m in self.targets for m in modules)

    @classmethod
    def _build(cls, token_slots: np.ndarray, device: torch.device, use_triton: bool) -> Optional["LoRABatch"]:
        t = len(token_slots)
        present = np.unique(token_slots)
        present = present[present >= 0]
        if not len(present):
            return None
        if use_triton:
            order = np.argsort(token_slots, kind="stable")
            sorted_slots = token_slots[order]
            keep = sorted_slots >= 0
            order, sorted_slots = order[keep], sorted_slots[keep]
            starts = np.searchsorted(sorted_slots, present, side="left")
            ends = np.searchsorted(sorted_slots, present, side="right")

            def dev(a):
                return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device, non_blocking=True)

            return cls([], t, dev(order), dev(present), dev(starts), dev(ends - starts),
                       int((ends - starts).max()), True)
        groups: list[tuple[int, Rows]] = []
        for slot in present.tolist():
            idx = np.flatnonzero(token_slots == slot)
            if idx[-1] - idx[0] + 1 == len(idx):  # one contiguous run: views, no gather
                groups.append((slot, slice(int(idx[0]), int(idx[-1]) + 1)))
            else:
                groups.append((slot, torch.from_numpy(idx).to(device)))
        return cls(groups, t)

    def apply(self, x: torch.Tensor, y: torch.Tensor, group: LoRAGroup) -> None:
        """``y[rows] += lora(x[rows])`` in place for every adapter row of the step."""
        if not self.targets_any(group.modules):
            return
        if self.use_triton:
            from worker.engine.kernels.triton.lora import lora_shrink, lora_expand

            shrunk = lora_shrink(x, group.a, self)
            r = group.rank
            for g, (lo, hi) in enumerate(group.out_ranges):
                lora_expand(shrunk[:, g * r:(g + 1) * r], group.b[:, lo:hi], y[:, lo:hi], self)
            return
        r = group.rank
        for slot, rows in self.groups:
            # float32 shrink and expand, one rounding into y (see _add_rows); the CPU
            # slots are float32, so .float() copies nothing there.
            shrunk = x[rows].float() @ group.a[slot].float().T  # [n, G * R]
            delta = torch.empty((shrunk.shape[0], y.shape[1]), dtype=torch.float32, device=y.device)
            for g, (lo, hi) in enumerate(group.out_ranges):
                torch.mm(shrunk[:, g * r:(g + 1) * r], group.b[slot, lo:hi].float().T, out=delta[:, lo:hi])
            _add_rows(y, rows, delta)

    def apply_embedding(self, ids: torch.Tensor, y: torch.Tensor, emb: EmbeddingLoRA) -> None:
        """``y[rows] += A[slot][:, ids[rows]].T @ B[slot].T``: the input embedding's
        LoRA, whose shrink is a row gather by token id."""
        if not self.targets_any(emb.modules):
            return
        if self.use_triton:
            from worker.engine.kernels.triton.lora import lora_expand

            # Rows of no adapter gather slot 0's row; the expand never reads them.
            if self.token_slot_dev is not None:
                slots = self.token_slot_dev.long()
            else:
                slots = torch.from_numpy(np.maximum(self.token_slots, 0)).to(ids.device, non_blocking=True)
            lora_expand(emb.a[slots, ids].float(), emb.b, y, self)
            return
        for slot, rows in self.groups:
            shrunk = emb.a[slot].index_select(0, ids[rows]).float()
            _add_rows(y, rows, shrunk @ emb.b[slot].float().T)


def _add_rows(y: torch.Tensor, rows: Rows, delta: torch.Tensor) -> None:
    """``y[rows] += delta`` for a float32 ``delta``, summed in float32 and rounded to
    y's dtype once.  That is peft's rounding, the reference adapters are trained and
    checked with: ``PeftModel.from_pretrained`` upcasts a bf16 model's adapter to
    float32 (autocast_adapter_dtype), computes ``lora_B(lora_A(x.float())) * scaling``
    in float32 and rounds ``base_out + delta`` to the model's dtype.  bf16 slots and a
    bf16 shrink / addmm made 46 % of a bf16 model's LoRA outputs differ from peft's
    (tests/unit/engine/test_lora_bf16.py)."""
    if isinstance(rows, slice):
        y[rows].add_(delta)  # bf16 += float32: computed in float32, rounded once
    else:
        y.index_copy_(0, rows, y.index_select(0, rows).add_(delta))
