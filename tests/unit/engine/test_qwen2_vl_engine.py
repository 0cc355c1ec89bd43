"""The engine serving Qwen2-VL / Qwen2.5-VL with image input, against transformers
(tiny random fp32 models, tokens-only engine)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from PIL import Image  # noqa: E402

from common.errors import BadRequest  # noqa: E402
from common.multimodal import Qwen2VLImageConfig, cache_key, mm_hash, preprocess_image, resize_image  # noqa: E402
from common.prefix_hash import prompt_routing_hashes  # noqa: E402
from common.protocol import GenerateRequest, MultiModalItem, SamplingParams  # noqa: E402
from tests.support.engine_helpers import make_engine  # noqa: E402
from tests.support.vl_factory import hf_qwen2_vl  # noqa: E402
from worker.engine.models.config import ModelConfig  # noqa: E402

VOCAB = 160
IMAGE, VSTART, VEND, VIDEO = 150, 151, 152, 153
EOS = 159
MROPE_SECTION = [2, 3, 3]  # head_dim 16
NUM_TOKENS = 8

QWEN2_VISION = dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, in_channels=3,
                    patch_size=14, spatial_merge_size=2, temporal_patch_size=2, hidden_act="quick_gelu")
QWEN2_5_VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2, hidden_act="silu",
                      out_hidden_size=64, window_size=56, fullatt_block_indexes=[1])


def _text_config():
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                eos_token_id=EOS, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": MROPE_SECTION})


def _build(variant: str, out):
    torch.manual_seed(0)
    vision = QWEN2_VISION if variant == "qwen2_vl" else QWEN2_5_VISION
    model = hf_qwen2_vl(variant != "qwen2_vl", _text_config(), vision, image=IMAGE, video=VIDEO, vstart=VSTART,
                        vend=VEND).to(torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name or "ln_q" in name else 0.08 * noise)
    model.save_pretrained(out)
    model.config._attn_implementation = "eager"
    return model


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vl(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    model = _build(request.param, out)
    return request.param, out, model


@pytest.fixture(scope="module")
def qwen2vl(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen2_vl_only")
    return out, _build("qwen2_vl", out)


def _image(seed: int, width: int, height: int):
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    pixels, grid = preprocess_image(img, Qwen2VLImageConfig())
    return pixels, grid


def _as_uint8(items, names):
    """The same items carried as resized uint8 images (what the gateway sends)."""
    out = []
    for it, name in zip(items, names):
        seed, w, h = IMAGES[name]
        rng = np.random.default_rng(seed)
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
        raw = np.ascontiguousarray(resize_image(img, Qwen2VLImageConfig()))
        out.append(MultiModalItem(modality="image", mm_hash=mm_hash(raw, it.grid_thw), offset=it.offset,
                                  length=it.length, grid_thw=it.grid_thw, pixel_values=raw.tobytes(),
                                  shape=list(raw.shape), encoding="uint8_hwc"))
    return out


def _prompt(images, seed: int = 0, before: int = 5, between: int = 4, after: int = 6):
    """Text tokens around ``<|vision_start|> IMAGE*N <|vision_end|>`` runs; items."""
    rng = np.random.default_rng(seed)
    text = lambda k: [int(v) for v in rng.integers(3, 140, k)]  # noqa: E731
    ids = text(before)
    items = []
    for k, (pixels, grid) in enumerate(images):
        if k:
            ids += text(between)
        ids.append(VSTART)
        n = grid[0] * grid[1] * grid[2] // 4
        items.append(MultiModalItem(modality="image", mm_hash=mm_hash(pixels, grid), offset=len(ids), length=n,
                                    grid_thw=list(grid), pixel_values=np.ascontiguousarray(pixels, "<f4").tobytes(),
                                    shape=list(pixels.shape)))
        ids += [IMAGE] * n
        ids.append(VEND)
    ids += text(after)
    return ids, items


def _req(rid, ids, items, **params):
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", NUM_TOKENS)
    params.setdefault("ignore_eos", True)
    return GenerateRequest(request_id=rid, prompt_token_ids=list(ids), params=SamplingParams(**params),
                           mm_items=items or None)


@torch.inference_mode()
def _hf_greedy(model, ids, images, n=NUM_TOKENS):
    """Greedy ids by full forwards, and the log-softmax of the prompt's last position."""
    kw = {}
    if images:
        kw["pixel_values"] = torch.from_numpy(np.concatenate([p for p, _ in images]))
        kw["image_grid_thw"] = torch.tensor([list(g) for _, g in images])
    seq = list(ids)
    first = None
    for _ in range(n):
        if images:  # what the processor returns beside input_ids: 1 marks image placeholders
            kw["mm_token_type_ids"] = (torch.tensor([seq]) == IMAGE).long()
        logits = model(input_ids=torch.tensor([seq]), use_cache=False, **kw).logits[0, -1].float()
        if first is None:
            first = torch.log_softmax(logits, -1)
        seq.append(int(logits.argmax()))
    return seq[len(ids):], first


