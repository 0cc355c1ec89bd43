"""Gemma 3's image encoder in plain torch: the SigLIP vision tower and the
multi-modal projector (transformers' ``SiglipVisionModel`` + ``Gemma3MultiModalProjector``;
vLLM's siglip.py + gemma3_mm.py).

* Tower: a patch embedding (the checkpoint's Conv2d, kernel == stride, kept as a linear
  over the flattened ``C*P*P`` patch: the same map), learned position embeddings (one
  per patch of the fixed ``image_size`` grid: Gemma 3 never interpolates them), pre-LN
  encoder layers (LayerNorm, biased multi-head attention over all the image's patches,
  LayerNorm, gelu-tanh MLP) and the final ``post_layernorm``.  The pooling head of a
  SigLIP checkpoint (``head.*``) is unused by Gemma 3 and skipped.
* Projector: the ``[P, P]`` patch grid average-pooled to ``mm_tokens_per_image`` tokens
  (kernel ``P / sqrt(mm_tokens_per_image)``), Gemma's ``(1 + w)`` RMSNorm in float32
  (``mm_soft_emb_norm``), then ``@ mm_input_projection_weight`` (``[vision, text]``).

``Gemma3ImageEncoder.forward(patches [N * P*P, C*p*p], num_images)`` returns
``[N * mm_tokens_per_image, text_hidden]``: image after image, pooled cells row-major
(the order of the prompt's image tokens).  Patches come row-major over the grid
(common/multimodal/gemma3_processor.py makes them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

# Checkpoint prefixes of the tower and the projector: the released checkpoints name the
# tower ``vision_tower.vision_model.*``; transformers 5 drops ``vision_model.`` (and nests
# both under ``model.`` in memory).  Longest first.
TOWER_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.",
                  "vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
_UNUSED = tuple(p + "head." for p in TOWER_PREFIXES)


@dataclass(frozen=True)
class SiglipConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def patch_dim(self) -> int:
        return self.num_channels * self.patch_size * self.patch_size

    @classmethod
    def from_hf(cls, vc: dict) -> "SiglipConfig":
        cfg = cls(hidden_size=int(vc.get("hidden_size", 768)), intermediate_size=int(vc.get("intermediate_size", 3072)),
                  num_layers=int(vc.get("num_hidden_layers", 12)), num_heads=int(vc.get("num_attention_heads", 12)),
                  image_size=int(vc.get("image_size", 224)), patch_size=int(vc.get("patch_size", 16)),
                  num_channels=int(vc.get("num_channels", 3)), layer_norm_eps=float(vc.get("layer_norm_eps", 1e-6)),
                  hidden_act=str(vc.get("hidden_act", "gelu_pytorch_tanh")))
        if cfg.hidden_act not in ("gelu_pytorch_tanh", "gelu_new"):
            raise ValueError(f"SigLIP hidden_act {cfg.hidden_act!r} is not supported (gelu_pytorch_tanh is)")
        if cfg.image_size % cfg.patch_size:
            raise ValueError(f"SigLIP image_size {cfg.image_size} is not a multiple of patch_size {cfg.patch_size}")
        return cfg


def pool_kernel(cfg: SiglipConfig, mm_tokens_per_image: int) -> int:
    """The projector's average-pooling kernel (and stride): patches per side over
    tokens per side (transformers' ``Gemma3MultiModalProjector``)."""
    side = math.isqrt(mm_tokens_per_image)
    if side * side != mm_tokens_per_image or side <= 0 or cfg.patches_per_side % side:
        raise ValueError(f"mm_tokens_per_image {mm_tokens_per_image} must be a square whose side divides the "
                         f"{cfg.patches_per_side} patches per image side")
    return cfg.patches_per_side // side


class _EncoderLayer(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.layer_norm1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)
        self.layer_norm2 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(d, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[images, patches, d]``: attention is full within each image."""
        b, n, d = x.shape
        h = self.layer_norm1(x)
        q, k, v = (p(h).view(b, n, self.num_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v)  # scale head_dim ** -0.5, as SigLIP's
        x = x + self.out_proj(a.transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(F.gelu(self.fc1(self.layer_norm2(x)), approximate="tanh"))


class Gemma3ImageEncoder(nn.Module):
    def __init__(self, vision_config: dict, text_hidden_size: int, mm_tokens_per_image: int):
        super().__init__()
        cfg = self.cfg = SiglipConfig.from_hf(vision_config)
        self.mm_tokens_per_image = mm_tokens_per_image
        self.kernel = pool_kernel(cfg, mm_tokens_per_image)
        d = cfg.hidden_size
        self.patch_embedding = nn.Linear(cfg.patch_dim, d)  # the Conv2d's [d, C, P, P] kernel, flattened
        self.position_embedding = nn.Parameter(torch.zeros(cfg.patches_per_side ** 2, d))
        self.layers = nn.ModuleList(_EncoderLayer(cfg) for _ in range(cfg.num_layers))
        self.post_layernorm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.mm_soft_emb_norm = nn.Parameter(torch.zeros(d))  # Gemma RMSNorm: scales by 1 + w
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(d, text_hidden_size))

    def forward(self, patches: torch.Tensor, num_images: int) -> torch.Tensor:
        cfg = self.cfg
        p = cfg.patches_per_side
        x = self.patch_embedding(patches.to(self.patch_embedding.weight.dtype)).view(num_images, p * p, -1)
        x = x + self.position_embedding
        for layer in self.layers:
            x = layer(x)
        x = self.post_layernorm(x)
        # projector: [B, d, P, P] grid pooled to [B, tokens, d]
        grid = x.transpose(1, 2).reshape(num_images, -1, p, p)
        pooled = F.avg_pool2d(grid, kernel_size=self.kernel, stride=self.kernel).flatten(2).transpose(1, 2)
        normed = F.rms_norm(pooled.float(), (pooled.shape[-1],), eps=cfg.layer_norm_eps)
        normed = (normed * (1.0 + self.mm_soft_emb_norm.float())).to(pooled.dtype)
        out = normed @ self.mm_input_projection_weight
        return out.reshape(num_images * self.mm_tokens_per_image, -1)

    # --- weights -------------------------------------------------------------
    @staticmethod
    def local_name(name: str) -> Optional[str]:
        """A checkpoint tensor's name in this module (None: not the tower's or the
        projector's; ``""``: the tower's but unused, the SigLIP pooling head)."""
        if name.startswith(_UNUSED):
            return ""
        for prefix in TOWER_PREFIXES:
            if name.startswith(prefix):
                rest = name[len(prefix):]
                rest = rest.replace("embeddings.patch_embedding.", "patch_embedding.")
                rest = rest.replace("embeddings.position_embedding.weight", "position_embedding")
                rest = rest.replace("encoder.layers.", "layers.").replace("self_attn.", "").replace("mlp.", "")
                return rest
        for prefix in PROJECTOR_PREFIXES:
            if name.startswith(prefix):
                rest = name[len(prefix):]
                return "mm_soft_emb_norm" if rest == "mm_soft_emb_norm.weight" else rest
        return None

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """Parameters by local name, shaped as the checkpoint stores them (the patch
        embedding as its Conv2d kernel)."""
        cfg = self.cfg
        out = dict(self.state_dict(keep_vars=False))
        out["patch_embedding.weight"] = out["patch_embedding.weight"].view(
            cfg.hidden_size, cfg.num_channels, cfg.patch_size, cfg.patch_size)
        return out
