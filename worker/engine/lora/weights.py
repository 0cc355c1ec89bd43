"""Adapter weights resident in a fixed number of slots, stacked per fused projection.

The decoder fuses q/k/v and gate/up into single matmuls, so a LoRA group follows
the fused projection: one shrink ``A [slots, G * R, in]`` for its G sub-modules
(rows ``g*R .. g*R + r`` of sub-module g, zero beyond the adapter's rank r) and one
expand ``B [slots, out, R]`` whose rows keep the fused output order, each row
reading the shrink columns of its own sub-module.  Scaling is folded into B at
load.  A slot an adapter does not target in some module stays zero there, so the
product is exactly the base projection.

The model-level modules follow the same scheme: ``lm_head`` is one more group over
the logits, and the input embedding keeps its A transposed (``[slots, vocab, R]``)
so that its shrink is a row gather by token id.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.engine.lora.adapter import MODEL, LoRAAdapter


@dataclass
class LoRAGroup:
    """One fused projection's LoRA slots."""

    modules: tuple[str, ...]  # HF sub-module names, in fused output order
    out_ranges: tuple[tuple[int, int], ...]  # each sub-module's rows of the fused output
    a: torch.Tensor  # [slots, G * R, in]
    b: torch.Tensor  # [slots, out, R]
    rank: int  # R, --max-lora-rank

    def write(self, slot: int, layer: int, adapter: LoRAAdapter) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        for g, (module, (lo, hi)) in enumerate(zip(self.modules, self.out_ranges)):
            ab = adapter.weights.get((layer, module))
            if ab is None:
                continue
            a, b = ab
            r = a.shape[0]
            self.a[slot, g * self.rank:g * self.rank + r].copy_(a)
            self.b[slot, lo:hi, :r].copy_(b)


def _group(modules, out_sizes, in_features, num_slots, rank, dtype, device) -> LoRAGroup:
    ranges, start = [], 0
    for n in out_sizes:
        ranges.append((start, start + n))
        start += n
    return LoRAGroup(tuple(modules), tuple(ranges),
                     torch.zeros(num_slots, len(modules) * rank, in_features, dtype=dtype, device=device),
                     torch.zeros(num_slots, start, rank, dtype=dtype, device=device), rank)


@dataclass
class EmbeddingLoRA:
    """The input embedding's slots: ``a [slots, vocab, R]`` (PEFT's lora_embedding_A,
    transposed: a token's shrink is its row) and ``b [slots, hidden, R]``."""

    a: torch.Tensor
    b: torch.Tensor
    rank: int
    modules: tuple[str, ...] = ("embed_tokens",)

    def write(self, slot: int, layer: int, adapter: LoRAAdapter) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        ab = adapter.weights.get((MODEL, "embed_tokens"))
        if ab is not None:
            a, b = ab
            self.a[slot, :, :a.shape[0]].copy_(a.T)
            self.b[slot, :, :a.shape[0]].copy_(b)


class ModelLoRA:
    """The model-level slots: input embedding and output head."""

    def __init__(self, vocab_size: int, hidden: int, num_slots: int, rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.embed = EmbeddingLoRA(torch.zeros(num_slots, vocab_size, rank, dtype=dtype, device=device),
                                   torch.zeros(num_slots, hidden, rank, dtype=dtype, device=device), rank)
        self.lm_head = _group(("lm_head",), (vocab_size,), hidden, num_slots, rank, dtype, device)

    def write(self, slot: int, adapter: LoRAAdapter) -> None:
        self.embed.write(slot, MODEL, adapter)
        self.lm_head.write(slot, MODEL, adapter)

    def shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each module as an adapter's A / B must have them (A's "in" of
        the embedding is the vocabulary)."""
        return {"embed_tokens": (self.embed.a.shape[1], self.embed.b.shape[1]),
                "lm_head": (self.lm_head.a.shape[2], self.lm_head.b.shape[1])}


class LayerLoRA:
    """The LoRA groups of one decoder layer: qkv, o and, on dense layers, gate_up and down."""

    def __init__(self, layer, num_slots: int, rank: int, dtype: torch.dtype, device: torch.device):
        q, kv, hidden = layer.q_size, layer.kv_size, layer.hidden_size

        def group(modules, out_sizes, in_features):
            return _group(modules, out_sizes, in_features, num_slots, rank, dtype, device)

        # The HF modules of each fused projection: q/k/v and gate/up, or one module each
        # where the checkpoint fuses them too (Phi-3's qkv_proj / gate_up_proj).
        qkv_modules = layer.LORA_QKV_MODULES
        self.qkv = group(qkv_modules, (q, kv, kv) if len(qkv_modules) == 3 else (q + 2 * kv,), hidden)
        self.o = group(("o_proj",), (hidden,), q)
        self.gate_up = self.down = None
        if layer.moe is None:
            inter = layer.intermediate_size
            gate_up_modules = layer.LORA_GATE_UP_MODULES
            self.gate_up = group(gate_up_modules, (inter, inter) if len(gate_up_modules) == 2 else (2 * inter,),
                                 hidden)
            self.down = group(("down_proj",), (hidden,), inter)

    @property
    def groups(self) -> list[LoRAGroup]:
        return [g for g in (self.qkv, self.o, self.gate_up, self.down) if g is not None]

    def write(self, slot: int, layer: int, adapter: LoRAAdapter) -> None:
        for g in self.groups:
            g.write(slot, layer, adapter)

    def shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each sub-module an adapter may target on this layer."""
        return {m: (g.a.shape[2], hi - lo) for g in self.groups for m, (lo, hi) in zip(g.modules, g.out_ranges)}
