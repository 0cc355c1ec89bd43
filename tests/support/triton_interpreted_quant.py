"""Checkpoint-quantized weights kept quantized (CUDA's path, quantization/kept.py) run on
CPU tensors by Triton's interpreter: FP8 checkpoints (compressed-tensors per channel,
``fp8`` per tensor and in blocks) on the W8A8 GEMM, AWQ / GPTQ / compressed-tensors int4
on the W4A16 GEMM.  Not collected on its own: tests/integration/test_triton_interpreted_quant.py
runs it in a subprocess with TRITON_INTERPRET=1 and TOKSERVE_KEEP_QUANTIZED=1.

References: HF transformers running the dequantized weights, with (FP8) a pre-hook
rounding each projection's input per token (per token and block column group for
blocks) to its FP8 values times their scale: what a W8A8 GEMM multiplies.  int4 is
W4A16: the activations are not rounded, so the reference is the dequantized model."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from tests.support import quantized_factory as qf
from tests.support.engine_helpers import make_engine, request
from tests.unit.engine.test_model import _tokens
from worker.engine.loading.loader import load_model
from worker.engine.models.config import ModelConfig
from worker.engine.quantization.kept import Fp8BlockWeight, Int4Weight, KeptQuantized, weight_bytes
from worker.engine.quantization.online_fp8 import Fp8Weight

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or
                                os.environ.get("TOKSERVE_KEEP_QUANTIZED") != "1",
                                reason="needs TRITON_INTERPRET=1 and TOKSERVE_KEEP_QUANTIZED=1")

ATOL = 5e-4  # fp32 on both sides; the interpreted GEMMs sum in another order


def kept_model(path):
    quant = ModelConfig.from_dir(path).quantization
    kept = KeptQuantized(quant)
    model = load_model(path, dtype=torch.float32, keep=kept.keep, filled=kept.filled)
    kept.bind(model)
    model.pack_linears(kept.scheme())
    kept.finish()
    return model, kept


def _paged_matches(model, ref, n=30, prompt=21):
    qf.assert_paged_matches(model, ref, atol=ATOL, n=n, prompt=prompt)


def _linear_bytes(model):
    return sum(weight_bytes(getattr(layer, name)) for layer in model.layers for name in layer._LINEAR_WEIGHTS)


def _dense_bytes(model, bytes_per=2):  # what the same projections hold in bf16
    return sum(getattr(layer, name).shape[0] * getattr(layer, name).shape[1] * bytes_per
               for layer in model.layers for name in layer._LINEAR_WEIGHTS)


@pytest.mark.parametrize("kind", ["tensor", "block", "ct_channel", "ct_block"])
def test_fp8_kept_matches_w8a8_reference(tiny_model, tmp_path, kind):
    src = tiny_model("llama")
    if kind == "tensor":
        path, group = qf.write_fp8_tensor(src, tmp_path / "fp8"), None
    elif kind == "block":
        path, group = qf.write_fp8_block(src, tmp_path / "fp8"), 32
    else:
        pytest.importorskip("compressed_tensors")
        block = kind == "ct_block"
        path, group = qf.write_compressed_tensors(src, tmp_path / "fp8", "fp8_block" if block else "fp8"), (
            32 if block else None)
    model, kept = kept_model(path)
    layer = model.layers[0]
    assert isinstance(layer.qkv_weight, Fp8BlockWeight if kind.endswith("block") else Fp8Weight)
    if kind.endswith("block"):  # q/k/v parts are whole 32-row blocks: the scales stay per block
        assert layer.qkv_weight.block == (32, 32) and layer.qkv_weight.scale.shape == (128 // 32, 64 // 32)
    assert kept.kept == 4 * len(model.layers)  # qkv, o, gate_up, down
    # the kept bytes are the checkpoint's FP8 values, bit for bit
    state = load_file(str(path / "model.safetensors"))
    o = layer.o_weight
    assert torch.equal(o.q.view(torch.uint8), state["model.layers.0.self_attn.o_proj.weight"].view(torch.uint8))
    # about half of bf16's bytes (FP8 plus fp32 scales)
    assert _linear_bytes(model) < 0.56 * _dense_bytes(model)
    ref = qf.with_fp8_rounded_inputs(qf.reference_with_weights(src, qf.dequantized_fp8(path)), group)
    _paged_matches(model, ref)


def test_engine_serves_fp8_kept_and_requantizes_weight_updates(tiny_model, tmp_path):
    src = tiny_model("llama")
    path = qf.write_fp8_block(src, tmp_path / "fp8")
    engine = make_engine(path)
    layer = engine.runner.model.layers[0]
    assert isinstance(layer.gate_up_weight, Fp8BlockWeight)
    assert engine.runner.model.packing.name == "fp8 kept quantized (Triton FP8 W8A8)"
    prompts = [_tokens(13, seed=8), _tokens(5, seed=9)]

    def run(tag):
        reqs = [request(f"{tag}{i}", p, max_tokens=6, ignore_eos=True) for i, p in enumerate(prompts)]
        out = engine.generate(reqs)
        return [[t for d in out[f"{tag}{i}"] for t in d.token_ids] for i in range(len(prompts))]

    ref = qf.with_fp8_rounded_inputs(qf.reference_with_weights(src, qf.dequantized_fp8(path)), 32)
    assert run("a") == [qf.greedy(ref, p, 6) for p in prompts]
    # an RL update sends dense weights: re-quantized per row (online FP8's numerics)
    other = tiny_model("llama", seed=1)
    engine.rl.write_weights(load_file(str(other / "model.safetensors")))
    engine.rl.end_weight_writes()
    assert isinstance(engine.runner.model.layers[0].gate_up_weight, Fp8Weight)  # re-quantized per row
    from tests.unit.engine.test_online_fp8 import fp8_reference
    assert run("b") == [qf.greedy(fp8_reference(other), p, 6) for p in prompts]
    engine.close()


@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq_asym", "ct_w4a16", "ct_w4a16_asym"])
def test_int4_kept_matches_dequantized(tiny_model, tmp_path, fmt):
    src = tiny_model("llama")
    if fmt == "awq":
        path, dense = qf.write_awq(src, tmp_path / "q")
        ref = qf.reference_with_weights(src, dense)
    elif fmt.startswith("gptq"):
        path, dense = qf.write_gptq(src, tmp_path / "q", sym=fmt == "gptq")
        ref = qf.reference_with_weights(src, dense)
    else:
        pytest.importorskip("compressed_tensors")
        path = qf.write_compressed_tensors(src, tmp_path / "q", fmt[3:])
        ref = qf.load_dequantized_reference(path)
    model, kept = kept_model(path)
    assert isinstance(model.layers[1].down_weight, Int4Weight)
    assert kept.kept == 4 * len(model.layers)  # qkv, o, gate_up, down
    # nibbles, fp32 scales and uint8 zero points per 32 weights: (0.5 + 0.125 + 0.03) / 2 bytes
    assert _linear_bytes(model) < 0.34 * _dense_bytes(model)
    _paged_matches(model, ref)


def test_gptq_act_order_kept_int4(tiny_model, tmp_path):
    """Act-order (g_idx) kept int4: each weight's columns in group order, the GEMM reading
    the input permuted the same way; matches the dequantized reference."""
    src = tiny_model("llama")
    path, dense = qf.write_gptq(src, tmp_path / "q", sym=False, act_order=True)
    model, kept = kept_model(path)
    assert kept.kept == 4 * len(model.layers) and not kept.refused
    w = model.layers[0].qkv_weight
    assert isinstance(w, Int4Weight) and w.perm is not None and w.zero is not None
    _paged_matches(model, qf.reference_with_weights(src, dense))


def test_engine_serves_awq_kept(tiny_model, tmp_path):
    src = tiny_model("llama")
    path, dense = qf.write_awq(src, tmp_path / "awq")
    engine = make_engine(path)
    assert isinstance(engine.runner.model.layers[0].qkv_weight, Int4Weight)
    assert engine.runner.model.packing.name == "awq kept quantized (Triton int4 W4A16)"
    ref = qf.reference_with_weights(src, dense)
    prompts = [_tokens(11, seed=5), _tokens(4, seed=6)]
    out = engine.generate([request(f"r{i}", p, max_tokens=6, ignore_eos=True) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert [t for d in out[f"r{i}"] for t in d.token_ids] == qf.greedy(ref, p, 6)
    engine.close()


def test_triton_attention_applies_kv_scales_over_fp8():
    """The checkpoint's KV-cache scales through the Triton backend (cache write and unified
    attention): with them, FP8 attention over K/V beyond e4m3's range tracks the float32
    cache; at scale 1.0 it saturates."""
    from tests.support.fp8_kv_scale_case import BLOCK, kv_scale_case
    from worker.engine.attention.selector import resolve_attention_backend

    def triton(cache_dtype):
        fp8 = None if cache_dtype == torch.float32 else cache_dtype
        return resolve_attention_backend("triton", "auto", torch.device("cpu"), torch.float32, BLOCK, fp8)

    run, ks, vs, _ = kv_scale_case(triton)
    ref = run(torch.float32, None)[0]
    err_scaled = (run(torch.float8_e4m3fn, (ks, vs))[0] - ref).abs().max().item()
    err_unscaled = (run(torch.float8_e4m3fn, None)[0] - ref).abs().max().item()
    assert err_scaled < 0.1 * err_unscaled and err_scaled < 0.07 * ref.abs().max().item(), (err_scaled, err_unscaled)


# --- online FP8 on mixture-of-experts models (kernels/triton/fused_moe.fused_experts_fp8) ---
def test_fused_experts_fp8_is_the_emulated_w8a8():
    """The fused-MoE kernel over FP8 stacks equals the CPU emulation: the grouped torch
    GEMMs over the FP8-rounded weights with each GEMM's input rows rounded per row."""
    from worker.engine.kernels.triton import ops as triton_ops
    from worker.engine.kernels.triton.fused_moe import fused_experts_fp8
    from worker.engine.models.moe import fused_experts_torch, silu_and_mul
    from worker.engine.quantization.online_fp8 import _dequantize, quantize_stack, round_rows

    g = torch.Generator().manual_seed(3)
    e, h, i, t, k = 6, 64, 48, 13, 2
    w13, w2 = quantize_stack(torch.randn(e, 2 * i, h, generator=g) * 0.1), quantize_stack(
        torch.randn(e, h, i, generator=g) * 0.1)
    x = torch.randn(t, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    got = fused_experts_fp8(x, w13.q, w13.scale, w2.q, w2.scale, weights, ids, triton_ops().silu_and_mul)
    want = fused_experts_torch(x, _dequantize(w13), _dequantize(w2), weights, ids, silu_and_mul,
                               round_input=round_rows)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["tensor", "block"])
