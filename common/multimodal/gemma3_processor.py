"""Gemma 3 image preprocessing, numerically equal to transformers' PIL
``Gemma3ImageProcessorPil`` (``image_processing_pil_gemma3.py``) with pan-and-scan off
(vLLM's default).  No transformers import: the gateway and the workers share it.

Per image: RGB; PIL ``resize`` to the SigLIP tower's fixed ``image_size`` square
(BILINEAR); rescale (``float64 * 1/255`` then float32, HF's order); normalize with
mean = std = 0.5.  The worker then cuts the ``[C, S, S]`` image into row-major
``C*p*p`` patches (the tower's Conv2d as a linear).

In the multimodal pipeline's terms an image has the grid ``(1, S/p, S/p)`` and
``merge_size`` is the projector's pooling kernel, so ``t*h*w / merge**2`` is
``mm_tokens_per_image``, the run of image tokens it fills; the same methods as
``Qwen2VLImageConfig`` (``image_processor``) let the gateway and the worker treat both
families alike.
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

_BILINEAR = 2  # PIL.Image.Resampling.BILINEAR
_HALF = (0.5, 0.5, 0.5)  # IMAGENET_STANDARD_MEAN / _STD


@dataclass(frozen=True)
class Gemma3ImageConfig:
    image_size: int = 896
    patch_size: int = 14
    merge_size: int = 4  # the projector's average-pooling kernel
    image_mean: tuple[float, ...] = _HALF
    image_std: tuple[float, ...] = _HALF
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = _BILINEAR
    temporal_patch_size: int = 1  # one frame per patch (the pipeline's patch_dim reads it)

    @property
    def factor(self) -> int:
        return self.image_size

    @property
    def max_pixels(self) -> int:
        return self.image_size * self.image_size

    @property
    def fixed_grid(self) -> tuple[int, int, int]:
        """The one grid every image gets (what the KV sizing reserves the tower's memory for)."""
        side = self.image_size // self.patch_size
        return 1, side, side

    @property
    def max_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def for_model(cls, vision_config: dict, mm_tokens_per_image: int,
                  preprocessor: dict | None = None) -> "Gemma3ImageConfig":
        """From the tower's ``vision_config``, ``mm_tokens_per_image`` and the checkpoint's
        ``preprocessor_config.json`` dict (mean/std, rescale, resample).  A preprocessor that
        turns pan-and-scan on is refused: this server serves the base image only."""
        d = preprocessor or {}
        if d.get("do_pan_and_scan"):
            raise ValueError("preprocessor_config.json sets do_pan_and_scan: pan-and-scan crops are not served")
        size = int(vision_config.get("image_size", 224))
        patch = int(vision_config.get("patch_size", 16))
        side = math.isqrt(int(mm_tokens_per_image))
        if side <= 0 or side * side != mm_tokens_per_image or (size // patch) % side:
            raise ValueError(f"mm_tokens_per_image {mm_tokens_per_image} does not pool the {size // patch}-patch "
                             "grid evenly")
        kw: dict = {"image_size": size, "patch_size": patch, "merge_size": (size // patch) // side}
        for key in ("do_resize", "do_rescale", "do_normalize"):
            if d.get(key) is not None:
                kw[key] = bool(d[key])
        if d.get("rescale_factor") is not None:
            kw["rescale_factor"] = float(d["rescale_factor"])
        if d.get("resample") is not None:
            kw["resample"] = int(d["resample"])
        for key in ("image_mean", "image_std"):
            v = d.get(key)
            if v is not None:
                kw[key] = tuple(float(x) for x in (v if isinstance(v, (list, tuple)) else [v] * 3))
        return cls(**kw)

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike, vision_config: dict,
                       mm_tokens_per_image: int) -> "Gemma3ImageConfig":
        path = os.path.join(os.fspath(model_dir), "preprocessor_config.json")
        pre = None
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                pre = json.load(f)
        return cls.for_model(vision_config, mm_tokens_per_image, pre)

    # --- the pipeline's per-family operations (as Qwen2VLImageConfig's) --------------
    def grid_for_size(self, height: int, width: int) -> tuple[int, int, int]:
        """Every image is resized to the tower's square: one grid whatever its size."""
        if not self.do_resize:
            return self.check_patchable(height, width)
        side = self.image_size // self.patch_size
        return 1, side, side

    def check_patchable(self, height: int, width: int) -> tuple[int, int, int]:
        if height != self.image_size or width != self.image_size:
            raise ValueError(f"image size {height}x{width} is not the model's {self.image_size}x{self.image_size}")
        side = self.image_size // self.patch_size
        return 1, side, side

    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // (self.merge_size ** 2)

    def resize(self, image: "Image.Image") -> np.ndarray:
        """RGB, resized to ``image_size`` square: ``[S, S, 3]`` uint8 (what travels to the workers)."""
        from common.multimodal.qwen2_vl_processor import _to_rgb_hf

        image = _to_rgb_hf(image)
        if self.do_resize:
            image = image.resize((self.image_size, self.image_size), resample=self.resample)
        return np.asarray(image)

    def patchify(self, image: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """A resized ``[S, S, 3]`` uint8 image -> (row-major patches ``[P*P, C*p*p]`` float32, grid)."""
        x = np.asarray(image).transpose(2, 0, 1)
        if self.do_rescale:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        x = x.astype(np.float32, copy=False)
        if self.do_normalize:
            x = (x - np.asarray(self.image_mean, np.float32)[:, None, None]) / np.asarray(self.image_std,
                                                                                         np.float32)[:, None, None]
        grid = self.check_patchable(x.shape[1], x.shape[2])
        return np.ascontiguousarray(self._cut(x, np), dtype=np.float32), grid

    def torch_patches(self, image):
        """``patchify`` on a ``[S, S, 3]`` uint8 torch tensor, on its device (the worker's path)."""
        import torch

        x = image.permute(2, 0, 1)
        if self.do_rescale:
            x = (x.double() * self.rescale_factor).float()
        x = x.float()
        if self.do_normalize:
            mean = torch.tensor(self.image_mean, dtype=torch.float32, device=x.device)[:, None, None]
            std = torch.tensor(self.image_std, dtype=torch.float32, device=x.device)[:, None, None]
            x = (x - mean) / std
        return self._cut(x, None).contiguous()

    def _cut(self, x, xp):
        c, height, width = x.shape
        p = self.patch_size
        gh, gw = height // p, width // p
        x = x.reshape(c, gh, p, gw, p)
        x = x.transpose(1, 3, 0, 2, 4) if xp is not None else x.permute(1, 3, 0, 2, 4)
        return x.reshape(gh * gw, c * p * p)
