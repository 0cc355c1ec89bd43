"""Gemma 3 text (``Gemma3ForCausalLM``): the Llama-family decoder with Gemma's
variations, the rest composed from models/llama.py:

* RMSNorms scale by ``1 + weight`` in float32 (every block norm, the per-head q/k
  norms and the final norm);
* sandwich blocks: input and post-attention norms around attention, pre- and
  post-feed-forward norms around the MLP (ModelConfig.norm_scheme ``sandwich``);
* GeGLU (``gelu_pytorch_tanh(gate) * up``);
* interleaved local (sliding-window) and global layers, each kind with its own rope
  base/scaling (ModelConfig.local_rope);
* attention scale ``query_pre_attn_scalar ** -0.5``; embeddings scaled by
  ``sqrt(hidden_size)`` (rounded to the model dtype, as transformers does);
  ``final_logit_softcapping`` when configured (llama.compute_logits).

``Gemma3ForConditionalGeneration`` adds the SigLIP image encoder (models/gemma3_vision.py).

The norms run on torch ops, not the backends' fused RMSNorm (which has no ``1 + w``),
and GeGLU likewise; attention goes through the chosen backend as for every family.
"""
from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F

from worker.engine.attention.metadata import AttentionMetadata
from worker.engine.models.config import ModelConfig
from worker.engine.models.gemma3_vision import Gemma3ImageEncoder
from worker.engine.models.layers import RMSNorm
from worker.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class GemmaRMSNorm(RMSNorm):
    """``norm(x) * (1 + w)`` computed in float32, cast back (transformers' Gemma3RMSNorm)."""

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is not None:
            x = residual.add_(x)
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1.0 + self.weight.float())).to(x.dtype)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU on the fused ``[gate | up]`` projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


class Gemma3DecoderLayer(LlamaDecoderLayer):
    @staticmethod
    def make_norm(c: ModelConfig, dtype: torch.dtype, device) -> RMSNorm:
        return GemmaRMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)

    def _qk_norm(self, qk: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(qk.float(), (self.head_dim,), eps=self.qk_norm_eps)
        return (normed * (1.0 + self.qk_norm_weight.float())).to(qk.dtype)

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul(gate_up)


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_class = Gemma3DecoderLayer

    def __init__(self, config: ModelConfig, dtype: Optional[torch.dtype] = None,
                 device: torch.device | str = "cpu"):
        super().__init__(config, dtype=dtype, device=device)
        self.embed_scale = float(config.hidden_size) ** 0.5

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = super()._embed(input_ids)
        return h.mul_(torch.tensor(self.embed_scale, dtype=h.dtype))


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3's image-text checkpoints (4B/12B/27B ship as
    ``Gemma3ForConditionalGeneration``): the LM under the names of the causal LM
    (``language_model.model.*`` as released, ``model.language_model.*`` as transformers 5
    names it) and the SigLIP tower + projector (models/gemma3_vision.py) that encode
    images.  ``final_logit_softcapping``, when a config sets it, is applied as vLLM does
    (transformers' image-text class skips it; released Gemma 3 configs leave it unset).

    As for Qwen2-VL the runner encodes images through its encoder cache and hands the
    LM the rows whose input embeddings are image embeddings (``mm_embeds``); positions
    stay plain (no M-RoPE).  The tokens of one image attend to each other both ways
    (``image_attention``: the image runner hook marks their spans on the step layout,
    the attention backend opens the causal mask within each; multimodal/images.py)."""

    is_multimodal = True
    image_attention = "bidirectional"
    # Served as its language model alone with --limit-mm-per-prompt '{"image": 0}' (no
    # vision_config then): the tower is not built, its checkpoint tensors are skipped,
    # and the model shards under tensor parallelism like Gemma 3's text checkpoints.
    serves_language_model_only = True

    def __init__(self, config: ModelConfig, dtype: Optional[torch.dtype] = None,
                 device: torch.device | str = "cpu"):
        super().__init__(config, dtype=dtype, device=device)
        self.vision = None
        if config.vision_config is None:
            self.is_multimodal, self.image_attention = False, "causal"
        else:
            self.vision = Gemma3ImageEncoder(config.vision_config, config.hidden_size, config.mm_tokens_per_image
                                             ).to(device=device, dtype=self.dtype)

    def checkpoint_name(self, name: str) -> str:
        for old, new in (("language_model.model.", "model."), ("model.language_model.", "model."),
                         ("language_model.lm_head.", "lm_head.")):
            if name.startswith(old):
                return new + name[len(old):]
        local = Gemma3ImageEncoder.local_name(name)
        if local is not None:  # a tower tensor: skipped ("") when the tower is not served
            return "vision." + local if local and self.vision is not None else ""
        return name

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name:  # "": a tower tensor Gemma 3 does not use (SigLIP's pooling head)
            yield name, tensor

    def own_weight_targets(self) -> dict[str, torch.Tensor]:
        t = super().own_weight_targets()
        if self.vision is not None:
            t.update({"vision." + k: v for k, v in self.vision.weight_targets().items()})
        return t

    # --- images --------------------------------------------------------------
    @torch.inference_mode()
    def encode_image(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``[images * mm_tokens_per_image, hidden]`` embeddings, in the model dtype, of
        images given as row-major patches ``[images * P*P, C*p*p]`` (every Gemma 3 image
        has the tower's fixed ``[1, P, P]`` grid)."""
        return self.vision(pixel_values.to(self.dtype), int(grid_thw.shape[0])).to(self.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_cache: torch.Tensor, lora: Optional[Any] = None,
                mm_embeds: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """As the text model; ``mm_embeds``: (rows, embeddings) that replace those rows'
        (scaled) token embeddings, as transformers' ``masked_scatter`` does."""
        if mm_embeds is None:
            return super().forward(input_ids, positions, attn, kv_cache, lora)
        # The shared decoder's forward embeds through ``_embed``: the rows are swapped
        # there, for this call only, so the layer loop stays the one of the base model.
        self._mm_rows = mm_embeds
        try:
            return super().forward(input_ids, positions, attn, kv_cache, lora)
        finally:
            self._mm_rows = None

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = super()._embed(input_ids)
        mm = getattr(self, "_mm_rows", None)
        if mm is not None:
            rows, embeds = mm
            h = h.index_copy(0, rows, embeds.to(h.dtype))
        return h
