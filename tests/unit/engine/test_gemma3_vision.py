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
