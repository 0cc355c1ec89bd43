"""Mixture-of-experts models against transformers: Mixtral, Qwen2-MoE (shared
expert behind its gate) and Qwen3-MoE (norm_topk_prob, a dense layer from
mlp_only_layers).  Logits through prefill, paged decode and mixed batches; greedy
ids of staggered concurrent requests; the grouped-GEMM expert path; what is
refused at load."""
from __future__ import annotations

import json

import pytest
import torch

from tests.support.engine_helpers import hf_greedy, make_engine, random_prompts, request
from tests.support.model_factory import MOE_KINDS, load_hf_model
from tests.unit.engine.test_quantized_checkpoints import _with_config as _edited
from tests.unit.engine.test_model import PagedSeqs, _tokens, hf_logits
from worker.engine.loading.loader import load_model
from worker.engine.models.config import ModelConfig
from worker.engine.models.cpu_gemm import onednn_supported
from worker.engine.models.moe import fused_experts_torch, select_experts
from worker.engine.loading.weights import ModelWeights

ATOL = 1e-4


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_config_reads_the_sparse_layers(tiny_model, kind):
    moe = ModelConfig.from_dir(tiny_model(kind)).moe
    assert moe.num_experts == 8 and moe.top_k == 2
    assert moe.sparse_layers == ((True, False, True) if kind == "qwen3_moe" else (True, True))
    assert moe.norm_topk_prob == (kind != "qwen2_moe")
    assert moe.shared_expert_intermediate_size == (96 if kind == "qwen2_moe" else 0)
    assert ModelConfig.from_dir(tiny_model("llama")).moe is None


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("kind", MOE_KINDS)
def test_prefill_then_paged_decode_matches_hf(tiny_model, kind, packed):
    if packed and not onednn_supported(torch.device("cpu"), torch.float32):
        pytest.skip("torch build without oneDNN linear ops")
    path = tiny_model(kind)
    hf, model = load_hf_model(path), load_model(path)
    if packed:  # the CPU default: attention projections packed, experts stay stacked
        model.pack_linears()
    ids = _tokens(60, seed=3)
    ref = hf_logits(hf, ids)
    seqs = PagedSeqs(model)
    (got,) = seqs.step([("a", ids[:45])])
    torch.testing.assert_close(got, ref[:45], atol=ATOL, rtol=0)
    for pos in range(45, len(ids)):
        (got,) = seqs.step([("a", [ids[pos]])])
        torch.testing.assert_close(got[0], ref[pos], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["qwen2_moe", "qwen3_moe"])