def _engine(path, **kw):
    kw.setdefault("tokens_only", True)
    return make_engine(path, **kw)


def _check(delta, hf_ids, hf_first):
    assert delta.token_ids == hf_ids
    lp = delta.logprobs
    ids = torch.tensor(lp.top_ids[0])
    assert torch.allclose(torch.tensor(lp.top_logprobs[0]), hf_first[ids], atol=1e-4, rtol=0)


IMAGES = {"a": (1, 56, 84), "b": (2, 112, 84), "c": (3, 112, 84)}


def _img(name):
    seed, w, h = IMAGES[name]
    return _image(seed, w, h)


def test_config_parses_both_layouts(vl):
    variant, path, _ = vl
    mc = ModelConfig.from_dir(path)
    assert mc.is_multimodal and mc.mrope_section == tuple(MROPE_SECTION) and mc.image_token_id == IMAGE
    assert mc.hidden_size == 64 and mc.num_hidden_layers == 2 and mc.qkv_bias
    # the older layout: text settings top-level, legacy rope_scaling {"type": "mrope"}
    cfg = json.loads((path / "config.json").read_text())
    flat = {**cfg, **cfg.pop("text_config")}
    flat.pop("rope_parameters", None)
    flat["rope_theta"] = 10000.0
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": MROPE_SECTION}
    old = ModelConfig.from_dicts(path, flat)
    assert old.mrope_section == mc.mrope_section and old.rope_scaling is None and old.rope_theta == mc.rope_theta
    assert old.vision_config == mc.vision_config


def test_matches_hf_text_images_and_batch(vl):
    variant, path, model = vl
    cases = {
        "text": _prompt([], seed=1),
        "one": _prompt([_img("a")], seed=2),
        "two": _prompt([_img("a"), _img("b")], seed=3),
    }
    imgs = {"text": [], "one": [_img("a")], "two": [_img("a"), _img("b")]}
    expected = {k: _hf_greedy(model, ids, imgs[k]) for k, (ids, _) in cases.items()}
    # each alone, then all together in one engine run
    engine = _engine(path)
    for k, (ids, items) in cases.items():
        out = engine.generate([_req(k, ids, items, logprobs=20)])
        _check(out[k][0], *expected[k])
    engine = _engine(path, enable_prefix_caching=False)
    out = engine.generate([_req(k, ids, items, logprobs=20) for k, (ids, items) in cases.items()])
    for k in cases:
        _check(out[k][0], *expected[k])


def test_encoder_cache_and_chunked_prefill(qwen2vl):
    path, model = qwen2vl
    ids, items = _prompt([_img("b"), _img("a")], seed=4, before=7)
    hf_ids, hf_first = _hf_greedy(model, ids, [_img("b"), _img("a")])
    engine = _engine(path, enable_prefix_caching=False)
    cache = engine.runner.encoder_cache
    first = engine.generate([_req("r1", ids, items, logprobs=20)])["r1"][0]
    assert cache.num_encoded == 2
    second = engine.generate([_req("r2", ids, items, logprobs=20)])["r2"][0]
    assert cache.num_encoded == 2  # both images reused from the encoder cache
    assert first.token_ids == second.token_ids == hf_ids
    _check(first, hf_ids, hf_first)
    # chunks of 8 tokens split both placeholder ranges (24 and 6 tokens) over steps
    chunked = _engine(path, enable_prefix_caching=False, max_num_batched_tokens=8)
    out = chunked.generate([_req("c", ids, items, logprobs=20)])["c"][0]
    _check(out, hf_ids, hf_first)
    assert chunked.runner.encoder_cache.num_encoded == 2  # encoded once, sliced per chunk


