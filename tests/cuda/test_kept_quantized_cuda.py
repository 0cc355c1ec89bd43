"""Checkpoint-quantized weights kept quantized on a GPU (quantization/kept.py: the Triton
W8A8 and W4A16 GEMMs, CUDA graphs on), skipped without one (NOT yet run on a GPU: none
has been lent so far; the same path runs under Triton's interpreter in
tests/support/triton_interpreted_quant.py).  fp32 activations: greedy ids equal to HF
transformers on the dequantized weights (FP8: inputs rounded per token group, as the
W8A8 GEMM multiplies them); bf16: the kept weights' bytes and a served request."""
from __future__ import annotations

import pytest
import torch

from tests.support import quantized_factory as qf
from tests.support.engine_helpers import make_engine, request
from tests.unit.engine.test_model import _tokens
from worker.engine.quantization.kept import Fp8BlockWeight, Int4Weight, weight_bytes

pytestmark = pytest.mark.cuda


def _served(engine, prompts, n):
    out = engine.generate([request(str(i), p, max_tokens=n, ignore_eos=True) for i, p in enumerate(prompts)])
    return [[t for d in out[str(i)] for t in d.token_ids] for i in range(len(prompts))]


def test_fp8_blocks_kept_on_gpu_match_the_w8a8_reference(tiny_model, tmp_path):
    src = tiny_model("llama")
    path = qf.write_fp8_block(src, tmp_path / "fp8")
    engine = make_engine(path, device="cuda", dtype="float32")
    layer = engine.runner.model.layers[0]
    assert isinstance(layer.qkv_weight, Fp8BlockWeight) and layer.qkv_weight.q.is_cuda
    prompts = [_tokens(13, seed=8), _tokens(5, seed=9)]
    ref = qf.with_fp8_rounded_inputs(qf.reference_with_weights(src, qf.dequantized_fp8(path)), 32)
    assert _served(engine, prompts, 8) == [qf.greedy(ref, p, 8) for p in prompts]
    engine.close()


@pytest.mark.parametrize("fmt", ["awq", "gptq_act_order"])
def test_int4_kept_on_gpu_matches_the_dequantized_model(tiny_model, tmp_path, fmt):
    src = tiny_model("llama")
    if fmt == "awq":
        path, dense = qf.write_awq(src, tmp_path / "awq")
    else:
        path, dense = qf.write_gptq(src, tmp_path / "gptq", sym=False, act_order=True)
    engine = make_engine(path, device="cuda", dtype="float32")
    w = engine.runner.model.layers[0].qkv_weight
    assert isinstance(w, Int4Weight) and (w.perm is not None) == (fmt == "gptq_act_order")
    prompts = [_tokens(11, seed=5), _tokens(4, seed=6)]
    ref = qf.reference_with_weights(src, dense)
    assert _served(engine, prompts, 8) == [qf.greedy(ref, p, 8) for p in prompts]
    engine.close()


def test_fp8_moe_checkpoint_keeps_its_experts_fp8_on_gpu(tiny_model, tmp_path):
    src = tiny_model("mixtral")
    path = qf.write_fp8_block(src, tmp_path / "fp8", block=(32, 32))
    engine = make_engine(path, device="cuda", dtype="float32")
    moe = engine.runner.model.layers[0].moe
    assert isinstance(moe.w13, Fp8BlockWeight) and moe.w13.q.is_cuda and moe.w13.q.dim() == 3
    prompts = [_tokens(13, seed=8), _tokens(5, seed=9)]
    ref = qf.reference_with_weights(src, qf.dequantized_fp8(path))
    ref = qf.with_fp8_rounded_expert_inputs(qf.with_fp8_rounded_inputs(ref, 32), 32)
    assert _served(engine, prompts, 8) == [qf.greedy(ref, p, 8) for p in prompts]
    engine.close()


def test_int4_moe_checkpoint_keeps_its_experts_int4_on_gpu(tiny_model, tmp_path):
    from worker.engine.quantization.kept import Int4Experts

    src = tiny_model("mixtral")
    path, dense = qf.write_gptq(src, tmp_path / "gptq", sym=False, act_order=True)
    engine = make_engine(path, device="cuda", dtype="float32")
    moe = engine.runner.model.layers[0].moe
    assert isinstance(moe.w13, Int4Experts) and moe.w13.stack.qweight.is_cuda and moe.w13.stack.perm is not None
    prompts = [_tokens(13, seed=8), _tokens(5, seed=9)]
    ref = qf.reference_with_weights(src, dense)
    assert _served(engine, prompts, 8) == [qf.greedy(ref, p, 8) for p in prompts]
    engine.close()


def test_bf16_serving_keeps_fp8_bytes(tiny_model, tmp_path):
    path = qf.write_fp8_block(tiny_model("llama"), tmp_path / "fp8")
    engine = make_engine(path, device="cuda", dtype="bfloat16")
    layers = engine.runner.model.layers
    kept = sum(weight_bytes(getattr(layer, n)) for layer in layers for n in layer._LINEAR_WEIGHTS)
    dense = sum(getattr(layer, n).shape.numel() * 2 for layer in layers for n in layer._LINEAR_WEIGHTS)
    assert kept < 0.56 * dense
    assert len(_served(engine, [_tokens(9, seed=1)], 6)[0]) == 6
    engine.close()


def test_fp8_checkpoint_loads_without_the_dense_model_on_the_gpu(tmp_path):
    """The GPU's peak while building a kept-FP8 model stays near the FP8 model, not the
    dense one: projections are staged in host memory and quantized onto the GPU one by one
    (models/layers.staged_projections, KeptQuantized.filled)."""
    from benchmarks.model_presets import build_preset_model
    from worker.engine.config import EngineConfig
    from worker.engine.loading.model_setup import build_model
    from worker.engine.models.config import ModelConfig

    src = build_preset_model("8x512", dtype="bfloat16")
    fp8 = qf.write_fp8_block(src, tmp_path / "fp8", block=(128, 128))

    def peak(path):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        config = EngineConfig(model=str(path), dtype="bfloat16", device="cuda")
        model, _, _ = build_model(config, ModelConfig.from_dir(path), torch.device("cuda"))
        used = torch.cuda.max_memory_allocated() - base
        del model
        return used

    dense, kept = peak(src), peak(fp8)
    assert kept < 0.75 * dense, (kept, dense)