def test_fp8_checkpoint_experts_kept_fp8(tiny_model, tmp_path, kind):
    """An FP8 Mixtral checkpoint (every expert's w1/w2/w3 quantized, the router not): the
    expert stacks stay FP8 on the fused-MoE kernel -- per-tensor scales as one per expert
    and row, 32 x 32 blocks per block (activations per token and 32-column group) -- and
    match HF running the dequantized weights with each GEMM's input rounded the same way;
    an RL update re-quantizes the stacks per row."""
    from worker.engine.quantization.kept_experts import unpack_experts

    src = tiny_model("mixtral")
    if kind == "tensor":
        path, group = qf.write_fp8_tensor(src, tmp_path / "q"), None
    else:
        path, group = qf.write_fp8_block(src, tmp_path / "q", block=(32, 32)), 32
    model, kept = kept_model(path)
    moe = model.layers[0].moe
    cfg = model.config
    e, inter, h = cfg.moe.num_experts, moe.w2.shape[2], cfg.hidden_size
    want = Fp8Weight if kind == "tensor" else Fp8BlockWeight
    assert isinstance(moe.w13, want) and isinstance(moe.w2, want) and moe.w13.q.shape == (e, 2 * inter, h)
    assert isinstance(moe.gate_weight, torch.nn.Parameter)  # the router stays dense
    state = load_file(str(path / "model.safetensors"))
    # the checkpoint's FP8 bytes, bit for bit, expert by expert (w1 rows, then w3's)
    b = "model.layers.0.block_sparse_moe.experts.3."
    q13 = torch.cat([state[b + "w1.weight"], state[b + "w3.weight"]])
    assert torch.equal(moe.w13.q[3].view(torch.uint8), q13.view(torch.uint8))
    ref = qf.reference_with_weights(src, qf.dequantized_fp8(path))
    ref = qf.with_fp8_rounded_expert_inputs(qf.with_fp8_rounded_inputs(ref, group), group)
    _paged_matches(model, ref, n=24, prompt=17)
    # an RL update: unpack gives the dense stack back (exactly), the pack after it re-quantizes per row
    scheme = model.packing
    dense = scheme.experts.unpack(moe.w13)
    assert torch.equal(dense, unpack_experts(moe.w13))
    again = scheme.experts.pack(dense)
    assert isinstance(again, Fp8Weight) and again.scale.shape == (e, 2 * inter)


