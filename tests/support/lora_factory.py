"""Random PEFT LoRA adapters on the tiny test models, and peft's reference outputs."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.support.model_factory import load_hf_model

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def build_adapter(base_dir: Path, out: Path, targets: list[str], *, rank: int = 8, alpha: int = 16,
                  seed: int = 0, use_rslora: bool = False, **config) -> Path:
    """A PEFT adapter folder with non-zero A and B (peft initialises B to zero);
    ``config``: more LoraConfig fields (rank_pattern, layers_to_transform, ...)."""
    from peft import LoraConfig, get_peft_model

    if (out / "adapter_config.json").is_file():
        return out
    model = load_hf_model(base_dir)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                                                  lora_dropout=0.0, use_rslora=use_rslora, **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    peft_model.save_pretrained(out)
    return out


def edit_adapter_config(src: Path, dst: Path, tensors=None, **changes) -> Path:
    """A copy of an adapter folder with adapter_config.json fields changed (and, with
    ``tensors``, its tensors replaced by that dict)."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors is None:
        (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    else:
        save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


_refs: dict = {}


def peft_model(base_dir: Path, adapter_dir: Path):
    from peft import PeftModel

    key = (str(base_dir), str(adapter_dir))
    if key not in _refs:
        _refs[key] = PeftModel.from_pretrained(load_hf_model(base_dir), str(adapter_dir)).eval()
    return _refs[key]


@torch.inference_mode()
def peft_greedy(base_dir: Path, adapter_dir: Path, prompt: list[int], num_tokens: int):
    """Greedy ids by full forwards of the PeftModel, and the log-softmax rows."""
    model = peft_model(base_dir, adapter_dir)
    ids, rows = list(prompt), []
    for _ in range(num_tokens):
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        rows.append(lp)
        ids.append(int(lp.argmax()))
    return ids[len(prompt):], rows
