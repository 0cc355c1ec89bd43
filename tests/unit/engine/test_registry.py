"""The model registry: architecture -> implementation, the supported list users see
(`tokserve models`, the docs/models.md table) and the refusal of other architectures."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from worker.engine.loading.loader import load_model
from worker.engine.models.config import ModelConfig
from worker.engine.models.interface import Model
from worker.engine.models.registry import ModelFamily, ModelRegistry, _ModelRegistry

ROOT = Path(__file__).resolve().parents[3]


def test_every_entry_resolves_to_its_class():
    for family in ModelRegistry.families():
        cls = family.model_class()
        assert cls.__name__ == family.class_name
        for name in ("load_weights", "weight_targets", "forward", "compute_logits", "use_attention_backend",
                     "set_routing_store"):
            assert callable(getattr(cls, name)), (family.architecture, name)


def test_unsupported_architecture_is_refused_with_the_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "hidden_size": 8}))
    with pytest.raises(ValueError) as e:
        ModelConfig.from_dir(tmp_path)
    listed = str(e.value).split("supported: ")[1].split(", ")
    assert listed == list(ModelRegistry.get_supported_archs())
    with pytest.raises(ValueError, match=r"Unsupported architecture \(none given\)"):
        ModelRegistry.resolve([])


def test_first_registered_name_of_the_list_wins():
    assert ModelRegistry.resolve(["Unknown", "Qwen3ForCausalLM"]).architecture == "Qwen3ForCausalLM"


def test_a_family_registered_later_is_served(tiny_model, tmp_path):
    """An out-of-tree registration plugs in by name (here: Llama's implementation under
    a new architecture name)."""
    reg = _ModelRegistry(ModelRegistry.families())
    reg.register(ModelFamily("MyLlamaForCausalLM", "llama", "LlamaForCausalLM", "My Llama"))
    assert reg.resolve(["MyLlamaForCausalLM"]).model_class().__name__ == "LlamaForCausalLM"
    assert "MyLlamaForCausalLM" not in ModelRegistry


def test_loaded_models_follow_the_protocol(tiny_model):
    model = load_model(tiny_model("llama"))
    assert isinstance(model, Model)
    assert model.config.family.architecture == "LlamaForCausalLM"


def test_tokserve_models_lists_the_registry():
    out = subprocess.run([sys.executable, "-m", "common.cli", "models"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    for arch in ModelRegistry.get_supported_archs():
        assert re.search(rf"^{arch}\s", out, re.M), arch
    assert f"{len(ModelRegistry.get_supported_archs())} architectures" in out
    rows = json.loads(subprocess.run([sys.executable, "-m", "common.cli", "models", "--format", "json"], cwd=ROOT,
                                     capture_output=True, text=True, check=True).stdout)
    assert [r["architecture"] for r in rows] == list(ModelRegistry.get_supported_archs())
    assert rows[0]["lora_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_docs_table_is_the_registry():
    from worker.engine.models.catalog import markdown_table

    page = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    block = page.split("<!-- models-table:start")[1].split("-->", 1)[1].split("<!-- models-table:end -->")[0]
    assert block.strip() == markdown_table(), "docs/models.md's table is stale: tokserve models --format markdown"


def test_tensor_parallelism_is_refused_for_a_family_that_does_not_shard(tiny_model):
    from worker.engine.parallel.follower import check_shardable

    cfg = json.loads((tiny_model("llama") / "config.json").read_text())
    family = ModelFamily("NoTpLlamaForCausalLM", "llama", "LlamaForCausalLM", "no TP", tensor_parallel=False)
    ModelRegistry.register(family)
    try:
        mc = ModelConfig.from_dicts(tiny_model("llama"), {**cfg, "architectures": [family.architecture]})
        check_shardable(mc, 1)
        with pytest.raises(ValueError, match="NoTpLlamaForCausalLM: tensor parallelism of this model family"):
            check_shardable(mc, 2)
    finally:
        ModelRegistry.unregister(family.architecture)
    assert family.architecture not in ModelRegistry
