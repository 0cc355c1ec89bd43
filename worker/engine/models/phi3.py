"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): the Llama-family decoder whose checkpoints
store q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` tensor (the
layouts of our fused parameters, so each maps onto its parameter whole), with
LongRoPE / SuRoPE scaling (models/rotary.py) and partial rotary (Phi-4-mini), both
read by the config parser.

Tensor parallelism: a rank's rows of a fused tensor are not one contiguous range
(its q heads, then its k heads, then its v heads), so ``checkpoint_tensors`` cuts
them out before the copy; the unfused projections shard as Llama's.
"""
from __future__ import annotations

from typing import Iterator

import torch

from worker.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM

_QKV, _GATE_UP = "self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"
_SPLIT = {_QKV: ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
          _GATE_UP: ("mlp.gate_proj.weight", "mlp.up_proj.weight")}


class Phi3DecoderLayer(LlamaDecoderLayer):
    LORA_QKV_MODULES = ("qkv_proj",)  # PEFT adapters of Phi-3 target the fused modules
    LORA_GATE_UP_MODULES = ("gate_up_proj",)

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        t = super().weight_targets(prefix)
        for fused, parts in _SPLIT.items():
            for part in parts:
                del t[prefix + part]
        t[prefix + _QKV] = self.qkv_weight.data
        t[prefix + _GATE_UP] = self.gate_up_weight.data
        return t

    def weight_slices(self, prefix: str) -> dict[str, tuple[int, int, int]]:
        return {k: v for k, v in super().weight_slices(prefix).items()
                if not any(k == prefix + p for parts in _SPLIT.values() for p in parts)}

    def shard_fused(self, prefix: str, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a fused checkpoint tensor, in the fused parameter's order."""
        base = super().weight_slices(prefix)
        if name == prefix + _QKV:
            c_q = self.q_size * self.tp.world  # query heads always split evenly
            c_kv = (tensor.shape[0] - c_q) // 2
            parts = (tensor[:c_q], tensor[c_q:c_q + c_kv], tensor[c_q + c_kv:])
        else:
            inter = tensor.shape[0] // 2
            parts = (tensor[:inter], tensor[inter:])
        names = _SPLIT[name[len(prefix):]]
        return torch.cat([p.narrow(*base[prefix + n]) for p, n in zip(parts, names)])


class Phi3ForCausalLM(LlamaForCausalLM):
    layer_class = Phi3DecoderLayer

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if self.tp.active and name.endswith((_QKV, _GATE_UP)) and name.startswith("model.layers."):
            i = int(name.split(".")[2])
            prefix = f"model.layers.{i}."
            yield name, self.layers[i].shard_fused(prefix, name, tensor)
        else:
            yield name, tensor
