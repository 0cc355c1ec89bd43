"""The Llama-family decoder serving Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3
(per-head q/k RMSNorm), and their mixture-of-experts siblings Mixtral, Qwen2-MoE
and Qwen3-MoE (a sparse MLP per layer, models/moe.py), reading HF checkpoints by
their tensor names.  The other dense families compose it with the variations
their ``ModelConfig`` names (models/registry.py): post-norm blocks and q/k norms
over the whole projection (OLMo 2/3), NoPE layers (SmolLM3), partial rotary and
fused checkpoint tensors (Phi-3), sandwich norms and local/global rope (Gemma 3).

q/k/v and gate/up projections are fused into single matmuls: the loader writes
each HF tensor into its row range of the fused weight (``weight_targets``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from worker.engine.attention.metadata import AttentionMetadata
from worker.engine.models.config import ModelConfig
from worker.engine.attention.backends.base import AttentionBackend
from worker.engine.attention.layer import PagedAttention
from worker.engine.models.cpu_gemm import ONEDNN, LinearFn, PackedLinears
from worker.engine.models.kv_layout import KVCacheLayout, kv_cache_layout, mha_layout
from worker.engine.models.layers import RMSNorm, empty_param, projection_param, silu_and_mul
from worker.engine.models.moe import SparseMoeBlock
from worker.engine.parallel.sharding import head_shard, split, vocab_shard
from worker.engine.parallel.state import get_tp
from worker.engine.models.rotary import apply_rotary, build_cos_sin_table, rotary_factors, rotation_table
from worker.engine.models.weight_loading import load_named_weights

# Which norms a decoder block holds, by ModelConfig.norm_scheme.
_BLOCK_NORMS = {
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
}


def local_kv_heads(config: ModelConfig) -> int:
    """KV heads this tensor-parallel rank holds (all of them at world size 1)."""
    tp = get_tp()
    return head_shard(config.num_attention_heads, config.num_key_value_heads, tp.rank, tp.world).num_kv_heads


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Shape of the single KV tensor the engine preallocates for this model (this rank's
    heads; the family's layout: models/kv_layout.py)."""
    return kv_cache_layout(config).shape(num_blocks, block_size)


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block costs across all layers (for sizing the cache)."""
    return kv_cache_layout(config).bytes_per_block(block_size, dtype)


class LlamaDecoderLayer(nn.Module):
    MLP_ROWS = 512  # row block of the MLP on large steps: best of 128-1024 on the small and ~125M presets

    def __init__(self, c: ModelConfig, dtype: torch.dtype, device, sliding_window: Optional[int] = None,
                 layer_idx: int = 0):
        super().__init__()
        self.tp = tp = get_tp()
        self.shard = shard = head_shard(c.num_attention_heads, c.num_key_value_heads, tp.rank, tp.world)
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, c.head_dim
        self.q_size, self.kv_size = shard.num_heads * c.head_dim, shard.num_kv_heads * c.head_dim
        self.inter_start, inter = split(c.intermediate_size, tp.rank, tp.world, "intermediate_size")
        self.intermediate_size = inter
        self.hidden_size = c.hidden_size
        self.norm_scheme = c.norm_scheme
        self.norm_names = _BLOCK_NORMS[c.norm_scheme]
        self.input_layernorm = self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        for name in self.norm_names:
            setattr(self, name, self.make_norm(c, dtype, device))
        self._init_attention(c, dtype, device, sliding_window, layer_idx)
        # A sparse layer's MLP is the expert block; its index among the sparse layers
        # is its column of the routed-experts record.
        sparse = c.moe is not None and c.moe.sparse_layers[layer_idx]
        self.moe = SparseMoeBlock(c, dtype, device) if sparse else None
        self.moe_index = c.moe.moe_layer_index[layer_idx] if sparse else -1
        self.routing_store: Optional[torch.Tensor] = None  # [slots, moe layers, top_k], see set_routing_store
        self._LINEAR_WEIGHTS = self._ATTENTION_WEIGHTS if sparse else self._ATTENTION_WEIGHTS + self._MLP_WEIGHTS
        if not sparse:
            self.gate_up_weight = projection_param(2 * inter, c.hidden_size, dtype=dtype, device=device)
            self.gate_up_bias = empty_param(2 * inter, dtype=dtype, device=device) if c.mlp_bias else None
            self.down_weight = projection_param(c.hidden_size, inter, dtype=dtype, device=device)
            self.down_bias = empty_param(c.hidden_size, dtype=dtype, device=device) if c.mlp_bias else None
        self.linear: LinearFn = F.linear
        self.packing: Optional[PackedLinears] = None  # how the projections are packed (cpu_gemm), if they are
        self.ops: Optional[Any] = None  # fused element-wise kernels of the attention backend: SwiGLU, rotary
        self.lora: Optional[Any] = None  # LayerLoRA slots when LoRA serving is enabled (worker/engine/lora)

    def _init_attention(self, c: ModelConfig, dtype: torch.dtype, device, sliding_window: Optional[int],
                        layer_idx: int) -> None:
        """The attention's parameters and its ``PagedAttention`` (families with another
        attention, DeepSeek's latent one, override this, ``_attention`` and the
        attention part of ``weight_targets``)."""
        q_size, kv_size = self.q_size, self.kv_size
        self.qkv_weight = projection_param(q_size + 2 * kv_size, c.hidden_size, dtype=dtype, device=device)
        self.qkv_bias = empty_param(q_size + 2 * kv_size, dtype=dtype, device=device) if c.qkv_bias else None
        self.o_weight = projection_param(c.hidden_size, q_size, dtype=dtype, device=device)
        self.o_bias = empty_param(c.hidden_size, dtype=dtype, device=device) if c.o_bias else None
        # Qwen3: q_norm/k_norm weights broadcast per head into one [heads + kv_heads, D]
        # table so q and k are normalised by a single op.
        self.qk_norm_weight = (empty_param(self.num_heads + self.num_kv_heads, c.head_dim,
                                           dtype=dtype, device=device) if c.qk_norm and not c.qk_norm_full else None)
        # OLMo 2/3: one norm over the whole q (and k) projection, not per head.
        self.q_norm_full = empty_param(q_size, dtype=dtype, device=device) if c.qk_norm_full else None
        self.k_norm_full = empty_param(kv_size, dtype=dtype, device=device) if c.qk_norm_full else None
        # Under tensor parallelism their mean square spans all ranks' heads (a KV head
        # held by several ranks counts once).
        self.full_q_size, self.full_kv_size = c.q_size, c.kv_size
        self.kv_replicas = max(1, self.tp.world // c.num_key_value_heads)
        self.qk_norm_eps = c.rms_norm_eps
        # Rotary: on this layer at all (SmolLM3's NoPE layers have none), over the first
        # rotary_dim of each head (partial rotary), from which of the model's tables.
        self.use_rope = c.layer_rope[layer_idx] if c.layer_rope else True
        self.rotary_dim = c.rotary_dim
        self.rope_key = "local" if sliding_window and c.local_rope is not None else "global"
        scale = c.query_pre_attn_scalar ** -0.5 if c.query_pre_attn_scalar is not None else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, c.head_dim, sliding_window, scale)

    _ATTENTION_WEIGHTS = ("qkv_weight", "o_weight")
    _MLP_WEIGHTS = ("gate_up_weight", "down_weight")
    # The HF modules (PEFT target names) behind the fused q/k/v and gate/up projections.
    LORA_QKV_MODULES = ("q_proj", "k_proj", "v_proj")
    LORA_GATE_UP_MODULES = ("gate_proj", "up_proj")

    @staticmethod
    def make_norm(c: ModelConfig, dtype: torch.dtype, device) -> RMSNorm:
        return RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)

    def norms(self) -> list[RMSNorm]:
        return [getattr(self, name) for name in self.norm_names]

    def pack_linears(self, scheme: Optional[PackedLinears] = None) -> None:
        """Swap the projection weights for packed copies (``scheme``, default the one
        packed with before, else oneDNN's; see cpu_gemm); the dense originals are
        dropped, so weight_targets() is no longer usable until ``unpack_linears``."""
        scheme = scheme or self.packing or ONEDNN
        if self.packing is not None and self.linear is not F.linear:
            return  # packed already
        for name in self._LINEAR_WEIGHTS:
            packed = scheme.pack(getattr(self, name))
            self._parameters.pop(name, None)
            setattr(self, name, packed)
        if self.moe is not None and scheme.packs_experts:
            self.moe.pack_experts(scheme)
        self.packing, self.linear = scheme, scheme.linear

    def unpack_linears(self) -> None:
        """Dense projection weights again (exact), run with torch's GEMM until packed again."""
        if self.packing is None or self.linear is F.linear:
            return
        for name in self._LINEAR_WEIGHTS:
            setattr(self, name, nn.Parameter(self.packing.unpack(getattr(self, name)), requires_grad=False))
        if self.moe is not None:
            self.moe.unpack_experts()
        self.linear = F.linear

    def weight_slices(self, prefix: str) -> dict[str, tuple[int, int, int]]:
        """HF tensor name -> (dim, start, length) of the slice this rank holds (sharded
        tensors only; the loader narrows the checkpoint tensor before copying)."""
        if not self.tp.active:
            return {}
        m = prefix + "mlp."
        t = self._attention_slices(prefix + "self_attn.")
        if self.moe is not None:
            t.update(self.moe.weight_slices(prefix))
        else:
            inter = self.gate_up_weight.shape[0] // 2
            t.update({m + "gate_proj.weight": (0, self.inter_start, inter),
                      m + "up_proj.weight": (0, self.inter_start, inter),
                      m + "down_proj.weight": (1, self.inter_start, inter)})
            if self.gate_up_bias is not None:
                t.update({m + "gate_proj.bias": (0, self.inter_start, inter),
                          m + "up_proj.bias": (0, self.inter_start, inter)})
        return t

    def _attention_slices(self, a: str) -> dict[str, tuple[int, int, int]]:
        """The attention's sharded tensors (``a``: the ``...self_attn.`` prefix): q/k/v rows
        and o_proj columns of this rank's heads."""
        sh, d = self.shard, self.head_dim
        q_rows, kv_rows = (0, sh.head_start * d, self.q_size), (0, sh.kv_head_start * d, self.kv_size)
        t = {a + "q_proj.weight": q_rows, a + "k_proj.weight": kv_rows, a + "v_proj.weight": kv_rows,
             a + "o_proj.weight": (1, sh.head_start * d, self.q_size)}
        if self.qkv_bias is not None:
            t.update({a + "q_proj.bias": q_rows, a + "k_proj.bias": kv_rows, a + "v_proj.bias": kv_rows})
        if self.q_norm_full is not None:  # OLMo: the norms' weights follow the heads
            t.update({a + "q_norm.weight": q_rows, a + "k_norm.weight": kv_rows})
        return t

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """HF tensor name -> the (view of the) parameter it is copied into."""
        m = prefix + "mlp."
        t = {prefix + name + ".weight": getattr(self, name).weight.data for name in self.norm_names}
        t.update(self._attention_targets(prefix + "self_attn."))
        if self.moe is not None:
            t.update(self.moe.weight_targets(prefix))
        else:
            inter = self.gate_up_weight.shape[0] // 2
            t[m + "gate_proj.weight"] = self.gate_up_weight.data[:inter]
            t[m + "up_proj.weight"] = self.gate_up_weight.data[inter:]
            t[m + "down_proj.weight"] = self.down_weight.data
            if self.gate_up_bias is not None:
                t[m + "gate_proj.bias"] = self.gate_up_bias.data[:inter]
                t[m + "up_proj.bias"] = self.gate_up_bias.data[inter:]
                t[m + "down_proj.bias"] = self.down_bias.data
        return t

    def _attention_targets(self, a: str) -> dict[str, torch.Tensor]:
        """The attention's tensors (``a``: the ``...self_attn.`` prefix) -> their views."""
        q, kv = self.q_size, self.kv_size
        t = {
            a + "q_proj.weight": self.qkv_weight.data[:q],
            a + "k_proj.weight": self.qkv_weight.data[q:q + kv],
            a + "v_proj.weight": self.qkv_weight.data[q + kv:],
            a + "o_proj.weight": self.o_weight.data,
        }
        if self.qkv_bias is not None:
            t[a + "q_proj.bias"] = self.qkv_bias.data[:q]
            t[a + "k_proj.bias"] = self.qkv_bias.data[q:q + kv]
            t[a + "v_proj.bias"] = self.qkv_bias.data[q + kv:]
        if self.o_bias is not None:
            t[a + "o_proj.bias"] = self.o_bias.data
        if self.qk_norm_weight is not None:
            t[a + "q_norm.weight"] = self.qk_norm_weight.data[: self.num_heads]
            t[a + "k_norm.weight"] = self.qk_norm_weight.data[self.num_heads:]
        if self.q_norm_full is not None:
            t[a + "q_norm.weight"] = self.q_norm_full.data
            t[a + "k_norm.weight"] = self.k_norm_full.data
        return t

    def forward(self, h: torch.Tensor, residual: Optional[torch.Tensor],
                rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata,
                kv_layer: torch.Tensor, lora: Optional[Any] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One block; the residual add is deferred: returns (block output, residual
        stream before it), summed by the next block's (or the final) norm."""
        if lora is not None and self.lora is None:
            lora = None
        if self.norm_scheme == "pre":
            if residual is None:
                residual = h
                h = self.input_layernorm(h)
            else:
                h, residual = self.input_layernorm(h, residual)
            h = self._attention(h, rope, attn, kv_layer, lora)
            h, residual = self.post_attention_layernorm(h, residual)
            return self._feed_forward(h, attn, lora), residual
        # post (OLMo 2/3) and sandwich (Gemma 3): the blocks' outputs are normed before
        # they join the residual stream.
        x = h if residual is None else residual.add_(h)
        a = self._attention(x if self.input_layernorm is None else self.input_layernorm(x), rope, attn, kv_layer,
                            lora)
        x = x + self.post_attention_layernorm(a)
        m = self._feed_forward(x if self.pre_feedforward_layernorm is None else self.pre_feedforward_layernorm(x),
                               attn, lora)
        return self.post_feedforward_layernorm(m), x

    def _attention(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attn: AttentionMetadata,
                   kv_layer: torch.Tensor, lora: Optional[Any]) -> torch.Tensor:
        t = h.shape[0]
        qkv = self.linear(h, self.qkv_weight, self.qkv_bias)
        if lora is not None:
            lora.apply(h, qkv, self.lora.qkv)
        n_qk = self.num_heads + self.num_kv_heads
        if self.q_norm_full is not None:
            q_size, kv_size = self.q_size, self.kv_size
            qk = torch.cat((self._full_norm(qkv[:, :q_size], self.q_norm_full, self.full_q_size, 1),
                            self._full_norm(qkv[:, q_size:q_size + kv_size], self.k_norm_full, self.full_kv_size,
                                            self.kv_replicas)),
                           dim=-1).view(t, n_qk, self.head_dim)
        else:
            qk = qkv[:, : self.q_size + self.kv_size].view(t, n_qk, self.head_dim)
            if self.qk_norm_weight is not None:
                qk = self._qk_norm(qk)
        if self.use_rope:
            qk = self._rotate(qk, rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        o = self.attn(q, k, v, kv_layer, attn)
        out = self._row_parallel(o, self.o_weight, self.o_bias)
        if lora is not None:
            lora.apply(o.reshape(t, -1), out, self.lora.o)
        return out

    def _full_norm(self, x: torch.Tensor, weight: torch.Tensor, full_size: int, replicas: int) -> torch.Tensor:
        """RMSNorm over the whole projection (OLMo), of which this rank holds ``x``."""
        if not self.tp.active:
            return F.rms_norm(x, (x.shape[-1],), weight, self.qk_norm_eps)
        sum_sq = self.tp.all_reduce(x.float().pow(2).sum(-1, keepdim=True))
        if replicas > 1:
            sum_sq.div_(replicas)
        return (x.float() * torch.rsqrt(sum_sq / full_size + self.qk_norm_eps)).to(x.dtype) * weight

    def _qk_norm(self, qk: torch.Tensor) -> torch.Tensor:
        """Per-head RMSNorm of q and k (Qwen3; Gemma 3 overrides it)."""
        return F.rms_norm(qk, (self.head_dim,), eps=self.qk_norm_eps) * self.qk_norm_weight

    def _rotate(self, qk: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """q and k rotated (partial rotary: the first rotary_dim of each head only)."""
        partial = self.rotary_dim < self.head_dim
        part = qk[..., : self.rotary_dim] if partial else qk
        if self.ops is not None:
            self.ops.rotary_(part, *rope)  # in place: rope = (rotation table, positions); a head slice is fine
            return qk
        if not partial:
            return apply_rotary(qk, rope)
        return torch.cat((apply_rotary(part, rope), qk[..., self.rotary_dim:]), dim=-1)

    def _feed_forward(self, h: torch.Tensor, attn: AttentionMetadata, lora: Optional[Any]) -> torch.Tensor:
        t = h.shape[0]
        if self.moe is not None:
            h, expert_ids = self.moe(h)
            if self.routing_store is not None:
                # Beside the K/V of the same slots: cached prefix blocks keep their routing.
                self.routing_store[attn.slot_mapping, self.moe_index] = expert_ids.to(self.routing_store.dtype)
            return h
        if t <= self.MLP_ROWS or lora is not None:
            return self._mlp(h, lora)
        # Large (prefill) steps: the [rows, 2 * intermediate] activation of a whole
        # step falls out of cache between the two GEMMs; row blocks keep it in L2.
        # Each output row is computed exactly as in one call (tested bit-identical).
        out = torch.empty_like(h)
        for s in range(0, t, self.MLP_ROWS):
            out[s:s + self.MLP_ROWS] = self._mlp(h[s:s + self.MLP_ROWS])
        return out

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up) if self.ops is None else self.ops.silu_and_mul(gate_up)

    def _mlp(self, h: torch.Tensor, lora: Optional[Any] = None) -> torch.Tensor:
        gate_up = self.linear(h, self.gate_up_weight, self.gate_up_bias)
        if lora is not None:
            lora.apply(h, gate_up, self.lora.gate_up)
        act = self._activation(gate_up)
        out = self._row_parallel(act, self.down_weight, self.down_bias)
        if lora is not None:
            lora.apply(act, out, self.lora.down)
        return out

    def _row_parallel(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """Output projection over this rank's input columns; the partial sums of all
        ranks are all-reduced, and the (unsharded) bias is added once, after."""
        if not self.tp.active:
            return self.linear(x, weight, bias)
        out = self.tp.all_reduce(self.linear(x, weight, None))
        return out if bias is None else out.add_(bias)


class LlamaForCausalLM(nn.Module):
    layer_class = LlamaDecoderLayer  # families with their own block subclass it
    def __init__(self, config: ModelConfig, dtype: Optional[torch.dtype] = None,
                 device: torch.device | str = "cpu"):
        super().__init__()
        self.config = config
        dtype = dtype or config.dtype
        self.dtype, self.device = dtype, torch.device(device)
        self.tp = tp = get_tp()
        self.vocab_start, self.vocab_held, shard_rows = vocab_shard(config.vocab_size, tp.rank, tp.world)
        # Padded shard rows stay zero: their logits are cut off after the gather.
        self.embed_tokens = empty_param(shard_rows, config.hidden_size, dtype=dtype, device=device)
        if shard_rows != self.vocab_held:
            self.embed_tokens.data[self.vocab_held:].zero_()
        windows = config.layer_sliding_windows or (None,) * config.num_hidden_layers
        self.layers = nn.ModuleList(self.layer_class(config, dtype, device, windows[i], i)
                                    for i in range(config.num_hidden_layers))
        self.norm = self.layer_class.make_norm(config, dtype, device)
        self.lm_head = (self.embed_tokens if config.tie_word_embeddings
                        else empty_param(shard_rows, config.hidden_size, dtype=dtype, device=device))
        if self.lm_head is not self.embed_tokens and shard_rows != self.vocab_held:
            self.lm_head.data[self.vocab_held:].zero_()
        self.lora: Optional[Any] = None  # ModelLoRA (embedding, head) slots when LoRA serving is enabled
        # Cast like HF: cos/sin computed in float32, then rounded to the model dtype.
        table = build_cos_sin_table(config.rotary_dim, config.rope_theta, config.max_position_embeddings,
                                    config.rope_scaling)
        self._lm_head_packed: Optional[torch.Tensor] = None
        self.packing: Optional[PackedLinears] = None  # the projections' and the head's packing, if any
        self.ops: Optional[Any] = None
        self.register_buffer("rope", rotation_table(table.to(device=device, dtype=dtype)), persistent=False)
        local = None  # the sliding layers' own table (ModelConfig.local_rope), same length
        if config.local_rope is not None:
            theta, scaling = config.local_rope
            local = build_cos_sin_table(config.rotary_dim, theta, config.max_position_embeddings, scaling)
            local = rotation_table(local.to(device=device, dtype=dtype))[: len(self.rope)]
        self.register_buffer("rope_local", local, persistent=False)

    @classmethod
    def kv_cache_layout(cls, config: ModelConfig) -> KVCacheLayout:
        """What the paged cache holds for this family (models/kv_layout.py): K and V of
        this rank's KV heads."""
        return mha_layout(config.num_hidden_layers, local_kv_heads(config), config.head_dim)

    def pack_linears(self, scheme: PackedLinears = ONEDNN) -> None:
        """Use packed weights (``scheme``, see cpu_gemm) for every projection and the LM
        head.  Call after loading: the dense projection weights are dropped."""
        self.packing = scheme
        for layer in self.layers:
            layer.pack_linears(scheme)
        self.pack_lm_head()

    def projection_weights(self) -> list[torch.Tensor]:
        """The decoder layers' projection weights ``pack_linears`` hands to the scheme's
        ``pack`` one by one (dense, before packing; MoE experts are packed as stacks)."""
        return [getattr(layer, name) for layer in self.layers for name in layer._LINEAR_WEIGHTS]

    def expert_stacks(self) -> list[torch.Tensor]:
        """The MoE expert stacks (``w13 [E, 2I, H]``, ``w2 [E, H, I]``) a scheme that packs
        experts is handed whole (dense, before packing; experts with biases are never packed)."""
        return [stack for layer in self.layers if layer.moe is not None and layer.moe.w13_bias is None
                for stack in (layer.moe.w13, layer.moe.w2) if isinstance(stack, torch.Tensor)]

    def packable(self, scheme: PackedLinears) -> bool:
        """Whether ``scheme`` can pack every weight ``pack_linears`` would (checked before
        packing anything: a model is packed whole or not at all)."""
        weights = [self.lm_head] + self.projection_weights()
        for layer in self.layers:
            if layer.moe is not None and scheme.packs_experts:
                weights += [layer.moe.w13[0], layer.moe.w2[0]]
        return all(scheme.accepts(w) for w in weights)

    def pack_lm_head(self) -> None:
        """(Re)pack the head from the dense ``lm_head``: the embedding table stays dense
        (tied heads share it), so the head gets its own packed copy."""
        self._lm_head_packed = self.packing.head_scheme.pack(self.lm_head) if self.packing is not None else None

    def use_attention_backend(self, backend: AttentionBackend) -> None:
        """Attention through ``backend`` and, where it has them, its fused RMSNorm,
        SwiGLU and rotary kernels (``backend.ops``; None keeps torch's ops)."""
        ops = backend.ops
        self.ops = ops
        self.norm.ops = ops
        for layer in self.layers:
            layer.ops = ops
            if layer.moe is not None:
                layer.moe.ops = ops
            for norm in layer.norms():
                norm.ops = ops
            layer.attn.set_backend(backend)

    def set_routing_store(self, store: Optional[torch.Tensor]) -> None:
        """Record every token's routed experts into ``store[slot, moe_layer]`` during
        forwards (None: stop recording)."""
        for layer in self.layers:
            layer.routing_store = store if layer.moe is not None else None

    @property
    def max_positions(self) -> int:
        return self.rope.shape[0]

    def weight_slices(self) -> dict[str, tuple[int, int, int]]:
        """HF tensor name -> (dim, start, length) this tensor-parallel rank loads."""
        if not self.tp.active:
            return {}
        vocab = (0, self.vocab_start, self.vocab_held)
        t = {"model.embed_tokens.weight": vocab}
        if not self.config.tie_word_embeddings:
            t["lm_head.weight"] = vocab
        for i, layer in enumerate(self.layers):
            t.update(layer.weight_slices(f"model.layers.{i}."))
        return t

    def own_weight_targets(self) -> dict[str, torch.Tensor]:
        """The tensors outside the decoder layers (embedding, final norm, LM head; a
        vision tower in subclasses) -> where they go."""
        t = {"model.embed_tokens.weight": self.embed_tokens.data[: self.vocab_held],
             "model.norm.weight": self.norm.weight.data}
        if not self.config.tie_word_embeddings:
            t["lm_head.weight"] = self.lm_head.data[: self.vocab_held]
        return t

    def load_weights(self, weights) -> set[str]:
        """Fill the parameters from ``(HF name, tensor)`` pairs (models/weight_loading.py)."""
        return load_named_weights(self, weights)

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """Every HF tensor name this model needs -> where it goes."""
        t = self.own_weight_targets()
        for i, layer in enumerate(self.layers):
            t.update(layer.weight_targets(f"model.layers.{i}."))
        return t

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_cache: torch.Tensor, lora: Optional[Any] = None) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm for the flat batch;
        ``lora`` (a LoRABatch) adds each row's adapter to the projections."""
        h = self._embed(input_ids)
        if lora is not None and self.lora is not None:
            lora.apply_embedding(input_ids, h, self.lora.embed)
        ropes = {"global": self._rope_factors(self.rope, positions)}
        if self.rope_local is not None:
            ropes["local"] = self._rope_factors(self.rope_local, positions)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, ropes[layer.rope_key], attn, kv_cache[:, i], lora)
        h, _ = self.norm(h, residual)
        return h

    def _rope_factors(self, table: torch.Tensor, positions: torch.Tensor):
        if self.ops is not None:  # layers rotate in place from the table
            return table, positions
        # per-step factors, shared by all layers
        return rotary_factors(table, positions, self.layers[0].num_heads + self.layers[0].num_kv_heads)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.active:
            return F.embedding(input_ids, self.embed_tokens)
        # Vocab-parallel: each rank embeds the ids in its shard, zeros elsewhere; the sum is the lookup.
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_held)
        h = F.embedding(local.masked_fill(outside, 0), self.embed_tokens)
        return self.tp.all_reduce(h.masked_fill_(outside[:, None], 0))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, lora: Optional[Any] = None) -> torch.Tensor:
        """float32 ``[R, vocab]`` for the selected hidden rows (every rank calls it
        under tensor parallelism: the vocabulary shards are gathered); ``lora``: the
        rows' LoRABatch, for adapters on the output head."""
        packed = self._lm_head_packed
        if packed is not None:
            logits = self.packing.head_scheme.linear(hidden, packed, None)
        else:
            logits = F.linear(hidden, self.lm_head)
        if lora is not None and self.lora is not None:
            lora.apply(hidden, logits, self.lora.lm_head)
        cap = self.config.final_logit_softcapping
        if cap:  # Gemma: cap * tanh(logits / cap), in the model dtype as vLLM and transformers
            logits = torch.tanh(logits / cap).mul_(cap)
        logits = logits.float()
        if self.tp.active:
            logits = self.tp.all_gather_last_dim(logits)[:, : self.config.vocab_size]
        return logits
