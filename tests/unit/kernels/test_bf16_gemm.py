"""The native bf16 GEMM (worker/engine/kernels/bf16_gemm.cpp, ``--cpu-linear native``):
packing is exact and shape-preserving, results equal an fp32 GEMM of the same bf16
operands up to the roundings to bf16, every row is bitwise the same whatever batch it runs
in, bad inputs are errors; a model packed with it matches HF in bf16 and serves through
the engine; ``auto`` picks it where the policy says.  Skipped where this build has no
native bf16 GEMM (no compiler, or a CPU with neither AVX512-BF16 nor AVX2+FMA)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.model_factory import load_hf_model_bf16
from tests.unit.engine.test_model import PagedSeqs, _tokens, hf_logits
from worker.engine.kernels import load_cpu_kernels
from worker.engine.loading.loader import load_model
from worker.engine.models.cpu_gemm import (auto_prefers_native, linear_scheme, native_supported,
                                           onednn_supported, resolve_cpu_linear)

kernels = load_cpu_kernels()
HAS_NATIVE = kernels is not None and bool(kernels.native_bf16_gemm_isa())
pytestmark = pytest.mark.skipif(not HAS_NATIVE, reason="no native bf16 GEMM in this build / on this CPU")
CPU = torch.device("cpu")


def _bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Rounding the output to bf16 (2^-8 relative) plus fp32 accumulation-order noise,
    scaled by the sum of magnitudes: a cancelling sum may lose all its relative precision."""
    mag = F.linear(x.float().abs(), w.float().abs(), None if b is None else b.float().abs())
    return 2 ** -7 * mag + 1e-6


@pytest.mark.parametrize("out_features,in_features", [(96, 200), (40, 64), (33, 18), (1, 2), (300, 512)])
def test_matches_fp32_gemm_of_the_same_operands(out_features, in_features):
    g = torch.Generator().manual_seed(out_features * 7 + in_features)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16()
    packed = kernels.pack_bf16_weight(w)
    assert packed.shape == w.shape and packed.dtype == torch.bfloat16
    assert torch.equal(kernels.unpack_bf16_weight(packed), w)  # exact: weight updates unpack and repack
    for rows in (1, 2, 3, 4, 5, 7, 17, 32, 130):
        x = torch.randn(rows, in_features, generator=g).bfloat16()
        for bias in (b, None):
            got = kernels.bf16_linear(x, packed, bias)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
            ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
            assert ((got.float() - ref).abs() <= _bound(x, w, bias)).all(), (rows, bias is None)


def test_every_row_is_bitwise_the_same_in_any_batch():
    """Each output is one fp32 accumulator over k in a fixed order whatever the tile, so a
    sequence's logits never depend on who shares its step (the engine's batch-invariance
    tests rely on it)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(200, 128, generator=g).bfloat16()
    b = torch.randn(200, generator=g).bfloat16()
    packed = kernels.pack_bf16_weight(w)
    x = torch.randn(37, 128, generator=g).bfloat16()
    whole = kernels.bf16_linear(x, packed, b)
    for start, stop in ((0, 1), (5, 6), (3, 9), (10, 37), (36, 37)):
        assert torch.equal(kernels.bf16_linear(x[start:stop], packed, b), whole[start:stop])


def test_strided_rows_and_threads():
    """Rows with a stride (a view into a wider buffer) and several threads give the same bits."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(256, 64, generator=g).bfloat16()
    packed = kernels.pack_bf16_weight(w)
    wide = torch.randn(9, 100, generator=g).bfloat16()
    x = wide[:, 10:74]
    want = kernels.bf16_linear(x.contiguous(), packed, None)
    assert torch.equal(kernels.bf16_linear(x, packed, None), want)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernels.bf16_linear(x.contiguous(), packed, None), want)
    finally:
        torch.set_num_threads(threads)


