"""Qwen2-VL / Qwen2.5-VL image preprocessing, numerically equal to HF's.

Re-implements the slow (PIL/numpy) ``Qwen2VLImageProcessor`` of transformers
(``image_processing_pil_qwen2_vl.py`` in 5.x, ``image_processing_qwen2_vl.py``
in 4.x; Qwen2.5-VL reuses it unchanged) without importing transformers, so the
gateway (placeholder counting) and the workers (pixel tensors) share one
implementation.  Pipeline, per image:

1. RGB (callers normally pass ``media.load_image`` output, already RGB).
2. ``smart_resize`` to multiples of ``patch_size * merge_size`` within
   [min_pixels, max_pixels], then PIL ``Image.resize`` with BICUBIC on the
   uint8 image (HF round-trips through PIL the same way).
3. rescale: ``x.astype(float64) * rescale_factor`` then float32 (HF's order).
4. normalize: ``(x - mean) / std`` in float32, OPENAI CLIP mean/std default.
5. patchify: the image is one temporal frame repeated ``temporal_patch_size``
   times; patches are ordered merge-window-major so the vision tower's
   2x2 patch merger sees neighbours contiguously.

Output: ``pixel_values`` (grid_t*grid_h*grid_w, C*temporal*patch*patch)
float32 and ``grid_thw`` == HF's ``image_grid_thw`` row ``(1, gh, gw)``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
if TYPE_CHECKING:
    from PIL import Image

# PIL.Image.Resampling.BICUBIC.  Pillow is imported only where pixels are touched, so the
# workers (which take resized images) import this module's config without Pillow.
_BICUBIC = 3

__all__ = [
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "Qwen2VLImageConfig",
    "check_patchable",
    "grid_thw_for_size",
    "num_placeholder_tokens",
    "patchify",
    "preprocess_image",
    "resize_image",
    "smart_resize",
]

# transformers.image_utils constants.
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

_DEFAULT_MIN_PIXELS = 56 * 56
_DEFAULT_MAX_PIXELS = 28 * 28 * 1280


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = _DEFAULT_MIN_PIXELS,
    max_pixels: int = _DEFAULT_MAX_PIXELS,
) -> tuple[int, int]:
    """HF's ``smart_resize``, verbatim: sides multiples of ``factor``, area in
    [min_pixels, max_pixels], aspect ratio kept as closely as possible.

    Note ``round`` is Python's banker's rounding, as in HF.
    """
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class Qwen2VLImageConfig:
    """The processor parameters that change the output; HF defaults."""

    min_pixels: int = _DEFAULT_MIN_PIXELS
    max_pixels: int = _DEFAULT_MAX_PIXELS
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = _BICUBIC

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    fixed_grid = None  # grids follow each image's size (smart_resize); Gemma3ImageConfig has one

    @property
    def max_patches(self) -> int:
        """Patches of the largest image ``smart_resize`` may produce within ``max_pixels``
        (whole merged cells; HF's clamp of a very thin side to one cell can exceed it,
        and the gateway refuses such images)."""
        return max(1, self.max_pixels // (self.factor * self.factor)) * self.merge_size ** 2

    # --- the pipeline's per-family operations (Gemma3ImageConfig has the same) -------
    def grid_for_size(self, height: int, width: int) -> tuple[int, int, int]:
        return grid_thw_for_size(height, width, self) if self.do_resize else check_patchable(height, width, self)

    def check_patchable(self, height: int, width: int) -> tuple[int, int, int]:
        return check_patchable(height, width, self)

    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        return num_placeholder_tokens(grid, self.merge_size)

    def resize(self, image: "Image.Image") -> np.ndarray:
        return resize_image(image, self)

    def patchify(self, image: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        return patchify(image, self)

    def torch_patches(self, image):
        """``patchify`` on a resized ``[H, W, C]`` uint8 torch tensor, on its device (the
        same operations in the same order): the worker's path."""
        import torch

        x = image.permute(2, 0, 1)
        if self.do_rescale:
            x = (x.double() * self.rescale_factor).float()  # HF's float64 rescale, then float32
        x = x.float()
        if self.do_normalize:
            mean = torch.tensor(self.image_mean, dtype=torch.float32, device=x.device)[:, None, None]
            std = torch.tensor(self.image_std, dtype=torch.float32, device=x.device)[:, None, None]
            x = (x - mean) / std
        c, height, width = x.shape
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = height // p, width // p
        x = x.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        x = x[:, :, :, :, :, None].expand(*x.shape[:5], tp, p, p)
        return x.reshape(gh * gw, c * tp * p * p)

    @classmethod
    def from_dict(cls, d: dict) -> "Qwen2VLImageConfig":
        """Read an HF ``preprocessor_config.json`` dict.

        Pixel bounds follow HF's precedence: top-level ``min_pixels`` /
        ``max_pixels`` override ``size.shortest_edge`` / ``size.longest_edge``
        (transformers >= 4.5x names; for this processor they are pixel
        *counts*, not edge lengths); ``size.min_pixels``/``max_pixels``
        (older checkpoints) are accepted too.  Missing keys take HF defaults.
        Unknown keys (processor_class, image_processor_type...) are ignored.
        """
        size = d.get("size") or {}
        min_pixels = size.get("shortest_edge", size.get("min_pixels", _DEFAULT_MIN_PIXELS))
        max_pixels = size.get("longest_edge", size.get("max_pixels", _DEFAULT_MAX_PIXELS))
        if d.get("min_pixels") is not None:
            min_pixels = d["min_pixels"]
        if d.get("max_pixels") is not None:
            max_pixels = d["max_pixels"]
        kw: dict = {"min_pixels": int(min_pixels), "max_pixels": int(max_pixels)}
        for key in ("patch_size", "temporal_patch_size", "merge_size", "resample"):
            if d.get(key) is not None:
                kw[key] = int(d[key])
        for key in ("do_resize", "do_rescale", "do_normalize"):
            if d.get(key) is not None:
                kw[key] = bool(d[key])
        if d.get("rescale_factor") is not None:
            kw["rescale_factor"] = float(d["rescale_factor"])
        for key in ("image_mean", "image_std"):
            v = d.get(key)
            if v is not None:
                kw[key] = tuple(float(x) for x in (v if isinstance(v, (list, tuple)) else [v] * 3))
        cfg = cls(**kw)
        if cfg.min_pixels <= 0 or cfg.max_pixels < cfg.min_pixels:
            raise ValueError(
                f"invalid Qwen2-VL pixel bounds: min_pixels={cfg.min_pixels}, max_pixels={cfg.max_pixels}"
            )
        return cfg

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> "Qwen2VLImageConfig":
        """``<model_dir>/preprocessor_config.json``, or HF defaults if absent."""
        path = os.path.join(os.fspath(model_dir), "preprocessor_config.json")
        if not os.path.exists(path):
            return cls()
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