def test_uint8_images_encoded_together(qwen2vl):
    """Resized uint8 images (the gateway's encoding) give HF's outputs, and a step's new
    images go through the vision tower in one call."""
    path, model = qwen2vl
    ids1, items1 = _prompt([_img("a"), _img("b")], seed=9)
    ids2, items2 = _prompt([_img("c")], seed=10)
    exp1 = _hf_greedy(model, ids1, [_img("a"), _img("b")])
    exp2 = _hf_greedy(model, ids2, [_img("c")])
    engine = _engine(path, enable_prefix_caching=False)
    cache = engine.runner.encoder_cache
    out = engine.generate([_req("u1", ids1, _as_uint8(items1, "ab"), logprobs=20),
                           _req("u2", ids2, _as_uint8(items2, "c"), logprobs=20)])
    _check(out["u1"][0], *exp1)
    _check(out["u2"][0], *exp2)
    assert (cache.num_encoded, cache.num_encode_calls) == (3, 1)
    # the float32 patches of the same images: same embeddings, so the same outputs
    out = engine.generate([_req("f1", ids1, items1, logprobs=20)])
    _check(out["f1"][0], *exp1)
    assert cache.num_encode_calls == 2


def test_old_checkpoint_naming(qwen2vl, tmp_path):
    from safetensors.torch import load_file, save_file

    path, model = qwen2vl
    old = tmp_path / "old"
    old.mkdir()
    tensors = {}
    for name, t in load_file(str(path / "model.safetensors")).items():
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        elif name.startswith("model.visual."):
            name = "visual." + name[len("model.visual."):]
        tensors[name] = t
    save_file(tensors, str(old / "model.safetensors"))
    (old / "config.json").write_text((path / "config.json").read_text())
    ids, items = _prompt([_img("a")], seed=5)
    hf_ids, hf_first = _hf_greedy(model, ids, [_img("a")])
    out = _engine(old).generate([_req("o", ids, items, logprobs=20)])["o"][0]
    _check(out, hf_ids, hf_first)


def test_prefix_cache_keys_images(qwen2vl):
    path, model = qwen2vl
    # 32 text tokens (2 blocks of 16) before the image; 48-token image; text after
    ids_a, items_a = _prompt([_img("b")], seed=6, before=31, after=20)
    ids_c, items_c = _prompt([_img("c")], seed=6, before=31, after=20)
    assert ids_a == ids_c and items_a[0].mm_hash != items_c[0].mm_hash
    engine = _engine(path)
    ref = {k: _hf_greedy(model, ids_a, [im])[0] for k, im in (("a", _img("b")), ("c", _img("c")))}
    first = engine.generate([_req("a1", ids_a, items_a)])["a1"][0]
    other = engine.generate([_req("c1", ids_c, items_c)])["c1"][0]
    same = engine.generate([_req("a2", ids_a, items_a)])["a2"][0]
    assert first.num_cached_tokens == 0
    assert other.num_cached_tokens == 32  # only the text blocks before the image
    assert same.num_cached_tokens == (len(ids_a) - 1) // 16 * 16
    assert first.token_ids == same.token_ids == ref["a"]
    assert other.token_ids == ref["c"]
    # blocks holding image tokens are published with the image folded in: the keys the
    # gateway computes for routing (same text, different images: only the text blocks match)
    events = engine.snapshot_kv_events()
    keys = {k: prompt_routing_hashes(ids, 16, mm_spans=[(it.offset, it.length, cache_key(it.mm_hash, it.grid_thw))
                                                         for it in items])
            for k, ids, items in (("a", ids_a, items_a), ("c", ids_c, items_c))}
    assert len(keys["a"]) == (len(ids_a) - 1) // 16 and set(keys["a"]) | set(keys["c"]) <= set(events.stored)
    assert keys["a"][:2] == keys["c"][:2] and not set(keys["a"][2:]) & set(keys["c"][2:])


def test_decode_after_image_batched_with_text(qwen2vl):
    """Decode steps of an image request (positions shifted by the M-RoPE delta) mixed
    with a text request's prefill chunks."""
    path, model = qwen2vl
    ids, items = _prompt([_img("b")], seed=7)
    text = list(range(3, 3 + 90))
    exp_img = _hf_greedy(model, ids, [_img("b")])
    exp_txt = _hf_greedy(model, text, [])
    engine = _engine(path, max_num_batched_tokens=32)
    out = engine.generate([_req("img", ids, items, logprobs=20), _req("txt", text, None, logprobs=20)])
    _check(out["img"][0], *exp_img)
    _check(out["txt"][0], *exp_txt)


