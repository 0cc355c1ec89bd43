"""LoRA on the dense families beyond Llama against transformers + peft: the attention
and MLP projections under each family's PEFT names (Phi-3's fused qkv_proj /
gate_up_proj, the others' q/k/v/o/gate/up/down), greedy ids and logprobs."""
from __future__ import annotations

import pytest

from tests.support.engine_helpers import hf_greedy, make_engine, random_prompts, request, tokens_of
from tests.support.lora_factory import ATTENTION, MLP, build_adapter, peft_greedy
from worker.engine.lora.manager import LoRAError
from worker.engine.models.registry import ModelRegistry

pytest.importorskip("peft")

FAMILIES = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], "smollm3_swa": ATTENTION + MLP,
            "olmo2": ATTENTION + MLP, "olmo3": ATTENTION + MLP, "gemma3": ATTENTION + MLP,
            # GPT-OSS: its MLPs are experts (no LoRA there, as for the other MoE families);
            # the attention projections carry biases and the sinks.
            "gpt_oss": ATTENTION,
            # Granite: the adapter's deltas pass through its attention / residual multipliers.
            "granite": ATTENTION + MLP}


def test_declared_targets_are_the_peft_names():
    for kind, arch in (("phi3", "Phi3ForCausalLM"), ("olmo2", "Olmo2ForCausalLM"), ("gemma3", "Gemma3ForCausalLM"),
                       ("smollm3_swa", "SmolLM3ForCausalLM"), ("olmo3", "Olmo3ForCausalLM"),
                       ("gpt_oss", "GptOssForCausalLM"), ("granite", "GraniteForCausalLM")):
        assert list(ModelRegistry.resolve([arch]).lora_modules) == FAMILIES[kind]


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_greedy_ids_and_logprobs_equal_peft(tiny_model, tmp_path, kind):
    path = tiny_model(kind)
    adapter = build_adapter(path, tmp_path / "a", FAMILIES[kind], rank=4, alpha=8, seed=1)
    engine = make_engine(path, enable_lora=True, max_loras=2, max_lora_rank=8, lora_modules={"a": str(adapter)},
                         max_num_batched_tokens=16)
    prompt = random_prompts(1, 20, 30, seed=3)[0]  # past the sliding windows, prefill in chunks
    r = request("r", prompt, max_tokens=8, logprobs=2, ignore_eos=True)
    r.lora_name = "a"
    out = engine.generate([r, request("base", prompt, max_tokens=8, ignore_eos=True)])
    ids, rows = peft_greedy(path, adapter, prompt, 8)
    assert tokens_of(out["r"]) == ids
    got = [lp for d in out["r"] for lp in d.logprobs.logprobs]
    assert got == pytest.approx([float(row[t]) for row, t in zip(rows, ids)], abs=1e-4)
    base = hf_greedy(path, prompt, 8)[0]
    assert tokens_of(out["base"]) == base and ids != base  # the adapter changes the output; base rows do not


def test_an_adapter_of_fused_modules_on_a_llama_is_refused(tiny_model, tmp_path):
    adapter = build_adapter(tiny_model("phi3"), tmp_path / "phi", ["qkv_proj"], rank=4, alpha=8)
    engine = make_engine(tiny_model("llama"), enable_lora=True, max_loras=1, max_lora_rank=8)
    with pytest.raises(LoRAError, match="this model has no qkv_proj"):
        engine.lora_manager.register("phi", str(adapter))
