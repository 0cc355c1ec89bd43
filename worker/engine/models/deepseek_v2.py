"""DeepSeek-V2 / V2.5 / V3 / R1 and Kimi K2 (``DeepseekV2ForCausalLM``,
``DeepseekV3ForCausalLM``): the Llama-family decoder (models/llama.py) with its
attention replaced by multi-head latent attention (models/mla.py) and its MLPs by
DeepSeek's mixture of experts (models/moe.py), after transformers'
modeling_deepseek_v2.py / modeling_deepseek_v3.py and vLLM's deepseek_v2.py:

* queries from ``q_proj``, or through the ``q_lora_rank`` bottleneck (``q_a_proj`` ->
  ``q_a_layernorm`` -> ``q_b_proj``); ``q_a_proj`` and ``kv_a_proj_with_mqa`` read the
  same input and run as one fused matmul;
* ``kv_a_proj_with_mqa`` gives the latent ``c_kv`` (normalised by ``kv_a_layernorm``) and
  the shared rotary key ``k_pe``; those two are what the paged cache stores (the
  ``latent`` layout: models/kv_layout.py), ``kv_b_proj`` expands them per head;
* rotary over the qk_rope_head_dim part only, over interleaved pairs (V2 always, V3
  unless ``rope_interleave`` is false), YaRN with the mscale_all_dim correction of the
  softmax scale (ModelConfig.mla.softmax_scale);
* the first ``first_k_dense_replace`` layers dense, the rest experts with always-on
  shared experts: V3 routes by ``noaux_tc`` (sigmoid, correction bias, grouped top-k,
  ``routed_scaling_factor``), V2 by ``greedy`` / ``group_limited_greedy`` softmax.

An FP8 KV cache (``--kv-cache-dtype fp8``) stores the latent in FP8 (scale 1.0,
saturated, as the K/V caches).  Tensor parallelism splits the heads
(``_attention_slices``) and the experts' intermediate dimension (models/moe.py); every
rank stores the whole latent.  Decode rows run the Triton backend's latent decode kernel
(kernels/triton/mla_decode.py) where that backend is chosen.  Not served: LoRA, CUDA
graphs (the latent attention plans each step on the host: decode runs eager).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from worker.engine.models.config import ModelConfig
from worker.engine.models.kv_layout import KVCacheLayout
from worker.engine.models.layers import RMSNorm, empty_param, projection_param
from worker.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from worker.engine.models.mla import LatentAttention, deinterleave


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    def _init_attention(self, c: ModelConfig, dtype: torch.dtype, device, sliding_window: Optional[int],
                        layer_idx: int) -> None:
        m = self.mla = c.mla
        h, heads = c.hidden_size, self.num_heads
        # The rotary part is rotated as heads + 1 rows: every head's q_pe and the one
        # shared k_pe (the model's rope factors are built for num_heads + num_kv_heads).
        self.num_kv_heads = 1
        self.q_lora_rank = m.q_lora_rank
        a_rows = m.kv_lora_rank + m.qk_rope_head_dim
        if m.q_lora_rank:
            # q_a_proj | kv_a_proj_with_mqa fused: both read the normed hidden state.
            self.qkv_a_weight = projection_param(m.q_lora_rank + a_rows, h, dtype=dtype, device=device)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, c.rms_norm_eps, dtype, device)
            self.q_b_weight = projection_param(heads * m.qk_head_dim, m.q_lora_rank, dtype=dtype, device=device)
            self._ATTENTION_WEIGHTS = ("qkv_a_weight", "q_b_weight", "o_weight")
        else:
            self.q_weight = projection_param(heads * m.qk_head_dim, h, dtype=dtype, device=device)
            self.kv_a_weight = projection_param(a_rows, h, dtype=dtype, device=device)
            self.q_a_layernorm = None
            self._ATTENTION_WEIGHTS = ("q_weight", "kv_a_weight", "o_weight")
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, c.rms_norm_eps, dtype, device)
        # kv_b_proj stays dense whatever the linears' packing: the attention reads it as
        # W_UK / W_UV (views of [heads, nope + v, rank]).
        self.kv_b_weight = empty_param(heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, dtype=dtype,
                                       device=device)
        self.o_weight = projection_param(h, heads * m.v_head_dim, dtype=dtype, device=device)
        self.o_bias = None
        self.use_rope, self.rotary_dim, self.rope_key = True, c.rotary_dim, "global"
        self.latent_attn = LatentAttention(m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim, m.softmax_scale)
        self.attn = _NoBackend()

    def norms(self) -> list[RMSNorm]:
        extra = [self.kv_a_layernorm] + ([self.q_a_layernorm] if self.q_a_layernorm is not None else [])
        return super().norms() + extra

    def _attention_slices(self, a: str) -> dict[str, tuple[int, int, int]]:
        """Tensor parallelism by heads (vLLM's): each rank's query rows (q_proj / q_b_proj),
        kv_b_proj rows (its heads' W_UK / W_UV) and o_proj columns; the down-projections
        to the latent (q_a_proj, kv_a_proj_with_mqa) and their norms are replicated, so
        every rank stores the whole latent and attends its own heads over it."""
        m, start, heads = self.mla, self.shard.head_start, self.num_heads
        q_rows = (0, start * m.qk_head_dim, heads * m.qk_head_dim)
        return {a + ("q_b_proj.weight" if self.q_lora_rank else "q_proj.weight"): q_rows,
                a + "kv_b_proj.weight": (0, start * (m.qk_nope_head_dim + m.v_head_dim),
                                         heads * (m.qk_nope_head_dim + m.v_head_dim)),
                a + "o_proj.weight": (1, start * m.v_head_dim, heads * m.v_head_dim)}

    def _attention_targets(self, a: str) -> dict[str, torch.Tensor]:
        m = self.mla
        t = {a + "kv_a_layernorm.weight": self.kv_a_layernorm.weight.data,
             a + "kv_b_proj.weight": self.kv_b_weight.data, a + "o_proj.weight": self.o_weight.data}
        if self.q_lora_rank:
            t.update({a + "q_a_proj.weight": self.qkv_a_weight.data[:m.q_lora_rank],
                      a + "kv_a_proj_with_mqa.weight": self.qkv_a_weight.data[m.q_lora_rank:],
                      a + "q_a_layernorm.weight": self.q_a_layernorm.weight.data,
                      a + "q_b_proj.weight": self.q_b_weight.data})
        else:
            t.update({a + "q_proj.weight": self.q_weight.data, a + "kv_a_proj_with_mqa.weight": self.kv_a_weight.data})
        return t

    def _attention(self, h: torch.Tensor, rope, attn, kv_layer: torch.Tensor, lora: Optional[Any]) -> torch.Tensor:
        t, m, heads = h.shape[0], self.mla, self.num_heads
        if self.q_lora_rank:
            a = self.linear(h, self.qkv_a_weight, None)
            q = self.linear(self.q_a_layernorm(a[:, :m.q_lora_rank].contiguous()), self.q_b_weight, None)
            kv = a[:, m.q_lora_rank:]
        else:
            q = self.linear(h, self.q_weight, None)
            kv = self.linear(h, self.kv_a_weight, None)
        q = q.view(t, heads, m.qk_head_dim)
        c_kv = self.kv_a_layernorm(kv[:, :m.kv_lora_rank].contiguous())
        pe = torch.cat((q[..., m.qk_nope_head_dim:], kv[:, None, m.kv_lora_rank:]), dim=1)  # [t, heads + 1, rope]
        if m.rope_interleave:
            pe = deinterleave(pe)
        pe = self._rotate(pe, rope)
        latent = torch.cat((c_kv, pe[:, heads]), dim=-1)
        o = self.latent_attn(q[..., :m.qk_nope_head_dim], pe[:, :heads], latent, self.kv_b_weight, kv_layer, attn)
        return self._row_parallel(o, self.o_weight, None)


class _NoBackend:
    """The latent attention runs on torch ops over the latent cache whatever the engine's
    attention backend (only the backend's fused element-wise kernels are used)."""

    def set_backend(self, backend) -> None:
        pass


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    layer_class = DeepseekV2DecoderLayer
    # The latent attention plans every step from host-side lengths: decode steps run
    # eager (the runner asks this before capturing).
    supports_cuda_graphs = False

    def use_attention_backend(self, backend) -> None:
        """The backend's fused element-wise kernels, and its latent decode kernel where it
        has one (Triton's ``mla_decode``); the expanded prefill stays on torch ops."""
        super().use_attention_backend(backend)
        kernel = getattr(backend.ops, "mla_decode", None) if backend.ops is not None else None
        for layer in self.layers:
            layer.latent_attn.decode_kernel = kernel

    @classmethod
    def kv_cache_layout(cls, config: ModelConfig) -> KVCacheLayout:
        """One latent ``[c_kv | k_pe]`` per token and layer, not per-head K/V.  Blocks stay
        on axis 2, so P/D KV transfer moves latent blocks between two such workers as it
        moves K/V ones (a Llama-layout peer is refused by the shape check)."""
        m = config.mla
        return KVCacheLayout(
            "latent", config.num_hidden_layers, 1, 1, m.latent_dim,
            expanded_values=config.num_attention_heads * (m.qk_head_dim + m.v_head_dim),
            what=f"c_kv ({m.kv_lora_rank}) + k_pe ({m.qk_rope_head_dim})")
