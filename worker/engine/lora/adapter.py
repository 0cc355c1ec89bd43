"""A PEFT LoRA adapter read from ``adapter_config.json`` + ``adapter_model.safetensors``.

What vLLM 0.32 serves on a Llama-family decoder is accepted: the projections
q/k/v/o/gate/up/down, the input embedding (``embed_tokens``, PEFT's
``lora_embedding_A/B``) and the output head (``lm_head``); per-module ranks and
alphas (``rank_pattern`` / ``alpha_pattern``); rsLoRA; adapters on some layers only
(``layers_to_transform``).  Dropout is an inference no-op.  What is refused names
the field or tensor: DoRA, bias training, modules_to_save, the inits that rewrite
base weights (PiSSA, OLoRA, ...), aLoRA, layer replication, BD-LoRA, QALoRA,
trainable token indices, expert parameters, fan_in_fan_out, tensors of modules
outside those above and ranks above ``--max-lora-rank``.

The tensors decide which modules an adapter targets (as in vLLM): PEFT keeps a
``target_modules`` entry the model lacked without complaint, and "all-linear" or a
regular expression there names no module.  Scaling (``alpha / r``, ``/ sqrt(r)``
with rslora, per module under the patterns) is folded into B at load.  The
embedding copies PEFT saves beside an embedding adapter (``*.base_layer.weight``)
are ignored: the served model's own weights are the base, as in vLLM.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

# Projections of the decoder layers a LoRA may target, by their HF names: the Llama
# family's, and Phi-3's fused qkv_proj / gate_up_proj (which model has which: the
# layer's LoRA groups, lora/weights.py).
LAYER_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                 "gate_up_proj")
# Model-level modules, keyed with layer MODEL in LoRAAdapter.weights.
MODEL_MODULES = ("embed_tokens", "lm_head")
MODEL = -1

_LAYER_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.*\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\."
                        r"(?P<name>\w+))\.lora_(?P<half>[AB])\.weight$")
_MODEL_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>(?:model\.)?(?P<name>embed_tokens|lm_head))"
                        r"\.lora_(?:embedding_)?(?P<half>[AB])(?:\.weight)?$")
_BASE_COPY = (".embed_tokens.base_layer.weight", ".lm_head.base_layer.weight")

# adapter_config.json fields that change what the adapter computes and serving can't honour.
_REFUSED = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA bias (lora_bias)",
    "alora_invocation_tokens": "Activated LoRA (alora_invocation_tokens)",
    "layer_replication": "layer_replication",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "use_qalora": "QALoRA (use_qalora)",
    "modules_to_save": "modules_to_save",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters (LoRA on expert parameters)",
    "fan_in_fan_out": "fan_in_fan_out",
}
# String inits that leave base weights of their own (PEFT rewrites the base model).
_INITS_SERVED = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int  # the largest of its modules' ranks
    # (layer, module) -> (A [r, in], B [out, r] already times scaling); layer MODEL for
    # embed_tokens (A [r, vocab], B [hidden, r], PEFT's lora_embedding_A/B) and lm_head.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def target_modules(self) -> set[str]:
        return {m for _, m in self.weights}


def _refuse(path: Path, what: str) -> None:
    raise ValueError(f"LoRA adapter at {path}: {what}")


def _pattern_value(pattern: dict, module: str):
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module name's tail."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return None


def read_config(path: Path, max_rank: int) -> dict:
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        _refuse(path, "no adapter_config.json (a PEFT LoRA folder is expected)")
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except ValueError as e:
        _refuse(path, f"adapter_config.json is not valid JSON ({e})")
    if not isinstance(cfg, dict):
        _refuse(path, "adapter_config.json is not a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        _refuse(path, f"peft_type {cfg.get('peft_type')!r} is not supported; only LORA")
    for field, what in _REFUSED.items():
        if cfg.get(field):
            _refuse(path, f"{what} is not supported")
    if cfg.get("bias", "none") != "none":
        _refuse(path, f"bias={cfg['bias']!r} is not supported; only 'none'")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _INITS_SERVED:
        _refuse(path, f"init_lora_weights={init!r} is not supported: it rewrites the base model's weights "
                      f"(convert the adapter to a plain LoRA first)")
    ranks = [cfg.get("r", 0), *(cfg.get("rank_pattern") or {}).values()]
    if not all(isinstance(r, int) and r >= 1 for r in ranks):
        _refuse(path, f"LoRA ranks must be positive integers, got {ranks}")
    if max(ranks) > max_rank:
        _refuse(path, f"rank {max(ranks)} is greater than --max-lora-rank {max_rank}")
    return cfg


def load_adapter(name: str, path: str | Path, max_rank: int, num_layers: int) -> LoRAAdapter:
    path = Path(path)
    cfg = read_config(path, max_rank)
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        _refuse(path, "no adapter_model.safetensors (only safetensors adapters are supported)")
    try:
        tensors = load_file(str(file))
    except Exception as e:  # a truncated or foreign file
        _refuse(path, f"adapter_model.safetensors cannot be read ({e})")
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    peft_names: dict[tuple[int, str], str] = {}
    for key, t in tensors.items():
        if key.endswith(_BASE_COPY):
            continue
        m = _LAYER_KEY.match(key) or _MODEL_KEY.match(key)
        if m is None:
            _refuse(path, f"tensor {key} is not a LoRA weight of a module this server supports "
                          f"({', '.join(LAYER_MODULES + MODEL_MODULES)})")
        module = m.group("name")
        layer = int(m.group("layer")) if "layer" in m.groupdict() and m.group("layer") is not None else MODEL
        if layer != MODEL and module not in LAYER_MODULES:
            _refuse(path, f"tensor {key}: module {module!r} is not supported "
                          f"(supported: {', '.join(LAYER_MODULES + MODEL_MODULES)})")
        if layer >= num_layers:
            _refuse(path, f"tensor {key}: the model has {num_layers} layers")
        halves.setdefault((layer, module), {})[m.group("half")] = t.float()
        peft_names[(layer, module)] = m.group("module")
    weights = {}
    top_rank = 0
    for (layer, module), ab in halves.items():
        where = module if layer == MODEL else f"layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            _refuse(path, f"{where} lacks lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        peft_name = peft_names[(layer, module)]
        rank = _pattern_value(rank_pattern, peft_name) or cfg.get("r")
        alpha = _pattern_value(alpha_pattern, peft_name)
        alpha = float(cfg.get("lora_alpha", rank) if alpha is None else alpha)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            _refuse(path, f"{where}: A {tuple(a.shape)} / B {tuple(b.shape)} do not have rank {rank}")
        scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
        weights[(layer, module)] = (a, b * scaling)
        top_rank = max(top_rank, rank)
    if not weights:
        _refuse(path, "holds no LoRA weights")
    return LoRAAdapter(name=name, path=str(path), rank=top_rank, weights=weights)