def test_validation_errors(qwen2vl, tmp_path):
    path, _ = qwen2vl
    engine = _engine(path)
    ids, items = _prompt([_img("a")], seed=8)
    it = items[0]

    def bad(match, ids=ids, **change):
        item = MultiModalItem(**{**{f: getattr(it, f) for f in it.__struct_fields__}, **change})
        with pytest.raises(BadRequest, match=match):
            engine.add_request(_req("bad", ids, [item]))

    bad("'audio' input is not supported", modality="audio")
    bad("outside", offset=len(ids) - 2)
    bad("not all the image token", offset=it.offset - 1)
    bad("length 5 != t\\*h\\*w/4", length=5, ids=ids[:it.offset] + [IMAGE] * 5 + ids[it.offset + 6:])
    bad("holds .* bytes", pixel_values=it.pixel_values[:-4])
    bad("shape", shape=[it.shape[0] + 1, it.shape[1]])
    bad("unknown pixel encoding 'png'", encoding="png")
    cache = engine.runner.encoder_cache
    assert cache.max_image_patches == 1280 * 4  # HF's default max_pixels: 1280 merged cells
    cache.max_image_patches = it.grid_thw[1] * it.grid_thw[2] - 1  # a preprocessor with a smaller max_pixels
    bad("more than the 23 of the largest image")
    cache.max_image_patches = 1280 * 4
    u8 = _as_uint8([it], "a")[0]
    bad("expected \\[84, 56, 3\\] for uint8_hwc", shape=[84, 55, 3], encoding="uint8_hwc",
        pixel_values=u8.pixel_values)
    bad("holds .* bytes", shape=u8.shape, encoding="uint8_hwc", pixel_values=u8.pixel_values[:-3])
    with pytest.raises(BadRequest, match="overlaps"):
        engine.add_request(_req("bad", ids, [it, MultiModalItem(**{**{f: getattr(it, f) for f in
                                                                        it.__struct_fields__},
                                                                     "offset": it.offset + 1, "length": 5})]))
    with pytest.raises(BadRequest, match="no item covers"):
        engine.add_request(_req("bad", ids, None))  # placeholder tokens without their image
    assert not engine.has_unfinished()
    # a text-only model refuses images
    from tests.support.model_factory import tiny_model_dir

    text_engine = make_engine(tiny_model_dir("qwen2", tmp_path))
    with pytest.raises(BadRequest, match="does not accept image input"):
        text_engine.add_request(_req("t", [3, 4, 5], [it]))


# --- KV-cache sizing: the vision tower's peak and the encoder cache -------------------

def _grid_items(grids, patch_dim):
    return [MultiModalItem(modality="image", mm_hash=f"dummy-{k}", offset=0, length=t * h * w // 4,
                           grid_thw=[t, h, w], pixel_values=np.zeros((t * h * w, patch_dim), "<f4").tobytes(),
                           shape=[t * h * w, patch_dim]) for k, (t, h, w) in enumerate(grids)]


def test_admission_bound_covers_every_aspect_ratio():
    """The workers' per-image patch bound is the preprocessor's area bound in whole merged
    cells, not the largest grid of bounded aspect: 7 cells fit a 1x7 image, no squarer grid."""
    import dataclasses

    from common.multimodal import grid_thw_for_size
    from worker.engine.multimodal.images import image_config_for, max_image_grid

    vc = dict(QWEN2_VISION)
    cfg = image_config_for(None, vc)
    cfg = dataclasses.replace(cfg, max_pixels=28 * 28 * 7)
    bound = cfg.max_patches
    assert bound == 7 * 4 and int(np.prod(max_image_grid(vc, cfg))) < bound
    assert grid_thw_for_size(28, 196, cfg) == (1, 2, 14)  # an ordinary 28x196 image: the whole bound
    # HF's smart_resize clamps thin sides up to one cell, past max_pixels (2556x233 -> 224x28);
    # the gateway refuses those with the same bound (gateway.multimodal._check_size)
    t, gh, gw = grid_thw_for_size(2556, 233, cfg)
    assert t * gh * gw > bound