def test_fp8_static_activation_scales(tiny_model, tmp_path):
    """``activation_scheme: static``: each layer's calibrated ``input_scale`` is read (the
    reader waits for it), fused q/k/v and gate/up run with their parts' largest (vLLM's
    rule), and the W8A8 GEMM quantizes its input with it instead of per token: matches HF
    with the same static rounding, and not the dynamic one.  An RL update re-quantizes the
    weights and keeps the static scale."""
    src = tiny_model("llama")
    path = qf.write_fp8_tensor(src, tmp_path / "q", static=True)
    model, kept = kept_model(path)
    w = model.layers[0].qkv_weight
    scales = qf.static_input_scales(path)
    assert isinstance(w, Fp8Weight) and w.input_scale is not None
    assert torch.equal(w.input_scale, scales["model.layers.0.self_attn.q_proj"])
    ref = qf.reference_with_weights(src, qf.dequantized_fp8(path))
    ids, logits = qf.assert_paged_matches(model, qf.with_static_fp8_inputs(ref, scales), atol=ATOL, n=24, prompt=17)
    dynamic = qf.with_fp8_rounded_inputs(qf.reference_with_weights(src, qf.dequantized_fp8(path)))
    from tests.unit.engine.test_model import hf_logits
    assert (hf_logits(dynamic, ids) - logits).abs().max() > 10 * ATOL  # the static scales are what ran
    again = model.packing.pack(model.packing.unpack(w))
    assert isinstance(again, Fp8Weight) and torch.equal(again.input_scale, w.input_scale)