def grid_thw_for_size(height: int, width: int, config: Qwen2VLImageConfig) -> tuple[int, int, int]:
    """The ``image_grid_thw`` an image of this size gets, without touching pixels
    (what the gateway needs to expand placeholders; HF's
    ``get_number_of_image_patches`` does the same computation)."""
    if config.do_resize:
        height, width = smart_resize(
            height, width, config.factor, min_pixels=config.min_pixels, max_pixels=config.max_pixels
        )
    return 1, height // config.patch_size, width // config.patch_size


def num_placeholder_tokens(grid_thw: tuple[int, int, int], merge_size: int = 2) -> int:
    """Number of ``<|image_pad|>`` tokens for one image: the vision tower's
    patch merger folds each ``merge_size x merge_size`` window into one token."""
    t, h, w = grid_thw
    return t * h * w // (merge_size**2)


def _to_rgb_hf(image: Image.Image) -> Image.Image:
    """HF ``convert_to_rgb`` (alpha composited onto white) for direct callers;
    a no-op for ``media.load_image`` output, which is RGB already."""
    if image.mode == "RGB":
        return image
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


def resize_image(image: Image.Image, config: Qwen2VLImageConfig | None = None) -> np.ndarray:
    """Steps 1-2: the RGB image at its ``smart_resize`` size, ``[H, W, 3]`` uint8.

    This is what travels to the workers (``MultiModalItem`` encoding ``uint8_hwc``): an
    eighth of the float32 patches' bytes (a quarter for the dtype, a half for the
    repeated temporal frame); the worker finishes with ``patchify``'s arithmetic."""
    cfg = config or Qwen2VLImageConfig()
    image = _to_rgb_hf(image)
    if cfg.do_resize:
        rh, rw = smart_resize(
            image.height, image.width, cfg.factor, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels
        )
        # PIL takes (width, height); a same-size resize is an exact copy in PIL.
        image = image.resize((rw, rh), resample=cfg.resample)
    return np.asarray(image)


def check_patchable(height: int, width: int, config: Qwen2VLImageConfig) -> tuple[int, int, int]:
    """``grid_thw`` of a resized ``height x width`` image (ValueError when the sides are
    not multiples of ``patch_size * merge_size``)."""
    f = config.factor
    if height <= 0 or width <= 0 or height % f or width % f:
        raise ValueError(f"image size {height}x{width} is not a multiple of patch_size*merge_size={f}")
    return 1, height // config.patch_size, width // config.patch_size


def patchify(image: np.ndarray, config: Qwen2VLImageConfig | None = None) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Steps 3-5 on a resized ``[H, W, 3]`` uint8 image -> ``(pixel_values, grid_thw)``."""
    cfg = config or Qwen2VLImageConfig()
    x = np.asarray(image).transpose(2, 0, 1)  # HWC uint8 -> CHW
    if cfg.do_rescale:
        # HF upcasts to float64 before scaling, then downcasts to float32.
        x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    if cfg.do_normalize:
        if not np.issubdtype(x.dtype, np.floating):
            x = x.astype(np.float32)
        mean = np.asarray(cfg.image_mean, dtype=x.dtype)[:, None, None]
        std = np.asarray(cfg.image_std, dtype=x.dtype)[:, None, None]
        x = (x - mean) / std
    x = np.asarray(x, dtype=np.float32)

    c, height, width = x.shape
    _, gh, gw = check_patchable(height, width, cfg)
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    patches = x.reshape(c, gh // m, m, p, gw // m, m, p)
    # -> (gh/m, gw/m, mh, mw, C, ph, pw): merge-window-major, HF's order.
    patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)
    # The still image is repeated to fill the temporal patch (grid_t = 1).
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], tp, p, p))
    pixel_values = np.ascontiguousarray(patches.reshape(gh * gw, c * tp * p * p), dtype=np.float32)
    return pixel_values, (1, gh, gw)


def preprocess_image(
    image: Image.Image, config: Qwen2VLImageConfig | None = None
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One PIL image -> ``(pixel_values float32 (N, C*T*P*P), grid_thw)`` (HF's output)."""
    cfg = config or Qwen2VLImageConfig()
    return patchify(resize_image(image, cfg), cfg)