def test_dummy_vision_batch_is_the_largest_encode_call(vl, monkeypatch):
    """The profile's dummy batch: valid grids within max_pixels, as many patches as one
    vision-tower call can get, and it runs through the tiny tower of both variants."""
    import dataclasses

    from worker.engine.multimodal import images as multimodal
    from worker.engine.multimodal.images import dummy_vision_batch, max_encode_grids, max_image_grid

    variant, path, _ = vl
    engine = _engine(path, enable_prefix_caching=False)
    runner, cache = engine.runner, engine.runner.encoder_cache
    vision = next(h for h in runner.hooks if isinstance(h, multimodal.MultimodalInputs))
    vc = engine.model_config.vision_config
    # 24 merged cells (28x28 px each) per image at most; calls of at most 504 patches
    ic = dataclasses.replace(cache.image_config, max_pixels=28 * 28 * 24 + 100)
    cache.image_config = ic
    monkeypatch.setattr(multimodal, "MAX_ENCODE_PATCHES", 504)
    big = max_image_grid(vc, ic)
    # 4x6 cells: 24 cells, sides even, so they tile Qwen2.5's 2-cell (56 px) windows
    assert big == (1, 8, 12) and 96 * 14 * 14 <= ic.max_pixels
    pixels, grids = dummy_vision_batch(vc, ic, runner.token_budget)
    sizes = [t * h * w for t, h, w in grids.tolist()]
    assert pixels.shape == (sum(sizes), 3 * 2 * 14 * 14) and pixels.dtype == torch.float32
    for t, h, w in grids.tolist():
        assert t == 1 and h % 2 == 0 and w % 2 == 0 and h * w * 14 * 14 <= ic.max_pixels
    # maximal images first (5 * 96 patches), then the rest (24 patches: 2x3 merged cells)
    assert grids.tolist() == [list(big)] * 5 + [[1, 4, 6]] and sum(sizes) == 504
    # the token budget bounds the images of a step; a larger image still goes alone
    assert max_encode_grids(vc, ic, 2) == [big, big]
    assert max_encode_grids(vc, ic, 8, max_patches=50) == [big]
    # through the tower the way the encoder cache encodes; nothing is cached
    patches, rows = vision.dummy_vision_run()
    assert (patches, rows) == (sum(sizes), sum(sizes) // 4)
    assert len(cache) == 0 and cache.num_encode_calls == 0
    # the real cache groups the same images into one call (the bound is reachable) and
    # keeps each image's own rows, not a view of the group's
    items = _grid_items([tuple(g) for g in grids.tolist()], pixels.shape[1])
    out = cache.fetch(items)
    assert cache.num_encode_calls == 1 and cache.num_encoded == len(items)
    for it in items:
        emb = out[it.mm_hash]
        assert emb.shape == (it.length, 64)
        assert emb.untyped_storage().nbytes() == emb.numel() * emb.element_size()
    # the reserve: max_tokens rows of the LM hidden size in the model dtype (fp32 here)
    assert vision.profile_reserve() == cache.max_tokens * 64 * 4 == multimodal.encoder_cache_bytes(
        multimodal.DEFAULT_ENCODER_CACHE_TOKENS, 64, torch.float32)


@pytest.mark.cuda
def test_cuda_profile_counts_vision_and_encoder_cache(qwen2vl, monkeypatch):
    from worker.engine.runner import model_runner
    path, _ = qwen2vl
    seen = {}
    real = model_runner.kv_blocks_for_memory

    def spy(**kw):
        seen.update(kw)
        return real(**kw)

    monkeypatch.setattr(model_runner, "kv_blocks_for_memory", spy)
    engine = _engine(path, device="cuda", dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3)
    assert seen["vision"] > 0
    assert seen["encoder_cache"] == engine.runner.encoder_cache.max_tokens * 64 * 4
    without = real(**{**seen, "vision": 0, "encoder_cache": 0})
    assert engine.block_manager.num_blocks <= without


def test_weight_updates_reach_the_vision_tower(qwen2vl, tmp_path):
    """RL weight writes by checkpoint name (HF's ``visual.*``) update the tower and
    drop the encoder cache: the next request re-encodes its image with the new weights
    and answers as an engine loaded from the new checkpoint."""
    from safetensors.torch import load_file, save_file

    from common.dist_weight_transfer import weight_checksums

    path, _ = qwen2vl
    new = tmp_path / "new"
    new.mkdir()
    tensors = load_file(str(path / "model.safetensors"))
    changed = {n: (t * 1.5 if "attn.qkv" in n or "merger.mlp" in n else t)
               for n, t in tensors.items() if n.startswith(("visual.", "model.visual."))}
    assert len(changed) > 4 and all(n in tensors for n in changed)
    save_file({**tensors, **changed}, str(new / "model.safetensors"))
    (new / "config.json").write_text((path / "config.json").read_text())

    ids, items = _prompt([_img("b")], seed=12)
    engine = _engine(path, enable_prefix_caching=False)
    cache = engine.runner.encoder_cache
    # both HF layouts name the same tensors (transformers 5: model.language_model.* / model.visual.*)
    qkv = list(tensors["visual.blocks.0.attn.qkv.weight"].shape)
    up = list(tensors["model.layers.0.mlp.up_proj.weight"].shape)
    checked = engine.rl.weights.check([("model.visual.blocks.0.attn.qkv.weight", "float32", qkv),
                                    ("model.language_model.layers.0.mlp.up_proj.weight", "float32", up),
                                    ("visual.patch_embed.proj.weight", "float32",
                                     list(tensors["visual.patch_embed.proj.weight"].shape))])
    assert [n for n, _, _ in checked] == ["visual.blocks.0.attn.qkv.weight", "model.layers.0.mlp.up_proj.weight",
                                          "visual.patch_embed.weight"]  # the loader's names

    def sums(named):
        return weight_checksums(sorted((engine.rl.weights.canonical(n), t) for n, t in named if n.startswith("visual.")))

    def tower_sums():
        return {n: d for n, d in engine.rl.weight_checksums("").items() if n.startswith("visual.")}

    assert tower_sums() == sums(tensors.items())
    before = engine.generate([_req("o", ids, items, logprobs=20)])["o"][0]
    engine.rl.write_weights(changed)
    engine.rl.end_weight_writes()
    assert len(cache) == 0  # embeddings of the old tower are gone
    assert tower_sums() == sums({**tensors, **changed}.items())
    after = engine.generate([_req("n", ids, items, logprobs=20)])["n"][0]
    assert cache.num_encoded == 2
    fresh = _engine(new, enable_prefix_caching=False).generate([_req("f", ids, items, logprobs=20)])["f"][0]
    assert after.token_ids == fresh.token_ids
    assert torch.allclose(torch.tensor(after.logprobs.top_logprobs[0]), torch.tensor(fresh.logprobs.top_logprobs[0]),
                          atol=1e-5)
    assert not torch.allclose(torch.tensor(before.logprobs.top_logprobs[0]),
                              torch.tensor(after.logprobs.top_logprobs[0]), atol=1e-3)


def test_sleep_level_2_releases_and_restores_the_vision_tower(qwen2vl):
    """Sleep level 2 drops the weights: the encoder cache must not keep the old model
    alive, and after wake-up it encodes with the reloaded one."""
    import gc
    import weakref

    path, model = qwen2vl
    ids, items = _prompt([_img("a")], seed=13)
    expected = _hf_greedy(model, ids, [_img("a")])
    engine = _engine(path, enable_prefix_caching=False)
    _check(engine.generate([_req("s1", ids, items, logprobs=20)])["s1"][0], *expected)
    old = weakref.ref(engine.model)
    engine.rl.sleep(2)
    gc.collect()
    assert old() is None  # nothing holds the released model
    assert engine.rl.wake_up()
    assert engine.runner.encoder_cache.model is engine.model
    _check(engine.generate([_req("s2", ids, items, logprobs=20)])["s2"][0], *expected)


def test_speculative_decoding_on_image_prompts_equals_plain(qwen2vl):
    """n-gram verification rows of an image request (decode positions shifted by the
    M-RoPE delta) give the plain engine's ids and logprobs."""
    path, _ = qwen2vl
    ids, items = _prompt([_img("a")], seed=3)
    ids = ids + ids[-6:] * 3  # a repetitive tail: the n-gram proposer drafts
    plain = _engine(path, enable_prefix_caching=False).generate(
        [_req("p", ids, items, max_tokens=16, logprobs=5)])["p"][0]
    spec = _engine(path, enable_prefix_caching=False, spec_max_step_tokens=0,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                       "prompt_lookup_max": 3}).generate(
        [_req("s", ids, items, max_tokens=16, logprobs=5)])["s"][0]
    assert spec.token_ids == plain.token_ids and sum(spec.spec_decode.histogram[1:]) > 0
    assert torch.allclose(torch.tensor(spec.logprobs.top_logprobs), torch.tensor(plain.logprobs.top_logprobs),
                          atol=1e-4)
