"""LoRA adapters on a quantized base (issue 43): an adapter trained on the dense model
serves on its AWQ / FP8-block checkpoint, and its greedy ids and logprobs equal peft's
over the HF model holding the dequantized weights (what the quantized base computes),
next to base rows of the same batch.  On CPU the AWQ base stays int4 in memory (the
adapter's delta is added to the int4 GEMM's output); FP8 loads dequantized here."""
from __future__ import annotations

import pytest
import torch

from tests.support import quantized_factory as qf
from tests.support.engine_helpers import make_engine, random_prompts, request, run_to_completion, tokens_of
from tests.support.lora_factory import ATTENTION, MLP, build_adapter

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def quantized(tiny_model, tmp_path_factory):
    """{format: (checkpoint, HF reference with its dequantized weights)}, and an adapter
    of the dense model every projection of which it targets."""
    src = tiny_model("llama")
    root = tmp_path_factory.mktemp("lora-quantized")
    awq, dense = qf.write_awq(src, root / "awq")
    fp8 = qf.write_fp8_block(src, root / "fp8")
    adapter = build_adapter(src, root / "adapter", ATTENTION + MLP, rank=8, alpha=16, seed=4)
    return {"awq": (awq, lambda: qf.reference_with_weights(src, dense)),
            "fp8_block": (fp8, lambda: qf.load_dequantized_reference(fp8))}, adapter


@torch.inference_mode()
def _peft_greedy(ref, adapter, prompt, n):
    from peft import PeftModel

    model = PeftModel.from_pretrained(ref, str(adapter)).eval()
    ids, lps = list(prompt), []
    for _ in range(n):
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        ids.append(int(lp.argmax()))
        lps.append(float(lp[ids[-1]]))
    return ids[len(prompt):], lps


@pytest.mark.parametrize("fmt", ["awq", "fp8_block"])
def test_adapter_on_a_quantized_base_equals_peft_on_the_dequantized_model(quantized, fmt):
    checkpoints, adapter = quantized
    path, reference = checkpoints[fmt]
    prompts = random_prompts(2, 9, 14, seed=8)
    engine = make_engine(path, enable_lora=True, max_loras=1, max_lora_rank=8, lora_modules={"a": str(adapter)})
    try:
        if fmt == "awq":  # the base the adapter rides on really is the int4 one
            from worker.engine.quantization.kept import CpuInt4Weight
            layer = engine.model.layers[0]
            assert all(isinstance(getattr(layer, n), CpuInt4Weight) for n in layer._LINEAR_WEIGHTS)
        reqs = [request("lora", prompts[0], max_tokens=8, logprobs=0, ignore_eos=True),
                request("base", prompts[1], max_tokens=8, ignore_eos=True)]
        reqs[0].lora_name = "a"
        for r in reqs:
            engine.add_request(r)
        out = {rid: d for (rid, _), d in run_to_completion(engine).items()}
    finally:
        engine.close()
    ids, lps = _peft_greedy(reference(), adapter, prompts[0], 8)
    assert tokens_of(out["lora"]) == ids
    got = [lp for d in out["lora"] for lp in d.logprobs.logprobs]
    assert got == pytest.approx(lps, abs=1e-4)
    assert tokens_of(out["base"]) == qf.greedy(reference(), prompts[1], 8)
    assert ids != qf.greedy(reference(), prompts[0], 8)  # the adapter changes the output
