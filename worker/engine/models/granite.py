"""IBM Granite 3.x (``GraniteForCausalLM``): the Llama decoder with four scalars from its
config (ModelConfig.granite_multipliers): embeddings times ``embedding_multiplier``, each
block's attention and MLP outputs times ``residual_multiplier`` before they join the
residual stream, the attention scale ``attention_multiplier`` instead of
``head_dim ** -0.5``, and logits divided by ``logits_scaling`` (transformers'
modeling_granite.py, vLLM's granite.py)."""
from __future__ import annotations

from typing import Any, Optional

import torch

from worker.engine.attention.layer import PagedAttention
from worker.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, dtype, device, sliding_window, layer_idx):
        super().__init__(config, dtype, device, sliding_window, layer_idx)
        _, self.residual_multiplier, attention_multiplier, _ = config.granite_multipliers
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, config.head_dim, sliding_window,
                                   attention_multiplier)

    def _attention(self, h, rope, attn, kv_layer, lora: Optional[Any]) -> torch.Tensor:
        return super()._attention(h, rope, attn, kv_layer, lora).mul_(self.residual_multiplier)

    def _feed_forward(self, h, attn, lora: Optional[Any]) -> torch.Tensor:
        return super()._feed_forward(h, attn, lora).mul_(self.residual_multiplier)


class GraniteForCausalLM(LlamaForCausalLM):
    layer_class = GraniteDecoderLayer

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super()._embed(input_ids).mul_(self.config.granite_multipliers[0])

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, lora: Optional[Any] = None) -> torch.Tensor:
        return super().compute_logits(hidden, lora).div_(self.config.granite_multipliers[3])
