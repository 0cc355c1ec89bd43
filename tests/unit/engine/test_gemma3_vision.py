"""Gemma 3's image encoder (models/gemma3_vision.py) and preprocessing
(common/multimodal/gemma3_processor.py) against transformers, fp32."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.model_factory import _quiet_transformers
from worker.engine.models.config import ModelConfig


@pytest.fixture(scope="module")
def gemma3_mm(tiny_model):
    return tiny_model("gemma3_mm")


def _hf(path):
    import transformers

    _quiet_transformers()
    return transformers.Gemma3ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def _images(n: int, seed: int = 0):
    from PIL import Image

    rng = np.random.default_rng(seed)
    sizes = [(37, 90), (56, 56), (120, 33)]
    return [Image.fromarray(rng.integers(0, 256, (*sizes[i % 3], 3), dtype=np.uint8)) for i in range(n)]


def _hf_processor(path):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": 56, "width": 56})


def test_config_reads_the_image_text_checkpoint(gemma3_mm):
    mc = ModelConfig.from_dir(gemma3_mm)
    assert mc.is_multimodal and mc.vision_variant == "siglip"
    assert mc.image_token_id == 300 and mc.mm_tokens_per_image == 4 and mc.mrope_section is None


def test_preprocessing_equals_transformers(gemma3_mm):
    """Resize to the tower's square (BILINEAR), rescale, normalize: HF's pixel_values, cut into
    row-major patches, equal bit for bit (numpy and the worker's torch path)."""
    from common.multimodal import Gemma3ImageConfig

    mc = ModelConfig.from_dir(gemma3_mm)
    cfg = Gemma3ImageConfig.for_model(mc.vision_config, mc.mm_tokens_per_image)
    assert (cfg.image_size, cfg.patch_size, cfg.merge_size) == (56, 14, 2)
    hf = _hf_processor(gemma3_mm)
    for image in _images(3):
        ref = hf(images=[image], return_tensors="np")["pixel_values"][0]  # [3, 56, 56]
        resized = cfg.resize(image)
        patches, grid = cfg.patchify(resized)
        assert grid == (1, 4, 4) and cfg.num_tokens(grid) == 4
        want = ref.reshape(3, 4, 14, 4, 14).transpose(1, 3, 0, 2, 4).reshape(16, 3 * 14 * 14)
        assert np.array_equal(patches, want)
        got = cfg.torch_patches(torch.from_numpy(resized.copy()))
        assert np.array_equal(got.numpy(), want)


def test_image_features_equal_transformers(gemma3_mm):
    """The tower + projector's embeddings of two images in one call equal HF's
    ``get_image_features`` (pooler_output) to fp32 rounding."""
    from common.multimodal import Gemma3ImageConfig
    from worker.engine.loading.loader import load_model

    hf = _hf(gemma3_mm)
    model = load_model(gemma3_mm)
    mc = model.config
    cfg = Gemma3ImageConfig.for_model(mc.vision_config, mc.mm_tokens_per_image)
    proc = _hf_processor(gemma3_mm)
    images = _images(2, seed=3)
    pixel_values = torch.from_numpy(proc(images=images, return_tensors="np")["pixel_values"])
    with torch.no_grad():
        ref = hf.get_image_features(pixel_values).pooler_output  # [2, 4, 64]
    patches = torch.cat([torch.from_numpy(cfg.patchify(cfg.resize(im))[0]) for im in images])
    got = model.encode_image(patches, torch.tensor([[1, 4, 4]] * 2))
    assert got.shape == (8, 64)
    torch.testing.assert_close(got, ref.reshape(8, 64), atol=2e-5, rtol=1e-5)
    assert ref.abs().max() > 0.1  # not a degenerate all-zero tower


def test_released_checkpoint_names_load(gemma3_mm, tmp_path):
    """The released checkpoints' names (``vision_tower.vision_model.*``, SigLIP's unused
    pooling head included) load to the same encoder."""
    import shutil

    from safetensors.torch import load_file, save_file

    from worker.engine.loading.loader import load_model

    old = tmp_path / "released"
    old.mkdir()
    tensors = {}
    for name, t in load_file(str(gemma3_mm / "model.safetensors")).items():
        if name.startswith("vision_tower."):
            name = "vision_tower.vision_model." + name[len("vision_tower."):]
        tensors[name] = t
    tensors["vision_tower.vision_model.head.probe"] = torch.zeros(1, 1, 32)
    save_file(tensors, str(old / "model.safetensors"))
    for f in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(gemma3_mm / f, old / f)
    a, b = load_model(gemma3_mm), load_model(old)
    patches = torch.randn(16, 3 * 14 * 14)
    grid = torch.tensor([[1, 4, 4]])
    torch.testing.assert_close(a.encode_image(patches, grid), b.encode_image(patches, grid), atol=0, rtol=0)


def test_memory_profile_batch(gemma3_mm):
    """The KV sizing's dummy batch (CUDA) has the one fixed grid; it runs through the tower here."""
    from common.multimodal import Gemma3ImageConfig
    from worker.engine.multimodal.images import dummy_vision_batch, max_image_grid

    mc = ModelConfig.from_dir(gemma3_mm)
    cfg = Gemma3ImageConfig.for_model(mc.vision_config, mc.mm_tokens_per_image)
    assert max_image_grid(mc.vision_config, cfg) == (1, 4, 4)
    pixels, grids = dummy_vision_batch(mc.vision_config, cfg, token_budget=3)
    assert pixels.shape == (48, 588) and grids.tolist() == [[1, 4, 4]] * 3
    from worker.engine.loading.loader import load_model

    assert load_model(gemma3_mm).encode_image(pixels, grids).shape == (12, 64)


def test_pan_and_scan_preprocessor_is_refused():
    from common.multimodal import Gemma3ImageConfig

    vc = {"image_size": 56, "patch_size": 14}
    with pytest.raises(ValueError, match="pan-and-scan"):
        Gemma3ImageConfig.for_model(vc, 4, {"do_pan_and_scan": True})
    with pytest.raises(ValueError, match="does not pool"):
        Gemma3ImageConfig.for_model(vc, 3)


def test_worker_flag_limit_mm_per_prompt_zero_images_is_language_model_only(gemma3_mm):
    """vLLM's --limit-mm-per-prompt on the worker: '{"image": 0}' loads no vision tower
    (the model config has no vision side, the tower's checkpoint tensors are skipped);
    a malformed value stops the worker with the flag named."""
    from worker.engine.models.config import ModelConfig
    from worker.main import build_parser, engine_config_from_args, main

    args = build_parser().parse_args(["--model", str(gemma3_mm), "--limit-mm-per-prompt", '{"image": 0}'])
    config = engine_config_from_args(args)
    assert config.language_model_only
    mc = ModelConfig.from_dir(gemma3_mm, language_model_only=config.language_model_only)
    assert not mc.is_multimodal and mc.vision_config is None
    args = build_parser().parse_args(["--model", str(gemma3_mm), "--limit-mm-per-prompt", '{"image": 2}'])
    assert not engine_config_from_args(args).language_model_only
    with pytest.raises(SystemExit, match="--limit-mm-per-prompt"):
        main(["--model", str(gemma3_mm), "--limit-mm-per-prompt", "{image"])
