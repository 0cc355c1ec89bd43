"""Qwen2-VL / Qwen2.5-VL vision towers and M-RoPE against transformers (tiny random models)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.support.vl_factory import hf_qwen2_vl
from worker.engine.models.mrope import apply_mrope, decode_positions, mrope_cos_sin, mrope_positions
from worker.engine.models.qwen2_vl_vision import (QWEN2_5_VL, QWEN2_VL, QwenVisionTower, build_vision_tower,
                                                  hf_to_local_name)

IMAGE = 90
VSTART = 91
VEND = 92
VIDEO = 93
MROPE_SECTION = [2, 3, 3]     # head_dim 16


def _text_config():
    return dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": MROPE_SECTION})


QWEN2_VISION = dict(depth=3, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, in_channels=3,
                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, hidden_act="quick_gelu")
QWEN2_5_VISION = dict(depth=4, hidden_size=64, intermediate_size=80, num_heads=4, in_channels=3,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, hidden_act="silu",
                      out_hidden_size=64, window_size=56, fullatt_block_indexes=[1, 3])


def _hf_model(variant):
    torch.manual_seed(0)
    vision = QWEN2_VISION if variant == QWEN2_VL else QWEN2_5_VISION
    model = hf_qwen2_vl(variant != QWEN2_VL, _text_config(), vision, image=IMAGE, video=VIDEO, vstart=VSTART,
                        vend=VEND)
    model.config._attn_implementation = "eager"
    # random (non-identity) norms so their weights are exercised too
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name and ("norm" in name or "ln_q" in name):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _visual(model):
    inner = getattr(model, "model", model)
    return getattr(inner, "visual", None) or model.visual


def _rope_owner(model):
    inner = getattr(model, "model", model)
    return inner if hasattr(inner, "get_rope_index") else model


@pytest.fixture(scope="module", params=[QWEN2_VL, QWEN2_5_VL])
def pair(request):
    variant = request.param
    model = _hf_model(variant)
    vc = QWEN2_VISION if variant == QWEN2_VL else QWEN2_5_VISION
    tower = build_vision_tower(dict(vc))          # variant guessed from the keys
    assert tower.cfg.variant == variant
    skipped = tower.load_hf_weights(model.state_dict().items())
    assert skipped and all(hf_to_local_name(n) is None for n in skipped)   # only non-vision tensors skipped
    return variant, model, tower.eval()


@pytest.mark.parametrize("grids", [
    [(1, 4, 6)],
    [(1, 4, 6), (1, 8, 4)],
    [(1, 8, 12), (2, 4, 4), (1, 6, 10)],     # several windows, edge windows, a 2-frame entry
])
def test_vision_tower_matches_hf(pair, grids):
    variant, model, tower = pair
    torch.manual_seed(1)
    n = sum(t * h * w for t, h, w in grids)
    pixel_values = torch.randn(n, 3 * 2 * 14 * 14)
    grid_thw = torch.tensor(grids, dtype=torch.long)
    with torch.no_grad():
        ref = _visual(model)(pixel_values, grid_thw=grid_thw)
        ref = getattr(ref, "pooler_output", ref)
        out = tower(pixel_values, grid_thw)
    assert out.shape == (n // 4, 64)
    assert ref.shape == out.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_load_rejects_missing_weights():
    tower = QwenVisionTower.from_hf_config(dict(QWEN2_VISION))
    sd = {"visual." + k: v for k, v in tower.state_dict().items() if not k.startswith("merger.")}
    with pytest.raises(ValueError, match="missing"):
        tower.load_hf_weights(sd.items())


def test_name_mapping():
    assert hf_to_local_name("visual.patch_embed.proj.weight") == "patch_embed.weight"
    assert hf_to_local_name("model.visual.merger.mlp.0.bias") == "merger.fc1.bias"
    assert hf_to_local_name("visual.merger.mlp.2.weight") == "merger.fc2.weight"
    assert hf_to_local_name("visual.blocks.3.attn.qkv.weight") == "blocks.3.attn.qkv.weight"
    assert hf_to_local_name("model.language_model.layers.0.mlp.up_proj.weight") is None
    assert hf_to_local_name("lm_head.weight") is None


def _image(grid):
    t, h, w = grid
    return [VSTART] + [IMAGE] * (t * h * w // 4) + [VEND]


PROMPTS = {
    "text_only": ([5, 6, 7, 8, 9, 10], []),
    "one_image": ([1, 2, 3] + _image((1, 4, 6)) + [4, 5, 6, 7], [(1, 4, 6)]),
    "two_images": ([1, 2] + _image((1, 4, 6)) + [3, 4, 5] + _image((1, 8, 4)) + [6, 7], [(1, 4, 6), (1, 8, 4)]),
    "image_first_and_last": (_image((1, 12, 4)) + [3] + _image((1, 2, 2)), [(1, 12, 4), (1, 2, 2)]),
}


@pytest.mark.parametrize("variant", [QWEN2_VL, QWEN2_5_VL])
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_mrope_positions_match_hf(variant, prompt):
    ids, grids = PROMPTS[prompt]
    pos, delta = mrope_positions(ids, grids, image_token_id=IMAGE, vision_start_token_id=VSTART,
                                 spatial_merge_size=2)
    assert pos.shape == (3, len(ids)) and pos.dtype == torch.long
    if not grids:
        # HF leaves text-only prompts to plain 1-D positions (no get_rope_index call)
        assert torch.equal(pos, torch.arange(len(ids)).expand(3, -1))
        assert delta == 0
        return
    model = _hf_model(variant)
    input_ids = torch.tensor([ids])
    mm_types = (input_ids == IMAGE).int()
    ref_pos, ref_delta = _rope_owner(model).get_rope_index(
        input_ids, mm_token_type_ids=mm_types, image_grid_thw=torch.tensor(grids))
    assert torch.equal(pos, ref_pos[:, 0])
    assert delta == int(ref_delta.reshape(-1)[0])
    # decode: position of the token at index i is i + delta (what HF derives from rope_deltas)
    assert torch.equal(decode_positions(len(ids), 3, delta)[0], torch.arange(len(ids), len(ids) + 3) + delta)


def test_mrope_positions_errors():
    ids = [1] + _image((1, 4, 6)) + [2]
    with pytest.raises(ValueError):
        mrope_positions(ids, [], image_token_id=IMAGE)
    with pytest.raises(ValueError):
        mrope_positions(ids, [(1, 4, 8)], image_token_id=IMAGE)     # wrong placeholder count
    with pytest.raises(ValueError):
        mrope_positions(ids, [(1, 4, 6), (1, 2, 2)], image_token_id=IMAGE)
    with pytest.raises(NotImplementedError):
        mrope_positions(ids, [(1, 4, 6)], image_token_id=IMAGE, video_grid_thw=[(2, 4, 4)])


def test_apply_mrope_matches_hf():
    from transformers.models.qwen2_vl import modeling_qwen2_vl as m

    model = _hf_model(QWEN2_VL)
    ids, grids = PROMPTS["two_images"]
    pos, _ = mrope_positions(ids, grids, image_token_id=IMAGE, vision_start_token_id=VSTART)
    t, hq, hk, d = len(ids), 4, 2, 16
    torch.manual_seed(2)
    q = torch.randn(t, hq, d)
    k = torch.randn(t, hk, d)
    rot = m.Qwen2VLRotaryEmbedding(model.config.text_config)
    cos, sin = rot(q, pos[:, None, :])                               # [1, T, D]
    ref_q, ref_k = m.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    ref_q, ref_k = ref_q[0].transpose(0, 1), ref_k[0].transpose(0, 1)

    out_q, out_k = apply_mrope(q, k, pos, MROPE_SECTION, rope_theta=10000.0)
    torch.testing.assert_close(out_q, ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_k, ref_k, rtol=1e-5, atol=1e-5)

    # precomputed cos|sin, and from an engine-style position-indexed cos|sin table
    cs = mrope_cos_sin(pos, MROPE_SECTION, head_dim=d, rope_theta=10000.0)
    q2, k2 = apply_mrope(q, k, cs)
    torch.testing.assert_close(q2, ref_q, rtol=1e-5, atol=1e-5)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    f = torch.arange(int(pos.max()) + 1, dtype=torch.float32)[:, None] * inv
    table = torch.cat((f.cos(), f.sin()), dim=-1)
    q3, k3 = apply_mrope(q, k, pos, MROPE_SECTION, cos_sin_table=table)
    torch.testing.assert_close(q3, ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k3, ref_k, rtol=1e-5, atol=1e-5)

    # text-only positions: M-RoPE == plain RoPE
    tp = torch.arange(t).expand(3, -1)
    qa, _ = apply_mrope(q, k, tp, MROPE_SECTION, rope_theta=10000.0)
    ft = torch.arange(t, dtype=torch.float32)[:, None] * inv
    c, s = ft.cos().repeat(1, 2)[:, None], ft.sin().repeat(1, 2)[:, None]
    plain = q * c + torch.cat((-q[..., d // 2:], q[..., :d // 2]), -1) * s
    torch.testing.assert_close(qa, plain, rtol=1e-5, atol=1e-5)
