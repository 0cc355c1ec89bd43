"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM) against transformers: the router (sigmoid
scores, correction bias, grouped top-k, routed_scaling_factor), the shared experts and
dense first layers through the paged model, and routed_experts equal to HF's router
choice through the engine."""
from __future__ import annotations

import pytest
import torch

from tests.support.engine_helpers import assert_routed_experts_equal_hf
from tests.support.model_factory import load_hf_model
from tests.unit.engine.test_model import ATOL, PagedSeqs, _tokens, hf_logits
from worker.engine.loading.loader import load_model
from worker.engine.models.config import ModelConfig
from worker.engine.models.cpu_gemm import onednn_supported
from worker.engine.models.moe import select_experts_grouped


def test_config(tiny_model):
    c = ModelConfig.from_dir(tiny_model("glm4_moe"))
    moe = c.moe
    assert moe.sparse_layers == (False, True, True) and moe.scoring == "sigmoid"
    assert (moe.num_experts, moe.top_k, moe.n_group, moe.topk_group) == (8, 2, 4, 2)
    assert moe.routed_scaling_factor == 2.5 and moe.shared_experts_intermediate_size == 48
    assert c.qkv_bias and not c.o_bias and c.qk_norm and not c.qk_norm_full and c.rotary_dim == 16


def test_router_equals_transformers(tiny_model):
    hf = load_hf_model(tiny_model("glm4_moe"))
    moe = ModelConfig.from_dir(tiny_model("glm4_moe")).moe
    gate = hf.model.layers[1].mlp.gate
    h = torch.randn(50, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, ref_w, ref_ids = gate(h)
    w, ids = select_experts_grouped(logits, gate.e_score_correction_bias, moe)
    order, ref_order = ids.sort(-1).indices, ref_ids.sort(-1).indices
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order))
    # The groups matter: without them some tokens would pick other experts.
    flat = ModelConfig.from_dir(tiny_model("glm4_moe")).moe.__class__(**{**moe.__dict__, "n_group": 1})
    assert not torch.equal(select_experts_grouped(logits, gate.e_score_correction_bias, flat)[1].sort(-1).values,
                           ids.sort(-1).values)


@pytest.mark.parametrize("packed", [False, True])
def test_paged_steps_match_hf(tiny_model, packed):
    if packed and not onednn_supported(torch.device("cpu"), torch.float32):
        pytest.skip("torch build without oneDNN linear ops")
    path = tiny_model("glm4_moe")
    hf, model = load_hf_model(path), load_model(path)
    if packed:
        model.pack_linears()
    ids, other = _tokens(50, seed=3), _tokens(23, seed=4)
    ref, ref_other = hf_logits(hf, ids), hf_logits(hf, other)
    seqs = PagedSeqs(model)
    (got,) = seqs.step([("a", ids[:21])])
    torch.testing.assert_close(got, ref[:21], atol=ATOL, rtol=0)
    a, b = seqs.step([("a", ids[21:40]), ("b", other[:13])])
    torch.testing.assert_close(a, ref[21:40], atol=ATOL, rtol=0)
    torch.testing.assert_close(b, ref_other[:13], atol=ATOL, rtol=0)
    for pos in range(40, 50):
        a, b = seqs.step([("a", [ids[pos]]), ("b", [other[pos - 27]])])
        torch.testing.assert_close(a[0], ref[pos], atol=ATOL, rtol=0)
        torch.testing.assert_close(b[0], ref_other[pos - 27], atol=ATOL, rtol=0)


def test_routed_experts_equal_hf_router_choice(tiny_model):
    assert_routed_experts_equal_hf(tiny_model("glm4_moe"), "gate", moe_layers=2, top_k=2)
