"""Qwen2-VL / Qwen2.5-VL: the Llama-family decoder (as Qwen2) with M-RoPE, plus the
vision tower (models/qwen2_vl_vision.py) that encodes images.

The engine drives the two halves separately: the runner encodes images (through
its encoder cache, worker/engine/multimodal/images.py) and hands the LM the rows of the
step whose input embeddings are image embeddings (``mm_embeds``).  Positions are
``[T]`` (text tokens, decode: every M-RoPE row equal, so this is plain RoPE and
the base model's fast path, CUDA graphs included) or ``[3, T]`` for steps that
prefill prompt tokens of a request with images.

Checkpoint names: transformers 5 (``model.language_model.*``, ``model.visual.*``,
``lm_head.*``) and the older layout (``model.*``, ``visual.*``, ``lm_head.*``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from worker.engine.attention.metadata import AttentionMetadata
from worker.engine.models.config import ModelConfig
from worker.engine.models.llama import LlamaForCausalLM
from worker.engine.models.mrope import mrope_cos_sin
from worker.engine.models.qwen2_vl_vision import build_vision_tower, hf_to_local_name
from worker.engine.models.rotary import rotary_factors, rotation_table


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    is_multimodal = True

    def __init__(self, config: ModelConfig, dtype: Optional[torch.dtype] = None,
                 device: torch.device | str = "cpu"):
        super().__init__(config, dtype=dtype, device=device)
        self.visual = build_vision_tower(config.vision_config, config.vision_variant).to(device=device,
                                                                                         dtype=self.dtype)
        # inv_freq stays float32 (HF computes the vision rotary in float32)
        self.visual.inv_freq = self.visual.inv_freq.float()
        self.mrope_section = list(config.mrope_section)
        self.spatial_merge_size = self.visual.cfg.spatial_merge_size
        if self.visual.cfg.out_hidden_size != config.hidden_size:
            raise ValueError(f"vision tower output width {self.visual.cfg.out_hidden_size} != LM hidden size "
                             f"{config.hidden_size}")

    def use_attention_backend(self, backend) -> None:
        """The LM as the base model; the vision tower's attention through the backend's
        variable-length kernel where it has one (Triton), else SDPA per image."""
        super().use_attention_backend(backend)
        self.visual.use_varlen_attention(getattr(backend.ops, "varlen_attention", None))

    # --- weights -------------------------------------------------------------
    @staticmethod
    def checkpoint_name(name: str) -> str:
        """A checkpoint tensor name in the loader's terms (``model.*`` LM, ``visual.*`` tower)."""
        if name.startswith("model.language_model."):
            return "model." + name[len("model.language_model."):]
        local = hf_to_local_name(name)
        if local is not None:
            return "visual." + local
        return name

    def own_weight_targets(self) -> dict[str, torch.Tensor]:
        t = super().own_weight_targets()
        cfg = self.visual.cfg
        for name, tensor in self.visual.state_dict().items():
            if name == "patch_embed.weight":  # the Conv3d kernel [out, C, T, P, P] over the linear's rows
                tensor = tensor.view(cfg.embed_dim, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size,
                                     cfg.patch_size)
            t["visual." + name] = tensor
        return t

    # --- images --------------------------------------------------------------
    @torch.inference_mode()
    def encode_image(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``[t*h*w // merge**2, hidden]`` embeddings of one image, in the model dtype."""
        return self.visual(pixel_values, grid_thw).to(self.dtype)

    # --- LM --------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_cache: torch.Tensor, lora: Optional[Any] = None,
                mm_embeds: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """As the base model; ``positions`` ``[T]`` or M-RoPE ``[3, T]``; ``mm_embeds``:
        (rows, embeddings) that replace the token embeddings of those rows."""
        if positions.dim() == 1 and mm_embeds is None:
            return super().forward(input_ids, positions, attn, kv_cache, lora)
        h = self._embed(input_ids)
        if lora is not None and self.lora is not None:
            lora.apply_embedding(input_ids, h, self.lora.embed)
        if mm_embeds is not None:
            rows, embeds = mm_embeds
            h = h.index_copy(0, rows, embeds.to(h.dtype))
        if positions.dim() == 1:
            table, index = self.rope, positions
        else:
            # Per-step rotation rows (cos | cos | -sin | sin) of the M-RoPE frequencies,
            # indexed by row number: the layers' rotary path runs unchanged.
            d = self.rope.shape[1] // 4
            cos_sin = torch.cat((self.rope[:, :d], self.rope[:, 3 * d:]), dim=-1)
            table = rotation_table(mrope_cos_sin(positions, self.mrope_section, cos_sin_table=cos_sin)
                                   .to(self.rope.dtype)).contiguous()
            index = torch.arange(positions.shape[1], device=positions.device)
        if self.ops is not None:
            rope = (table, index)
        else:
            rope = rotary_factors(table, index, self.layers[0].num_heads + self.layers[0].num_kv_heads)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, rope, attn, kv_cache[:, i], lora)
        h, _ = self.norm(h, residual)
        return h
