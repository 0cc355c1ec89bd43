"""Quantized checkpoints load and serve what their dequantized model computes (issue 43):
compressed-tensors (FP8 per channel and in blocks, int4 groups symmetric and with zero
points, int8 channels), transformers' FP8 blocks (``weight_scale_inv``), AutoAWQ GEMM and
GPTQ (v1 and v2 zero points, act-order), each against HF transformers running the
dequantized weights (tests/support/quantized_factory.py says which reference each uses),
through the paged model and through the engine (greedy ids equal)."""
from __future__ import annotations

import json

import pytest
import torch

from tests.support import quantized_factory as qf
from tests.support.engine_helpers import make_engine, request
from tests.unit.engine.test_model import _tokens
from worker.engine.loading.loader import load_model
from worker.engine.models.config import ModelConfig
from worker.engine.quantization.config import parse_quantization

ATOL = 2e-4  # fp32 dequantized weights on both sides; only summation order differs


def _paged_matches(path, ref, n: int = 40, prompt: int = 33):
    qf.assert_paged_matches(load_model(path, dtype=torch.float32), ref, atol=ATOL, n=n, prompt=prompt)


def _engine_greedy_matches(path, ref, n_tokens: int = 12):
    engine = make_engine(path, dtype="float32")
    prompts = [_tokens(21, seed=5), _tokens(9, seed=6)]
    for i, p in enumerate(prompts):
        engine.add_request(request(f"r{i}", p, max_tokens=n_tokens, ignore_eos=True))
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            got.setdefault(delta.request_id, []).extend(delta.token_ids)
    engine.close()
    for i, p in enumerate(prompts):
        ids = list(p)
        with torch.no_grad():
            for _ in range(n_tokens):
                ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
        assert got[f"r{i}"] == ids[len(p):], i


@pytest.fixture(scope="module")
def quant_root(tmp_path_factory):
    return tmp_path_factory.mktemp("quantized")


@pytest.mark.parametrize("scheme", ["w4a16", "w4a16_asym", "w8a16", "fp8", "fp8_block"])
def test_compressed_tensors_matches_its_dequantized_model(tiny_model, quant_root, scheme):
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is in the [test] extra")
    path = qf.write_compressed_tensors(tiny_model("llama"), quant_root / f"ct-{scheme}", scheme)
    cfg = ModelConfig.from_dir(path)
    assert cfg.quantization.method == "compressed-tensors"
    ref = qf.load_dequantized_reference(path)
    # the reference really is quantized: its weights differ from the dense model's
    dense = qf.reference_with_weights(tiny_model("llama"), {})
    assert not torch.equal(ref.model.layers[0].mlp.up_proj.weight, dense.model.layers[0].mlp.up_proj.weight)
    _paged_matches(path, ref)


def test_compressed_tensors_engine_greedy(tiny_model, quant_root):
    pytest.importorskip("compressed_tensors")
    path = qf.write_compressed_tensors(tiny_model("llama"), quant_root / "ct-engine", "w4a16")
    _engine_greedy_matches(path, qf.load_dequantized_reference(path))


def test_fp8_blocks_match_transformers_dequantized(tiny_model, quant_root):
    path = qf.write_fp8_block(tiny_model("llama"), quant_root / "fp8-block")
    assert ModelConfig.from_dir(path).quantization.describe() == "fp8 (fp8 8-bit, block 32x32)"
    ref = qf.load_dequantized_reference(path)
    _paged_matches(path, ref)


def test_awq_matches_dequantized_weights(tiny_model, quant_root):
    path, dense = qf.write_awq(tiny_model("llama"), quant_root / "awq")
    ref = qf.reference_with_weights(tiny_model("llama"), dense)
    _paged_matches(path, ref)
    _engine_greedy_matches(path, ref)


@pytest.mark.parametrize("fmt,sym,act_order,bits", [("gptq", True, False, 4), ("gptq", False, True, 4),
                                                    ("gptq_v2", False, False, 4), ("gptq", True, True, 8)])
def test_gptq_matches_dequantized_weights(tiny_model, quant_root, fmt, sym, act_order, bits):
    path, dense = qf.write_gptq(tiny_model("llama"), quant_root / f"gptq-{fmt}-{sym}-{act_order}-{bits}",
                                sym=sym, act_order=act_order, checkpoint_format=fmt, bits=bits)
    _paged_matches(path, qf.reference_with_weights(tiny_model("llama"), dense))


