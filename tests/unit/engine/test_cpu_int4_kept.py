"""int4 checkpoints kept int4 in memory on CPU (quantization/kept.py's CPU scheme over
kernels/int4_gemm.cpp): AWQ, GPTQ (symmetric, with zero points), compressed-tensors
W4A16 (the real library writes them) against HF transformers running the dequantized
weights, through the paged model and the engine; the resident projection bytes; the
layers not kept int4 on the engine's CPU linear scheme; an RL weight update re-quantized
and greedy-equal to a reference holding the re-quantized weights; a request's logprobs
alone equal to inside a batch of 32 (bitwise); GPTQ act-order kept int4 with its columns
in group order (the GEMM reads the input permuted); FP8 layers, and fused act-order parts
in different orders, dequantized."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.support import quantized_factory as qf
from tests.support.engine_helpers import make_engine, request
from tests.unit.engine.test_model import PagedSeqs, _tokens, hf_logits
from worker.engine.loading.loader import load_model
from worker.engine.models.config import ModelConfig
from worker.engine.models.cpu_gemm import linear_scheme, resolve_cpu_linear
from worker.engine.quantization.kept import CpuInt4Weight, KeptQuantized, cpu_int4_kernels, weight_bytes

CPU = torch.device("cpu")
kernels = cpu_int4_kernels(CPU)
pytestmark = pytest.mark.skipif(kernels is None, reason="compiled CPU kernels unavailable (or the Triton path forced)")

# fp32 on both sides: the kernel sums x * q per group then scales, HF multiplies by the
# dequantized fp32 weight; only the rounding order differs (as test_quantized_models).
ATOL = 2e-4
GROUP = 32  # the factories' group size


def _checkpoint(src, tmp_path, fmt):
    """(path, HF reference running the dequantized weights)."""
    if fmt == "awq":
        path, dense = qf.write_awq(src, tmp_path / "q")
        return path, qf.reference_with_weights(src, dense)
    if fmt.startswith("gptq"):
        path, dense = qf.write_gptq(src, tmp_path / "q", sym=fmt == "gptq", act_order=fmt.endswith("act"))
        return path, qf.reference_with_weights(src, dense)
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is in the [test] extra")
    path = qf.write_compressed_tensors(src, tmp_path / "q", fmt[3:])
    return path, qf.load_dequantized_reference(path)


def kept_model(path, dtype=torch.float32):
    """The paged model as model_setup builds it on CPU: int4 layers kept, the rest on the
    CPU linear scheme ``auto`` picks for ``dtype``."""
    kept = KeptQuantized(ModelConfig.from_dir(path).quantization, kernels)
    model = load_model(path, dtype=dtype, keep=kept.keep, filled=kept.filled)
    kept.bind(model)
    model.pack_linears(kept.scheme(linear_scheme(resolve_cpu_linear("auto", CPU, dtype))))
    kept.finish()
    return model, kept


def _linear_bytes(model):
    return sum(weight_bytes(getattr(layer, name)) for layer in model.layers for name in layer._LINEAR_WEIGHTS)


def _bf16_bytes(model):  # what the same projections hold dequantized to bf16
    return sum(getattr(layer, name).shape[0] * getattr(layer, name).shape[1] * 2
               for layer in model.layers for name in layer._LINEAR_WEIGHTS)


def _paged_matches(model, ref, n=30, prompt=21):
    qf.assert_paged_matches(model, ref, atol=ATOL, n=n, prompt=prompt)


@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq_asym", "gptq_asym_act", "ct_w4a16", "ct_w4a16_asym"])
def test_int4_kept_matches_dequantized(tiny_model, tmp_path, fmt):
    src = tiny_model("llama")
    path, ref = _checkpoint(src, tmp_path, fmt)
    model, kept = kept_model(path)
    assert all(isinstance(getattr(layer, name), CpuInt4Weight) for layer in model.layers
               for name in layer._LINEAR_WEIGHTS)
    assert kept.kept == 4 * len(model.layers) and not kept.refused  # qkv, o, gate_up, down
    # act-order: each kept weight reads its input in group order (the checkpoint's g_idx sorted)
    g_idx = load_file(str(path / "model.safetensors")).get("model.layers.0.self_attn.q_proj.g_idx")
    perm = model.layers[0].qkv_weight.perm
    assert (perm is None) == (g_idx is None or not fmt.endswith("act"))
    if perm is not None:
        assert torch.equal(g_idx.long()[perm.long()], torch.arange(g_idx.numel()) // GROUP)
    # nibbles, fp32 scales and uint8 zero points per 32 weights: (0.5 + 5 / 32) / 2 = 0.33 of bf16
    assert _linear_bytes(model) < 0.35 * _bf16_bytes(model)
    _paged_matches(model, ref)


def test_act_order_parts_in_different_orders_and_fp8_layers_stay_dense(tiny_model, tmp_path):
    """q/k/v (gate/up) act-order parts in different column orders cannot share one kept
    weight: those fused projections load dequantized, o/down stay int4 (each one layer);
    FP8 (compressed-tensors) is dequantized on CPU by design: every layer then runs on the
    CPU linear scheme.  Both match."""
    src = tiny_model("llama")
    path, dense = qf.write_gptq(src, tmp_path / "act", sym=False, act_order=True, shared_order=False)
    model, kept = kept_model(path)
    assert kept.kept == 2 * len(model.layers) and not kept.refused
    layer = model.layers[0]
    assert not isinstance(layer.qkv_weight, CpuInt4Weight) and not isinstance(layer.gate_up_weight, CpuInt4Weight)
    assert isinstance(layer.o_weight, CpuInt4Weight) and layer.o_weight.perm is not None
    assert isinstance(layer.down_weight, CpuInt4Weight) and layer.down_weight.perm is not None
    _paged_matches(model, qf.reference_with_weights(src, dense))
    pytest.importorskip("compressed_tensors")
    path = qf.write_compressed_tensors(src, tmp_path / "fp8", "fp8")
    model, kept = kept_model(path)
    assert kept.kept == 0 and not kept.refused and len(kept.dense_here) == 7 * len(model.layers)
    assert isinstance(model.layers[0].qkv_weight, torch.Tensor)
    _paged_matches(model, qf.load_dequantized_reference(path))


def test_bf16_model_keeps_int4_and_runs_the_rest_on_the_native_gemm(tiny_model, tmp_path):
    """In bf16 the layers not kept int4 (the LM head here) run on the bf16 scheme the CPU
    chose (native where it runs), not torch's emulated bf16 linear; logits stay within
    bf16 rounding of the fp32 reference."""
    src = tiny_model("llama")
    path, ref = _checkpoint(src, tmp_path, "awq")
    model, _ = kept_model(path, torch.bfloat16)
    chosen = resolve_cpu_linear("auto", CPU, torch.bfloat16)
    assert model.packing.head_scheme.name == chosen and chosen in model.packing.name
    assert isinstance(model.layers[0].down_weight, CpuInt4Weight) and model.layers[0].down_weight.dtype == torch.bfloat16
    ids = _tokens(20, seed=4)
    want = hf_logits(ref, ids)
    (got,) = PagedSeqs(model).step([("a", ids)])
    assert got.dtype == torch.float32 or got.dtype == torch.bfloat16
    err = (got.float() - want).abs().max()
    assert err < 0.05 * want.abs().max(), err  # bf16 activations through 2 layers


def _requantized(state: dict, group: int = GROUP) -> dict:
    """What an RL update's re-quantization holds, computed here independently of kept.py:
    round to nearest per ``group`` input columns with a zero point (0 inside [lo, hi])."""
    out = {}
    for name in qf._linears(state):
        w = state[name + ".weight"].float()
        g = w.reshape(w.shape[0], -1, group)
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp_min(1e-12)
        zero = torch.round(-lo / scale).clamp(0, 15)
        q = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, 15)
        out[name + ".weight"] = ((q - zero[..., None]) * scale[..., None]).reshape(w.shape)
    return out


def test_engine_keeps_awq_int4_and_requantizes_weight_updates(tiny_model, tmp_path, caplog):
    src = tiny_model("llama")
    path, ref = _checkpoint(src, tmp_path, "awq")
    with caplog.at_level("INFO", logger="worker.engine.loading.model_setup"):
        engine = make_engine(path)
    assert "int4 layers kept int4 (CPU W4A16 GEMM)" in caplog.text  # what the worker's log says
    model = engine.runner.model
    assert isinstance(model.layers[0].qkv_weight, CpuInt4Weight)
    assert model.packing.name.startswith("awq: int4 layers kept int4 (CPU W4A16 GEMM), other layers ")
    prompts = [_tokens(13, seed=8), _tokens(5, seed=9)]

    def run(tag):
        reqs = [request(f"{tag}{i}", p, max_tokens=6, ignore_eos=True) for i, p in enumerate(prompts)]
        out = engine.generate(reqs)
        return [[t for d in out[f"{tag}{i}"] for t in d.token_ids] for i in range(len(prompts))]

    assert run("a") == [qf.greedy(ref, p, 6) for p in prompts]
    # an RL update sends dense weights: re-quantized to int4 (per group, zero points)
    other = tiny_model("llama", seed=1)
    state = load_file(str(other / "model.safetensors"))
    engine.rl.write_weights(state)
    engine.rl.end_weight_writes()
    assert all(isinstance(getattr(layer, name), CpuInt4Weight) for layer in model.layers
               for name in layer._LINEAR_WEIGHTS)
    assert run("b") == [qf.greedy(qf.reference_with_weights(other, _requantized(state)), p, 6) for p in prompts]
    engine.close()


@pytest.mark.parametrize("act_order", [False, True])
def test_moe_experts_kept_int4_per_expert(tiny_model, tmp_path, act_order):
    """A GPTQ Mixtral: the attention projections and every expert kept int4 (one W4A16
    weight per expert, its own scales, zero points and -- act-order -- column order, run per
    expert group), the router dense; matches HF with the dequantized weights in fp32, and
    within bf16 rounding in bf16 (the rest on the native GEMM).  An RL update's unpack gives
    the dense stack back and the next pack re-quantizes it per expert."""
    src = tiny_model("mixtral")
    path, dense = qf.write_gptq(src, tmp_path / "moe", sym=not act_order, act_order=act_order)
    model, kept = kept_model(path)
    layer = model.layers[0]
    assert isinstance(layer.qkv_weight, CpuInt4Weight) and isinstance(layer.o_weight, CpuInt4Weight)
    moe = layer.moe
    assert len(moe.w13) == model.config.moe.num_experts and all(isinstance(w, CpuInt4Weight) for w in moe.w13 + moe.w2)
    assert isinstance(moe.gate_weight, torch.nn.Parameter)  # the router stays dense
    assert kept.kept == 4 * len(model.layers) and not kept.refused  # qkv, o and the two expert stacks
    if act_order:  # each expert in its own column order
        assert moe.w13[0].perm is not None and not torch.equal(moe.w13[0].perm, moe.w13[1].perm)
    ref = qf.reference_with_weights(src, dense)
    _paged_matches(model, ref, n=24, prompt=17)
    stack = model.packing.experts.unpack(moe.w2)
    want = torch.stack([dense[f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight"]
                        for e in range(stack.shape[0])])
    assert (stack - want).abs().max() < 1e-6  # the checkpoint's values, exactly as dequantized
    again = model.packing.experts.pack(stack)
    assert all(isinstance(w, CpuInt4Weight) and w.perm is None for w in again)  # re-quantized per group
    model, _ = kept_model(path, torch.bfloat16)
    assert all(isinstance(w, CpuInt4Weight) for w in model.layers[0].moe.w13)
    ids = _tokens(12, seed=2)
    want = hf_logits(ref, ids)
    (got,) = PagedSeqs(model).step([("a", ids)])
    # bf16 activations through 2 layers: each position within bf16 rounding of the fp32
    # reference, except where the router's top-2 is a near-tie that bf16 flips (the
    # dequantized bf16 model flips the same positions; which ones depends on the CPU's
    # bf16 GEMM): at most a quarter of them
    close = (got.float() - want).abs().amax(-1) < 0.05 * want.abs().max()
    assert close.float().mean() >= 0.75, close


def test_without_the_kernels_int4_loads_dequantized_and_says_so(tiny_model, tmp_path, monkeypatch, caplog):
    from worker.engine.loading import model_setup

    src = tiny_model("llama")
    path, ref = _checkpoint(src, tmp_path, "awq")
    monkeypatch.setattr(model_setup, "cpu_int4_kernels", lambda device: None)
    with caplog.at_level("WARNING", logger="worker.engine.loading.model_setup"):
        engine = make_engine(path)
    assert "int4 checkpoint: weights dequantized at load" in caplog.text
    model = engine.runner.model
    assert not isinstance(model.layers[0].qkv_weight, CpuInt4Weight) and "kept" not in (
        model.packing.name if model.packing is not None else "")
    prompt = _tokens(9, seed=1)
    out = engine.generate([request("r", prompt, max_tokens=5, ignore_eos=True)])
    assert [t for d in out["r"] for t in d.token_ids] == qf.greedy(ref, prompt, 5)
    engine.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logprobs_alone_equal_inside_a_batch_of_32_bitwise(tiny_model, tmp_path, dtype):
    """A request's logprobs on the kept-int4 model do not depend on the batch it runs in:
    the int4 GEMM sums every element in the same order for any row count."""
    from common.dtype_policy import cpu_runs_bf16_fast
    from tests.support.engine_helpers import random_prompts

    if dtype == "bfloat16" and not cpu_runs_bf16_fast():
        pytest.skip("bf16 serving is emulated on this CPU")
    path, _ = _checkpoint(tiny_model("llama"), tmp_path, "awq")
    prompts = random_prompts(32, 5, 60, seed=7)
    params = dict(max_tokens=8, ignore_eos=True, logprobs=5)

    def run(ps):
        engine = make_engine(path, dtype=dtype, max_num_seqs=32, max_num_batched_tokens=2048)
        assert isinstance(engine.runner.model.layers[0].down_weight, CpuInt4Weight)
        out = engine.generate([request(str(i), p, **params) for i, p in enumerate(ps)])
        engine.close()
        d = out["0"][0]
        return d.token_ids, d.logprobs.logprobs, d.logprobs.top_logprobs

    assert run(prompts[:1]) == run(prompts)