@pytest.mark.parametrize("act_order", [False, True])
def test_int4_checkpoint_experts_kept_int4(tiny_model, tmp_path, act_order):
    """A GPTQ Mixtral: every expert kept int4 in one stack on the fused-MoE kernel's W4A16
    mode (act-order: each expert its own column order, its input read through it), the
    router dense; matches HF running the dequantized weights; an RL update's unpack gives
    the dense stack back and the next pack re-quantizes it per expert and group."""
    from worker.engine.kernels.triton.fused_moe import Int4Stack
    from worker.engine.quantization.kept import Int4Experts

    src = tiny_model("mixtral")
    path, dense = qf.write_gptq(src, tmp_path / "q", sym=not act_order, act_order=act_order)
    model, kept = kept_model(path)
    moe = model.layers[0].moe
    assert isinstance(moe.w13, Int4Experts) and isinstance(moe.w13.stack, Int4Stack)
    assert (moe.w13.stack.perm is not None) == act_order and (moe.w13.stack.zero is not None) == act_order
    assert kept.kept == 4 * len(model.layers) and not kept.refused
    _paged_matches(model, qf.reference_with_weights(src, dense), n=24, prompt=17)
    stack = model.packing.experts.unpack(moe.w2)
    want = torch.stack([dense[f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight"] for e in range(stack.shape[0])])
    assert (stack - want).abs().max() < 1e-6
    again = model.packing.experts.pack(stack)
    assert isinstance(again, Int4Experts) and again.stack.perm is None


@pytest.mark.parametrize("fmt", ["fp8_block_moe", "gptq_act_order"])
def test_kept_quantized_over_two_ranks(tiny_model, tmp_path, fmt):
    """Tensor parallelism (CUDA's kept schemes, each rank a process, gloo between them):
    each rank cuts the records to its shard -- FP8 blocks to one scale per row and
    32-column group of its rows, whole column groups of o/down and each expert's w2 -- and
    keeps its shard quantized; greedy tokens equal one rank's and the reference's."""
    from tests.support.engine_helpers import greedy_ids, random_prompts

    if fmt == "fp8_block_moe":
        src = tiny_model("mixtral")
        path = qf.write_fp8_block(src, tmp_path / "q", block=(32, 32))
        ref = qf.reference_with_weights(src, qf.dequantized_fp8(path))
        ref = qf.with_fp8_rounded_expert_inputs(qf.with_fp8_rounded_inputs(ref, 32), 32)
    else:
        src = tiny_model("llama")
        path, dense = qf.write_gptq(src, tmp_path / "q", sym=False, act_order=True)
        ref = qf.reference_with_weights(src, dense)
    prompts = random_prompts(2, 5, 20, seed=21)
    two = make_engine(path, tensor_parallel_size=2)
    layer = two.model.layers[0]
    if fmt == "fp8_block_moe":
        assert isinstance(layer.qkv_weight, Fp8BlockWeight) and isinstance(layer.moe.w13, Fp8BlockWeight)
        assert layer.moe.w13.q.shape[1] == 2 * two.model.config.intermediate_size // 2  # this rank's half
    else:  # act-order: q/k/v and gate/up (column-parallel) kept with their order, o/down dense
        assert isinstance(layer.qkv_weight, Int4Weight) and layer.qkv_weight.perm is not None
        assert isinstance(layer.o_weight, torch.Tensor)
    assert greedy_ids(two, prompts, 5, close=True) == [qf.greedy(ref, p, 5) for p in prompts]


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_online_fp8_moe_on_triton_matches_the_fp8_reference(tiny_model, kind):
    from tests.unit.engine.test_online_fp8 import fp8_moe_reference
    from worker.engine.attention.selector import resolve_attention_backend
    from worker.engine.quantization.online_fp8 import triton_fp8_scheme

    path = tiny_model(kind)
    model = load_model(path, dtype=torch.float32)
    model.use_attention_backend(resolve_attention_backend("triton", "auto", torch.device("cpu"), torch.float32, 4))
    model.pack_linears(triton_fp8_scheme())
    moe = next(layer.moe for layer in model.layers if layer.moe is not None)
    assert isinstance(moe.w13, Fp8Weight) and moe.w13.q.shape[0] == model.config.moe.num_experts
    _paged_matches(model, fp8_moe_reference(path), n=24, prompt=17)
