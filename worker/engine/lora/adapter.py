"""A PEFT LoRA adapter read from ``adapter_config.json`` + ``adapter_model.safetensors``.

Only what serving can honour is accepted; the rest is refused naming the field:
DoRA, bias training, modules_to_save, layers_to_transform, per-module rank/alpha
patterns, fan_in_fan_out, target modules outside the decoder's projections and
ranks above ``--max-lora-rank``.  Dropout is an inference no-op.  Scaling is
``lora_alpha / r`` (``/ sqrt(r)`` with rslora), folded into B at load.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

# Projections of the Llama-family decoder a LoRA may target, by their HF names.
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    # (layer, module) -> (A [r, in], B [out, r] already times scaling)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def target_modules(self) -> set[str]:
        return {m for _, m in self.weights}


def _refuse(path: Path, what: str) -> None:
    raise ValueError(f"LoRA adapter at {path}: {what}")


def load_adapter(name: str, path: str | Path, max_rank: int, num_layers: int) -> LoRAAdapter:
    path = Path(path)
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        _refuse(path, "no adapter_config.json (a PEFT LoRA folder is expected)")
    cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        _refuse(path, f"peft_type {cfg.get('peft_type')!r} is not supported; only LORA")
    if cfg.get("use_dora"):
        _refuse(path, "use_dora=true (DoRA) is not supported")
    if cfg.get("bias", "none") != "none":
        _refuse(path, f"bias={cfg['bias']!r} is not supported; only 'none'")
    for field in ("modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern"):
        if cfg.get(field):
            _refuse(path, f"{field} is not supported")
    if cfg.get("fan_in_fan_out"):
        _refuse(path, "fan_in_fan_out=true is not supported")
    rank = int(cfg.get("r", 0))
    if not 1 <= rank <= max_rank:
        _refuse(path, f"rank {rank} is outside 1..--max-lora-rank {max_rank}")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = sorted(set(targets) - set(SUPPORTED_MODULES))
    if unknown:
        _refuse(path, f"target modules {unknown} are not supported; supported: {', '.join(SUPPORTED_MODULES)}")
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    files = [path / "adapter_model.safetensors"]
    if not files[0].is_file():
        _refuse(path, "no adapter_model.safetensors (only safetensors adapters are supported)")
    tensors = load_file(str(files[0]))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            _refuse(path, f"tensor {key} is not a LoRA A/B weight of a decoder projection")
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if module not in SUPPORTED_MODULES:
            _refuse(path, f"tensor {key}: module {module!r} is not supported")
        if layer >= num_layers:
            _refuse(path, f"tensor {key}: the model has {num_layers} layers")
        halves.setdefault((layer, module), {})[half] = t.float()
    weights = {}
    for (layer, module), ab in halves.items():
        if set(ab) != {"A", "B"}:
            _refuse(path, f"layer {layer} {module} lacks lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            _refuse(path, f"layer {layer} {module}: A {tuple(a.shape)} / B {tuple(b.shape)} do not have rank {rank}")
        weights[(layer, module)] = (a, b * scaling)
    if not weights:
        _refuse(path, "holds no LoRA weights")
    return LoRAAdapter(name=name, path=str(path), rank=rank, scaling=scaling, weights=weights)