def test_quantized_moe_experts(tiny_model, quant_root):
    """Every expert of a Mixtral is quantized (GPTQ) and lands in the fused expert weights."""
    src = tiny_model("mixtral")
    path, dense = qf.write_gptq(src, quant_root / "gptq-moe", sym=True)
    assert any(".experts." in k for k in dense)
    _paged_matches(path, qf.reference_with_weights(src, dense), n=24, prompt=17)


def test_missing_part_is_named(tiny_model, quant_root, tmp_path):
    from safetensors.torch import load_file, save_file
    path, _ = qf.write_awq(tiny_model("llama"), tmp_path / "awq-broken")
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.qzeros"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"quantized layer model\.layers\.1\.mlp\.down_proj lacks qzeros"):
        load_model(path)


def test_static_fp8_activation_scales_are_read_and_required(tiny_model, tmp_path):
    """``activation_scheme: static`` makes each FP8 layer's ``input_scale`` one of its parts
    (CUDA's W8A8 GEMM uses it: tests/support/triton_interpreted_quant.py); on CPU the layer
    is dequantized and matches; a static checkpoint without one is refused by name, as
    vLLM requires it; compressed-tensors' static per-tensor float inputs are read as static."""
    from safetensors.torch import load_file, save_file

    src = tiny_model("llama")
    path = qf.write_fp8_tensor(src, tmp_path / "static", static=True)
    _paged_matches(path, qf.reference_with_weights(src, qf.dequantized_fp8(path)), n=24, prompt=17)
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.0.self_attn.k_proj.input_scale"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"quantized layer model\.layers\.0\.self_attn\.k_proj lacks input_scale"):
        load_model(path)
    ct = parse_quantization({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}})
    assert ct.scheme_for("model.layers.0.mlp.down_proj").static_input and ct.activations == "float8 static"
    assert not parse_quantization({"quant_method": "fp8"}).default.static_input


@pytest.mark.parametrize("quant,method", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ({"quant_method": "gguf"}, "gguf"),
    ({"quant_method": "awq", "version": "gemv", "bits": 4}, "awq"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                                                                    "weights": {"num_bits": 4, "type": "float"}}}},
     "compressed-tensors"),
])
def test_unsupported_formats_are_refused_by_name(quant, method):
    with pytest.raises(ValueError, match=rf"quantized checkpoints \(quant_method='{method}'\) are not supported.*"
                                         r"supported quant_methods: fp8, fbgemm_fp8, compressed-tensors, awq, gptq"):
        parse_quantization(quant)


def test_ignored_layers_stay_dense():
    q = parse_quantization({"quant_method": "compressed-tensors", "ignore": ["lm_head", "re:.*mlp.gate$"],
                            "config_groups": {"g": {"targets": ["Linear"], "format": "pack-quantized",
                                                    "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                                "group_size": 128, "symmetric": True}}}})
    assert q.scheme_for("lm_head") is None and q.scheme_for("model.layers.0.mlp.gate") is None
    assert q.scheme_for("model.layers.0.mlp.experts.3.up_proj").kind == "packed"


def test_quantization_argument_is_checked_against_the_checkpoint():
    from worker.engine.quantization.config import check_quantization_arg

    awq = parse_quantization({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"})
    check_quantization_arg(None, awq)
    check_quantization_arg("awq", awq)
    check_quantization_arg("awq_marlin", awq)  # vLLM's kernel choice for the same format
    with pytest.raises(ValueError, match=r"Quantization method specified in the model config \(awq\) does not match "
                                         r"the quantization method specified in the `quantization` argument \(gptq\)"):
        check_quantization_arg("gptq", awq)
    check_quantization_arg("fp8", None)  # online FP8 (quantization/online_fp8.py)
    with pytest.raises(ValueError, match="online quantization at load"):
        check_quantization_arg("fp8_per_block", None)
    with pytest.raises(ValueError, match="Unknown quantization method: bogus"):
        check_quantization_arg("bogus", None)


def test_engine_refuses_a_mismatched_quantization_argument(tiny_model, quant_root):
    path, _ = qf.write_awq(tiny_model("llama"), quant_root / "awq-arg")
    with pytest.raises(ValueError, match="does not match the quantization method"):
        make_engine(path, quantization="gptq")
    engine = make_engine(path, quantization="awq")
    assert engine.model_config.quantization.method == "awq"
    engine.close()
