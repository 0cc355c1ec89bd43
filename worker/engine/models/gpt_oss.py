"""OpenAI GPT-OSS (``GptOssForCausalLM``): the Llama-family decoder (models/llama.py)
with GPT-OSS's variations composed in (transformers' modeling_gpt_oss.py, vLLM's
gpt_oss.py):

* attention sinks: a learned logit per query head (``self_attn.sinks``) that joins the
  softmax denominator of every query, handed to the attention backend with the layer
  (``PagedAttention(sinks=...)``; torch SDPA carries it as an extra masked key, the CPU
  native backend routes these layers to SDPA, the Triton kernel starts its running max
  and sum from it; FlashAttention refuses it);
* alternating sliding-window (128) and full layers from ``layer_types``, q/k/v/o
  biases, YaRN rope (models/rotary.py, ``truncate`` honoured);
* every MLP a mixture of experts (models/moe.py): biased router, softmax over the
  top-k logits, per-expert biases, clamped SwiGLU over the checkpoint's gate/up-interleaved
  fused expert tensors, held as they are stored (the released MXFP4 blocks are
  dequantized on load first: quantization/reader.py).
"""
from __future__ import annotations

import torch

from worker.engine.attention.layer import PagedAttention
from worker.engine.models.layers import empty_param
from worker.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class GptOssDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, dtype, device, sliding_window, layer_idx):
        super().__init__(config, dtype, device, sliding_window, layer_idx)
        # This rank's heads' sink logits; the attention reads them in place once loaded.
        self.sinks = empty_param(self.num_heads, dtype=dtype, device=device)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, config.head_dim, sliding_window,
                                   sinks=self.sinks.data)

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        t = super().weight_targets(prefix)
        t[prefix + "self_attn.sinks"] = self.sinks.data
        return t

    def weight_slices(self, prefix: str) -> dict[str, tuple[int, int, int]]:
        t = super().weight_slices(prefix)
        if self.tp.active:  # one sink logit per query head: this rank's heads'
            t[prefix + "self_attn.sinks"] = (0, self.shard.head_start, self.num_heads)
        return t


class GptOssForCausalLM(LlamaForCausalLM):
    layer_class = GptOssDecoderLayer
