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
    ids = _tokens(40, seed=4)
    ref = hf_logits(fp8_reference(path), ids)
    dense = hf_logits(load_hf_model(path), ids)
    seqs = PagedSeqs(model)
    (got,) = seqs.step([("a", ids[:33])])
    torch.testing.assert_close(got, ref[:33], atol=1e-4, rtol=0)
    for pos in range(33, 40):
        (got,) = seqs.step([("a", [ids[pos]])])
        torch.testing.assert_close(got[0], ref[pos], atol=1e-4, rtol=0)
    assert (ref - dense).abs().max() > 1e-3  # FP8 really moved the logits


def _greedy(ref, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_engine_online_fp8_greedy_and_weight_updates(tiny_model, tmp_path):
    path = tiny_model("llama")
    engine = make_engine(path, quantization="fp8")
    prompts = [_tokens(17, seed=8), _tokens(5, seed=9)]

    def run(tag):
        reqs = [request(f"{tag}{i}", p, max_tokens=10, ignore_eos=True) for i, p in enumerate(prompts)]
        out = engine.generate(reqs)
        return [[t for d in out[f"{tag}{i}"] for t in d.token_ids] for i in range(len(prompts))]

    ref = fp8_reference(path)
    assert run("a") == [_greedy(ref, p, 10) for p in prompts]
    # An RL weight write of new (dense) weights: served re-quantized, the head unquantized.
    other = tiny_model("llama", seed=1)
    from safetensors.torch import load_file
    new = load_file(str(other / "model.safetensors"))
    engine.rl.write_weights(new)
    engine.rl.end_weight_writes()
    assert run("b") == [_greedy(fp8_reference(other), p, 10) for p in prompts]
    engine.close()


def test_online_fp8_refuses_moe(tiny_model):
    with pytest.raises(ValueError, match="mixture-of-experts model is not supported"):
        make_engine(tiny_model("mixtral"), quantization="fp8")
