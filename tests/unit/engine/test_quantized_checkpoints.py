"""Quantized checkpoints are refused with an error naming the format or the tensor:
by config.json (quantization_config / compression_config) and, for checkpoints that
lack one (FP8 exports often do), by their tensors (scales, packed weights, FP8 or
integer weights), before anything serves garbage from dense matmuls over them."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker.engine.loading.loader import load_model
from worker.engine.models.config import ModelConfig


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("key, quant, method", [
    ("quantization_config", {"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq"),
    ("quantization_config", {"quant_method": "awq", "bits": 4, "version": "gemv"}, "awq"),
    ("quantization_config", {"quant_method": "gguf"}, "gguf"),
    ("quantization_config", {"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ("quantization_config", {"load_in_8bit": True}, "bitsandbytes"),  # older transformers wrote no quant_method
    ("quantization_config", {"quant_method": "compressed-tensors", "format": "float-quantized"},
     "compressed-tensors"),  # no config_groups: nothing says which layers are stored how
    ("compression_config", {"format": "pack-quantized"}, "pack-quantized"),
])
def test_quantized_config_is_refused_by_format(tiny_model, tmp_path, key, quant, method):
    path = _with_config(tiny_model("llama"), tmp_path / "q", **{key: quant})
    with pytest.raises(ValueError, match=re.escape(f"quantized checkpoints (quant_method={method!r}) are not "
                                                   f"supported") + ".*serve an unquantized"):
        ModelConfig.from_dir(path)


def test_null_quantization_config_is_an_unquantized_checkpoint(tiny_model, tmp_path):
    path = _with_config(tiny_model("llama"), tmp_path / "plain", quantization_config=None)
    assert ModelConfig.from_dir(path).num_hidden_layers > 0


PROJ = "model.layers.0.self_attn.q_proj"
DOWN = "model.layers.0.mlp.down_proj"


def _add(name, tensor):
    def edit(w):
        w[name] = tensor
    return edit


def _replace_weight(name, dtype):
    def edit(w):
        w[name] = w[name].to(dtype) if dtype.is_floating_point else torch.zeros_like(w[name], dtype=dtype)
    return edit


@pytest.mark.parametrize("offender, edit", [
    (f"{DOWN}.weight_scale", _add(f"{DOWN}.weight_scale", torch.ones(()))),  # FP8 (llm-compressor, modelopt)
    (f"{DOWN}.input_scale", _add(f"{DOWN}.input_scale", torch.ones(()))),  # FP8 static activations
    (f"{DOWN}.weight_scale_inv", _add(f"{DOWN}.weight_scale_inv", torch.ones(2, 2))),  # FP8 block-wise
    (f"{DOWN}.weight_zero_point", _add(f"{DOWN}.weight_zero_point", torch.zeros(4, dtype=torch.int8))),
    (f"{PROJ}.qweight", _add(f"{PROJ}.qweight", torch.zeros(4, 4, dtype=torch.int32))),  # GPTQ/AWQ
    (f"{PROJ}.qzeros", _add(f"{PROJ}.qzeros", torch.zeros(1, 4, dtype=torch.int32))),
    (f"{PROJ}.g_idx", _add(f"{PROJ}.g_idx", torch.zeros(4, dtype=torch.int32))),
    (f"{PROJ}.weight_packed", _add(f"{PROJ}.weight_packed", torch.zeros(4, 4, dtype=torch.int32))),
    (f"{PROJ}.weight.absmax", _add(f"{PROJ}.weight.absmax", torch.ones(4))),  # bitsandbytes 4-bit
    (f"{PROJ}.weight.nested_absmax", _add(f"{PROJ}.weight.nested_absmax", torch.ones(4))),
    (f"{PROJ}.weight.quant_state.bitsandbytes__nf4",
     _add(f"{PROJ}.weight.quant_state.bitsandbytes__nf4", torch.zeros(8, dtype=torch.uint8))),
    (f"{PROJ}.SCB", _add(f"{PROJ}.SCB", torch.ones(4))),  # bitsandbytes 8-bit
    (f"{DOWN}.weight", _replace_weight(f"{DOWN}.weight", torch.float8_e4m3fn)),  # FP8 weight, no scale, no config
    (f"{DOWN}.weight", _replace_weight(f"{DOWN}.weight", torch.uint8)),  # packed integer weight
])
def test_quantized_tensors_are_refused_by_name(tiny_model, tmp_path, offender, edit):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_model("llama"), dst)
    weights = load_file(dst / "model.safetensors")
    edit(weights)
    save_file(weights, dst / "model.safetensors")
    with pytest.raises(ValueError, match=re.escape(f"checkpoint tensor {offender} (")
                       + r".*names no quantization_config.*quantized checkpoints "
                       + r"without one are not supported"):
        load_model(dst)


def test_dense_checkpoint_still_loads(tiny_model):
    model = load_model(tiny_model("llama"))
    assert next(model.parameters()).is_floating_point()
