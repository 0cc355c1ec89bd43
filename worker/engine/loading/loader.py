"""Load an HF-format safetensors checkpoint into the registered model of its
architecture (models/registry.py).

Memory-lean: the model is created with uninitialised weights directly on the
target device/dtype, then each checkpoint tensor is read on its own
(``safe_open`` memory-maps the file) and copied into its destination, so peak
host memory is one tensor, not the checkpoint.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from safetensors import safe_open

from worker.engine.models.config import ModelConfig
from worker.engine.quantization.config import CheckpointQuantization, parse_quantization
from worker.engine.quantization.reader import KeepHook, KvHook, dequantize_stream

log = logging.getLogger(__name__)

# Tensors only quantized checkpoints carry (FP8 scales, GPTQ/AWQ packed weights, MXFP4 blocks): left
# over after dequantize_stream, they belong to a checkpoint whose config names no
# quantization (FP8 exports often lack one), and loading them as dense would be garbage.
_QUANTIZED_SUFFIXES = ("_scale", "_scale_inv", "_zero_point", ".qweight", ".qzeros", ".scales", ".g_idx", "absmax",
                       "quant_map", ".weight_packed", ".weight_shape", ".SCB", ".weight_format", "_proj_blocks",
                       "_proj_scales")
_QUANTIZED_PARTS = ("qweight", ".quant_state.")  # GPTQ/AWQ packed weights, bitsandbytes 4-bit state
_QUANTIZED_DTYPES = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                     if hasattr(torch, n)}


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """Shards listed by ``model.safetensors.index.json``, else every ``*.safetensors``."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"shards named in {index} are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir} (only safetensors checkpoints are supported)")
    return files


PROGRESS_MIN_BYTES = 2 << 30  # checkpoints this large log their loading progress


def iter_checkpoint(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the checkpoint, one at a time; large
    checkpoints log a progress line every tenth of their bytes."""
    files = safetensors_files(model_dir)
    total = sum(p.stat().st_size for p in files)
    done, next_report, count = 0, total / 10, 0
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                yield name, tensor
                done += tensor.numel() * tensor.element_size()
                count += 1
                if total >= PROGRESS_MIN_BYTES and done >= next_report:
                    log.info("loading weights: %.1f of %.1f GB (%d tensors)", done / 1e9, total / 1e9, count)
                    next_report += total / 10


def checkpoint_quantization(model_dir: str | Path) -> Optional[CheckpointQuantization]:
    """The quantization named by ``model_dir``'s config.json (None: dense, or no config,
    as in a trainer's bare weight directory)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    return parse_quantization(cfg.get("quantization_config") or cfg.get("compression_config"))


def iter_dense_checkpoint(model_dir: str | Path, quant: Optional[CheckpointQuantization] = None,
                          keep: Optional[KeepHook] = None, kv: Optional[KvHook] = None
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """``iter_checkpoint`` with quantized layers turned into dense weights
    (quantization/reader.py); ``quant`` defaults to what the directory's config names."""
    if quant is None:
        quant = checkpoint_quantization(model_dir)
    return dequantize_stream(iter_checkpoint(model_dir), quant, keep=keep, kv=kv)


def _dense_only(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (dequantized) tensors, refusing the first left quantized."""
    for name, tensor in weights:
        if name.endswith(_QUANTIZED_SUFFIXES) or any(p in name for p in _QUANTIZED_PARTS) or (
                tensor.dtype in _QUANTIZED_DTYPES) or (name.endswith(".weight") and not tensor.is_floating_point()):
            raise ValueError(f"checkpoint tensor {name} ({tensor.dtype}) belongs to a quantized checkpoint, but "
                             f"config.json names no quantization_config this engine reads; quantized checkpoints "
                             f"without one are not supported: add the quantization_config its quantizer wrote, or "
                             f"serve an unquantized bfloat16/float16/float32 checkpoint")
        yield name, tensor


# Told (model, checkpoint name) once the model has copied that tensor into its parameter.
FilledHook = Callable[[Any, str], None]


def _reporting(weights: Iterator[tuple[str, torch.Tensor]], model, filled: FilledHook
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights``, calling ``filled`` for each one once the model asks for the next: the
    models' loader (models/weight_loading.py) copies every tensor before it does."""
    for name, tensor in weights:
        yield name, tensor
        filled(model, name)


def load_weights(model, model_dir: str | Path, keep: Optional[KeepHook] = None, kv: Optional[KvHook] = None,
                 filled: Optional[FilledHook] = None) -> None:
    """Stream the (dequantized) checkpoint through the model's own ``load_weights`` (its
    name mapping and sharding) and check that every weight it needs came; ``keep`` sees
    each quantized layer's parts (quantization/kept.py), ``kv`` the KV-cache scales
    (quantization/kv_scales.py), ``filled`` each tensor the model has copied (kept.py packs
    a layer as soon as it is complete)."""
    weights = _dense_only(iter_dense_checkpoint(model_dir, model.config.quantization, keep, kv))
    loaded = model.load_weights(weights if filled is None else _reporting(weights, model, filled))
    missing = sorted(set(model.weight_targets()) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} weight(s): {shown}")


def load_model(model_dir: str | Path, *, dtype: Optional[torch.dtype] = None,
               device: torch.device | str = "cpu", config: Optional[ModelConfig] = None,
               keep: Optional[KeepHook] = None, kv: Optional[KvHook] = None,
               filled: Optional[FilledHook] = None):
    """Build the registered model for ``model_dir``'s architecture on ``device`` in
    ``dtype`` (default: the checkpoint's) and fill its weights (``keep``, ``kv``,
    ``filled``: see load_weights)."""
    config = config or ModelConfig.from_dir(model_dir)
    cls = config.family.model_class()
    if config.quantization is not None:
        # Dense weights at load; kept quantized afterwards where the caller packs them so
        # (``keep``: CUDA, quantization/kept.py), else served dequantized
        # (docs/quantization.md says what that costs in memory and what it computes).
        acts = config.quantization.activations
        if keep is None:
            log.info("quantized checkpoint: %s; weights dequantized at load into %s%s", config.quantization.describe(),
                     dtype or config.dtype, "" if acts == "none" else f" (its {acts} activation quantization is not "
                     "applied)")
    with torch.device(device):
        model = cls(config, dtype=dtype, device=device)
    load_weights(model, model_dir, keep, kv, filled)
    return model.eval()