def test_bad_inputs_are_errors():
    w = torch.randn(32, 16).bfloat16()
    packed = kernels.pack_bf16_weight(w)
    with pytest.raises(RuntimeError, match="columns"):
        kernels.bf16_linear(torch.randn(2, 18).bfloat16(), packed, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.bf16_linear(torch.randn(2, 16), packed, None)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.bf16_linear(torch.randn(2, 16).bfloat16(), packed, torch.zeros(5).bfloat16())
    with pytest.raises(RuntimeError, match="even"):
        kernels.pack_bf16_weight(torch.randn(8, 7).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.pack_bf16_weight(torch.randn(8, 8))


def test_auto_policy():
    """bf16: native on CPUs without AMX (oneDNN's tiles win with it), else oneDNN where it
    runs bf16, else torch; fp32 never takes native; an explicit native that cannot run is an error."""
    assert native_supported(CPU, torch.bfloat16) and not native_supported(CPU, torch.float32)
    assert auto_prefers_native(frozenset({"avx2", "fma"})) and auto_prefers_native(frozenset({"avx512_bf16"}))
    assert not auto_prefers_native(frozenset({"avx512_bf16", "amx_bf16", "amx_tile"}))
    want = "native" if auto_prefers_native() else ("onednn" if onednn_supported(CPU, torch.bfloat16) else "torch")
    assert resolve_cpu_linear("auto", CPU, torch.bfloat16) == want
    assert resolve_cpu_linear("auto", CPU, torch.float32) in ("onednn", "torch")
    assert resolve_cpu_linear("native", CPU, torch.bfloat16) == "native"
    with pytest.raises(ValueError, match="cpu_linear=native is not supported"):
        resolve_cpu_linear("native", CPU, torch.float32)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_tied", "mixtral", "qwen2_moe", "qwen3_moe"])
def test_native_packed_model_matches_hf_bf16(tiny_model, kind):
    """A bf16 model with every projection, the head and (MoE) the router, each expert and
    the shared expert on the native GEMM (q/k/v biases and a tied head included) against
    HF in bf16 on the same weights: top-1 agreement where HF's top two are apart by more
    than bf16 noise, and logits within bf16 tolerance."""
    path = tiny_model(kind)
    hf = load_hf_model_bf16(path)
    model = load_model(path, dtype=torch.bfloat16)
    model.pack_linears(linear_scheme("native"))
    assert "qkv_weight" not in dict(model.named_parameters())
    moe = [layer.moe for layer in model.layers if layer.moe is not None]
    assert all(isinstance(m.w13, list) and m.packing is not None for m in moe)
    assert not any(n.endswith(("w13", "w2", "gate_weight", "shared_gate_up")) for n, _ in model.named_parameters())
    if kind == "llama_tied":
        assert model.lm_head is model.embed_tokens  # the embedding stays dense, the head has its own packed copy
    ids = _tokens(40, seed=3)
    ref = hf_logits(hf, ids).float()
    (got,) = PagedSeqs(model).step([("a", ids)])
    (dense,) = PagedSeqs(load_model(path, dtype=torch.bfloat16)).step([("a", ids)])  # torch's linears, same engine
    scale = ref.abs().max().item()
    tol = 0.05 * scale
    # A MoE token whose router scores nearly tie may pick another expert under any bf16
    # GEMM (torch's included): positions where the unpacked model is off too are excused.
    excused = (dense - ref).abs().amax(-1) > tol
    assert excused.sum() <= 2
    assert ((got - ref).abs().amax(-1)[~excused] <= tol).all()
    top2 = ref.topk(2, dim=-1).values
    clear = ((top2[:, 0] - top2[:, 1]) > 0.02 * scale) & ~excused
    assert clear.sum() >= len(ids) // 2
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "qwen2_moe"])
def test_weight_updates_through_native_packing(tiny_model_root, kind):
    """RL weight writes by checkpoint name into a bf16 engine on the native GEMM: the layers
    (experts included) are unpacked exactly, written, packed again; checksums read back
    what was written, and generation equals a fresh engine loaded from the new weights."""
    from safetensors.torch import load_file

    from common.dist_weight_transfer import weight_checksums
    from tests.support.engine_helpers import make_engine, request
    from tests.support.model_factory import tiny_model_dir

    a, b = tiny_model_dir(kind, tiny_model_root, 0), tiny_model_dir(kind, tiny_model_root, 1)
    engine = make_engine(a, dtype="bfloat16", cpu_linear="native")
    assert engine.cpu_linear == "native"
    bf16 = lambda sd: {n: t.bfloat16() for n, t in sd.items()}  # noqa: E731
    sd_a, sd_b = bf16(load_file(str(a / "model.safetensors"))), bf16(load_file(str(b / "model.safetensors")))
    assert engine.rl.weight_checksums("") == weight_checksums(sd_a.items())
    names = sorted(sd_b)
    engine.rl.write_weights({n: sd_b[n] for n in names[::2]}, more_to_come=True)
    engine.rl.write_weights({n: sd_b[n] for n in names[1::2]}, more_to_come=True)
    engine.rl.end_weight_writes()
    assert engine.rl.weight_checksums("") == weight_checksums(sd_b.items())
    assert all(layer.linear is not torch.nn.functional.linear for layer in engine.model.layers)  # packed again
    fresh = make_engine(b, dtype="bfloat16", cpu_linear="native")
    reqs = lambda: [request("x", [5, 6, 7, 8], max_tokens=8, ignore_eos=True)]  # noqa: E731
    assert engine.generate(reqs())["x"][0].token_ids == fresh.generate(reqs())["x"][0].token_ids


def test_a_model_the_native_layout_cannot_pack_falls_back_whole(tmp_path, caplog):
    """An odd input dimension (here the down projection's, intermediate_size 97) cannot be
    paired: ``auto`` serves the model on the next GEMM (nothing half-packed, a warning says
    why), and ``--cpu-linear native`` asked by name is refused with the reason."""
    import logging

    import transformers

    from tests.support.engine_helpers import make_engine, request
    from tests.support.model_factory import write_tokenizer

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=97, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=320, max_position_embeddings=256)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    caplog.set_level(logging.WARNING)
    engine = make_engine(tmp_path, dtype="bfloat16")
    assert engine.cpu_linear in ("onednn", "torch")
    assert all(layer.packing is None or layer.packing.name == engine.cpu_linear for layer in engine.model.layers)
    assert any("cannot pack this model's weights" in r.getMessage() for r in caplog.records)
    out = engine.generate([request("x", [5, 6, 7], max_tokens=4, ignore_eos=True)])
    assert len(out["x"][0].token_ids) == 4
    with pytest.raises(ValueError, match="--cpu-linear native cannot pack"):
        make_engine(tmp_path, dtype="bfloat16", cpu_linear="native")