def test_mixed_batch_matches_hf(tiny_model, kind):
    """Prefill chunks with context, fresh prefills and decodes in one step: every
    token is routed on its own, whatever else is in the batch."""
    path = tiny_model(kind)
    hf, model = load_hf_model(path), load_model(path)
    full = {name: _tokens(n, seed=20 + i) for i, (name, n) in enumerate([("fresh", 9), ("chunked", 28), ("dec", 17)])}
    refs = {name: hf_logits(hf, ids) for name, ids in full.items()}
    seqs = PagedSeqs(model)
    seqs.step([("chunked", full["chunked"][:11]), ("dec", full["dec"][:16])])
    out = seqs.step([("dec", full["dec"][16:17]), ("fresh", full["fresh"]), ("chunked", full["chunked"][11:28])])
    torch.testing.assert_close(out[0][0], refs["dec"][16], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], refs["fresh"], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[2], refs["chunked"][11:28], atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_staggered_concurrent_greedy_equals_hf(tiny_model, kind):
    """Requests join while others decode (small step budget: chunked prefills beside
    decodes); each one's greedy ids equal HF generate on it alone."""
    path = tiny_model(kind)
    engine = make_engine(path, max_num_batched_tokens=24)
    prompts = random_prompts(5, 6, 40, seed=7)
    expected = {str(i): hf_greedy(path, p, 8)[0] for i, p in enumerate(prompts)}
    got: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % 2 == 0:  # a new request every other step
            i, p = pending.pop(0)
            engine.add_request(request(str(i), p, max_tokens=8, ignore_eos=True))
        for d in engine.step():
            got.setdefault(d.request_id, []).extend(d.token_ids)
        steps += 1
    assert got == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_a_per_token_loop(dtype):
    """Sorted pairs, one grouped GEMM per projection and the weighted scatter-add equal
    the definition: each token's top-k experts' SwiGLU MLPs, weighted and summed."""
    g = torch.Generator().manual_seed(1)
    t, e, k, h, i = 23, 6, 2, 32, 24
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) * 0.2).to(dtype)
    logits = torch.randn(t, e, generator=g)
    logits[:, 4] = -1e4  # expert 4 gets no token: an empty group
    weights, ids = select_experts(logits, k, renormalize=False)
    assert torch.allclose(weights, torch.softmax(logits, -1).topk(k).values)
    got = fused_experts_torch(x, w13, w2, weights, ids)
    ref = torch.zeros(t, h)
    for row in range(t):
        for j in range(k):
            ex = int(ids[row, j])
            gate, up = (x[row].float() @ w13[ex].float().T).chunk(2)
            ref[row] += weights[row, j] * ((torch.nn.functional.silu(gate) * up) @ w2[ex].float().T)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    assert (got.float() - ref).abs().max() < tol


def test_hf_named_weights_of_experts_update_in_place(tiny_model):
    """Weight updates name experts by checkpoint names (experts.{e}.gate_proj ...):
    the stacked tensors take them and the model then equals HF with those weights."""
    path = tiny_model("qwen2_moe")
    model = load_model(path)
    weights = ModelWeights(model)
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    assert weights.spec[name].shape == (48, 64)
    assert "model.layers.0.mlp.shared_expert_gate.weight" in weights.spec
    hf = load_hf_model(path)
    new = torch.randn(48, 64) * 0.1
    weights.write({name: new})
    with torch.no_grad():
        hf.model.layers[1].mlp.experts.gate_up_proj[5, 48:] = new
    ids = _tokens(20, seed=9)
    (got,) = PagedSeqs(model).step([("a", ids)])
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=ATOL, rtol=0)
    assert dict(weights.read())[name].equal(new)


def test_unsupported_variants_are_refused_at_load(tiny_model, tmp_path):
    src = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be between 1 and the 8 experts"):
        ModelConfig.from_dir(_edited(src, tmp_path / "topk", num_experts_per_tok=9))
    with pytest.raises(ValueError, match="lacks required key 'moe_intermediate_size'"):
        cfg = json.loads((src / "config.json").read_text())
        cfg.pop("moe_intermediate_size")
        d = _edited(src, tmp_path / "noinner")
        (d / "config.json").write_text(json.dumps(cfg))
        ModelConfig.from_dir(d)
    with pytest.raises(ValueError, match="no expert layers"):
        ModelConfig.from_dir(_edited(src, tmp_path / "dense", mlp_only_layers=[0, 1, 2]))
    # Experts split along their intermediate dimension: a size the ranks cannot split is
    # refused before any process starts.
    with pytest.raises(ValueError, match="tensor_parallel_size 2 must divide moe_intermediate_size 49"):
        make_engine(_edited(src, tmp_path / "odd", moe_intermediate_size=49), tensor_parallel_size=2)


def test_routed_experts_flag_needs_a_moe_model(llama_dir):
    with pytest.raises(ValueError, match="--enable-return-routed-experts needs a mixture-of-experts model; "
                                         "LlamaForCausalLM"):
        make_engine(llama_dir, enable_return_routed_experts=True)


def test_expert_parallel_flag_is_refused_by_name():
    from worker.main import main

    with pytest.raises(SystemExit, match="--enable-expert-parallel is not supported: expert parallelism is not "
                                         "implemented"):
        main(["--enable-expert-parallel"])
