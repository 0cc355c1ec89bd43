"""Online FP8 (``--quantization fp8`` on an unquantized checkpoint, vLLM's flag): every
decoder projection W8A8 (weights per output channel, activations per token, dynamic),
the LM head unquantized.  The reference is HF transformers with each projection's
weight replaced by its FP8 values times their scale and a pre-hook rounding the
projection's input per token the same way: what an FP8 GEMM multiplies.  Checked
through the paged model and the engine (greedy), after RL weight writes (re-quantized),
and the Triton W8A8 scheme (CUDA's) under the interpreter in
tests/support/triton_interpreted_kernels.py."""
from __future__ import annotations

import pytest
import torch

from tests.support import quantized_factory as qf
from tests.support.engine_helpers import make_engine, request
from tests.support.model_factory import load_hf_model
from tests.unit.engine.test_model import PagedSeqs, _tokens, hf_logits
from worker.engine.loading.loader import load_model
from worker.engine.quantization.online_fp8 import emulated_fp8_scheme, quantize_rows, round_rows

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8_reference(model_dir):
    hf = load_hf_model(model_dir)
    for name, module in hf.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTIONS:
            with torch.no_grad():
                module.weight.copy_(round_rows(module.weight))
            module.register_forward_pre_hook(lambda mod, args: (round_rows(args[0]),))
    return hf


def fp8_moe_reference(model_dir):
    """``fp8_reference`` plus the routed experts: every expert's rows rounded to FP8 (one
    scale per expert and output row) and their GEMM inputs rounded per row; the router
    (``gate``) and Qwen2-MoE's ``shared_expert_gate`` stay unquantized, as in vLLM."""
    hf = fp8_reference(model_dir)
    for name, module in hf.named_modules():
        if name.endswith("mlp.experts") and hasattr(module, "gate_up_proj"):
            with torch.no_grad():
                for p in (module.gate_up_proj, module.down_proj):
                    p.copy_(round_rows(p.reshape(-1, p.shape[-1])).reshape(p.shape))
    return qf.with_fp8_rounded_expert_inputs(hf)


def test_rounding_is_fp8_per_row():
    w = torch.randn(6, 40) * torch.logspace(-3, 2, 6)[:, None]
    q, scale = quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn
    assert torch.equal(q.float().abs().amax(1), torch.full((6,), 448.0))  # each row's amax maps to 448
    r = round_rows(w)
    assert torch.equal(round_rows(r), r)  # re-quantizing FP8 values is exact (updates re-pack)
    assert ((r - w).abs() <= w.abs().amax(1, keepdim=True) / 448 * 16).all()  # within a few e4m3 steps


def test_paged_model_matches_the_fp8_reference(tiny_model):
    path = tiny_model("llama")
    model = load_model(path, dtype=torch.float32)
    model.pack_linears(emulated_fp8_scheme(None))
    ids, ref = qf.assert_paged_matches(model, fp8_reference(path), atol=1e-4, n=40, prompt=33, seed=4)
    dense = hf_logits(load_hf_model(path), ids)
    assert (ref - dense).abs().max() > 1e-3  # FP8 really moved the logits


@pytest.mark.parametrize("kind, reference, n, lens", [("llama", fp8_reference, 10, (17, 5)),
                                                      ("qwen2_moe", fp8_moe_reference, 8, (15, 6))])
def test_engine_online_fp8_greedy_and_weight_updates(tiny_model, kind, reference, n, lens):
    """Greedy ids equal the FP8 reference's, and again after an RL weight write of new
    (dense) weights: served re-quantized (experts included), the head unquantized."""
    path = tiny_model(kind)
    engine = make_engine(path, quantization="fp8")
    prompts = [_tokens(lens[0], seed=8), _tokens(lens[1], seed=9)]

    def run(tag):
        reqs = [request(f"{tag}{i}", p, max_tokens=n, ignore_eos=True) for i, p in enumerate(prompts)]
        out = engine.generate(reqs)
        return [[t for d in out[f"{tag}{i}"] for t in d.token_ids] for i in range(len(prompts))]

    ref = reference(path)
    assert run("a") == [qf.greedy(ref, p, n) for p in prompts]
    other = tiny_model(kind, seed=1)
    from safetensors.torch import load_file
    engine.rl.write_weights(load_file(str(other / "model.safetensors")))
    engine.rl.end_weight_writes()
    ref = reference(other)
    assert run("b") == [qf.greedy(ref, p, n) for p in prompts]
    engine.close()


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_moe_paged_model_matches_the_fp8_reference(tiny_model, kind):
    """Experts W8A8 (emulated on CPU) and Qwen2-MoE's shared expert quantized, the routers
    not: against HF with the same rounding."""
    path = tiny_model(kind)
    model = load_model(path, dtype=torch.float32)
    model.pack_linears(emulated_fp8_scheme(None))
    moe = next(layer.moe for layer in model.layers if layer.moe is not None)
    assert isinstance(moe.gate_weight, torch.nn.Parameter)  # the router stays dense
    ids, ref = qf.assert_paged_matches(model, fp8_moe_reference(path), atol=1e-4, n=30, prompt=23, seed=4)
    assert (ref - hf_logits(fp8_reference(path), ids)).abs().max() > 1e-4  # the experts' rounding counts


def test_moe_experts_over_the_native_bf16_gemm_match_the_torch_emulation(tiny_model):
    """bf16 on CPU: the experts run per expert on the native GEMM (packed, inputs rounded
    per row) and compute what the grouped torch emulation computes, up to bf16 rounding."""
    from worker.engine.models.cpu_gemm import linear_scheme, native_supported

    if not native_supported(torch.device("cpu"), torch.bfloat16):
        pytest.skip("the native bf16 GEMM does not run on this CPU/build")
    path = tiny_model("qwen2_moe")
    ids = _tokens(20, seed=6)
    out = []
    for inner in (linear_scheme("native"), None):
        model = load_model(path, dtype=torch.bfloat16)
        model.pack_linears(emulated_fp8_scheme(inner))
        moe = next(layer.moe for layer in model.layers if layer.moe is not None)
        assert isinstance(moe.w13, list if inner is not None else torch.Tensor)
        seqs = PagedSeqs(model)
        out.append(seqs.step([("a", ids)])[0].float())
    assert (out[0] - out[1]).abs().max() < 0.05 * out[1].abs().max()


def test_online_fp8_refuses_experts_with_biases(tiny_model):
    with pytest.raises(ValueError, match="experts have biases"):
        make_engine(tiny_model("gpt_oss"), quantization="fp8")
