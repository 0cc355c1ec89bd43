"""Multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache.

The cache holds, per token and layer, one vector ``[c_kv | k_pe]`` (kv_a_layernorm's
output of kv_lora_rank values and the roped shared key of qk_rope_head_dim): the
``latent`` layout of models/kv_layout.py.  Keys and values per head are never stored:
``kv_b_proj`` (``W_UK [heads, nope, rank]`` and ``W_UV [heads, v, rank]``) recovers them.

Two ways to attend over the same cache, as vLLM's MLA backends do
(vllm/v1/attention/backends/mla/common.py):

* ``expanded`` (prefill chunks, any query length): the sequence's latents are expanded
  through kv_b_proj into per-head K (nope | shared rope) and V, then ordinary causal
  attention -- compute-friendly when many queries share the expansion;
* ``absorbed`` (decode rows, one query each): ``q_nope`` is absorbed into ``W_UK`` so
  the scores are taken against the latent itself (``(q_nope W_UK) . c_kv + q_pe . k_pe``),
  the probabilities weight the latents, and ``W_UV`` maps the result to each head's
  value -- no per-head K/V of the context is ever formed, which is what makes decode
  memory-bound on the small latent.

Both are exact rewrites of the same product; tests check them against each other and
against transformers.  The expanded path runs on torch ops on every device; the absorbed
decode runs the attention backend's ``mla_decode`` kernel where it has one (Triton:
kernels/triton/mla_decode.py), torch ops otherwise.
"""
from __future__ import annotations

import torch

from worker.engine.attention.backends.base import to_kv_storage
from worker.engine.attention.metadata import AttentionMetadata


def write_latent(cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each token's ``[c_kv | k_pe]`` row at its slot (``cache``: one layer,
    ``[1, blocks, block_size, 1, latent_dim]``; an FP8 cache saturates, scale 1.0, as the
    K/V caches do: attention/backends/base.to_kv_storage)."""
    rows = to_kv_storage(latent, cache.dtype)
    _raw(cache).view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, _raw(rows))


def _raw(t: torch.Tensor) -> torch.Tensor:
    """FP8 tensors as their bytes: torch's CPU gather/scatter kernels have no FP8 types;
    indexing moves the bytes unchanged."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype.is_floating_point else t


def _select_rows(layer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``layer[index]`` (any index shape) for every cache dtype, FP8 included."""
    return _raw(layer)[index].view(layer.dtype)


def gather_latent(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` latents of a sequence with these cache blocks: ``[length, latent_dim]``."""
    layer = cache[0, :, :, 0]  # [blocks, block_size, latent_dim]
    return _select_rows(layer, blocks).reshape(-1, layer.shape[-1])[:length]


def expanded_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, w_uk: torch.Tensor,
                       w_uv: torch.Tensor, rank: int, scale: float, context_len: int) -> torch.Tensor:
    """One sequence's ``n`` queries (positions ``context_len ..``) over its ``L`` latents,
    expanded to per-head K/V: ``[n, heads, v]``.  ``q_nope [n, H, nope]``, ``q_pe [n, H, rope]``."""
    c_kv, k_pe = latent[:, :rank], latent[:, rank:]
    k_nope = torch.einsum("lc,hdc->hld", c_kv, w_uk)  # [H, L, nope]
    v = torch.einsum("lc,hvc->hlv", c_kv, w_uv)  # [H, L, v]
    heads, length = k_nope.shape[0], k_nope.shape[1]
    k = torch.cat((k_nope, k_pe.unsqueeze(0).expand(heads, length, k_pe.shape[-1])), dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)  # [H, n, qk]
    n = q.shape[1]
    # Causal over the whole sequence: query j sits at position context_len + j.
    mask = torch.arange(length, device=q.device)[None, :] <= (context_len + torch.arange(n, device=q.device))[:, None]
    scores = torch.matmul(q, k.transpose(1, 2)) * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(0, 1)  # [n, H, v]


def absorbed_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, lengths: torch.Tensor,
                       w_uk: torch.Tensor, w_uv: torch.Tensor, rank: int, scale: float) -> torch.Tensor:
    """``B`` decode queries, each over its own padded latents ``[B, L, latent_dim]`` (the
    first ``lengths[b]`` valid): ``[B, heads, v]``, never expanding the context."""
    q_lat = torch.einsum("bhd,hdc->bhc", q_nope, w_uk)  # q_nope absorbed into W_UK: [B, H, rank]
    c_kv, k_pe = latents[..., :rank], latents[..., rank:]
    scores = (torch.matmul(q_lat, c_kv.transpose(1, 2)) + torch.matmul(q_pe, k_pe.transpose(1, 2))) * scale
    valid = torch.arange(latents.shape[1], device=latents.device)[None, :] < lengths[:, None]  # [B, L]
    probs = scores.masked_fill(~valid[:, None, :], float("-inf")).softmax(dim=-1, dtype=torch.float32)
    o_lat = torch.matmul(probs.to(c_kv.dtype), c_kv)  # [B, H, rank]
    return torch.einsum("bhc,hvc->bhv", o_lat, w_uv)  # through W_UV


class LatentAttention:
    """A layer's attention over its latent cache (``__call__``), choosing per sequence:
    absorbed for one-query rows, expanded for longer ones."""

    def __init__(self, rank: int, nope: int, v_dim: int, scale: float):
        self.rank, self.nope, self.v_dim, self.scale = rank, nope, v_dim, scale
        # The attention backend's fused decode over the latent cache (the Triton
        # ``mla_decode``: kernels/triton/mla_decode.py), or None for torch's.
        self.decode_kernel = None

    def __call__(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, kv_b: torch.Tensor,
                 cache: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        """``q_nope [T, H, nope]``, ``q_pe [T, H, rope]`` (roped), ``latent [T, latent_dim]``
        (the step's rows, written to the cache first); ``kv_b`` the kv_b_proj weight
        ``[H * (nope + v), rank]``.  Returns ``[T, H * v]``."""
        write_latent(cache, latent, attn.slot_mapping)
        t, heads = q_nope.shape[0], q_nope.shape[1]
        w = kv_b.view(heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]
        out = q_nope.new_empty((t, heads, self.v_dim))
        block_size = cache.shape[2]
        decode_rows, decode_seqs = [], []
        start = 0
        for i, n in enumerate(attn.query_lens_cpu):
            if n == 1:
                decode_rows.append(start)
                decode_seqs.append(i)
            elif n:
                length = attn.seq_lens_cpu[i]
                blocks = attn.block_tables[i, :-(-length // block_size)].long()
                lat = gather_latent(cache, blocks, length).to(q_nope.dtype)  # an FP8 cache read back
                out[start:start + n] = expanded_attention(q_nope[start:start + n], q_pe[start:start + n], lat, w_uk,
                                                          w_uv, self.rank, self.scale, length - n)
            start += n
        if decode_rows:
            out[decode_rows] = self._decode(q_nope, q_pe, w_uk, w_uv, cache, attn, decode_rows, decode_seqs)
        return out.view(t, heads * self.v_dim)

    def _decode(self, q_nope, q_pe, w_uk, w_uv, cache, attn, rows: list[int], seqs: list[int]) -> torch.Tensor:
        """All one-query rows of the step at once: their blocks gathered into one padded
        ``[B, W * block_size, latent_dim]`` batch."""
        block_size = cache.shape[2]
        lengths_cpu = [attn.seq_lens_cpu[i] for i in seqs]
        width = -(-max(lengths_cpu) // block_size)
        index = torch.tensor(seqs, dtype=torch.long, device=attn.block_tables.device)
        r = torch.tensor(rows, dtype=torch.long, device=q_nope.device)
        if self.decode_kernel is not None:
            q_lat = torch.einsum("bhd,hdc->bhc", q_nope.index_select(0, r), w_uk).contiguous()
            o_lat = self.decode_kernel(q_lat, q_pe.index_select(0, r).contiguous(), cache[0, :, :, 0],
                                       attn.block_tables.index_select(0, index).contiguous(),
                                       attn.seq_lens.index_select(0, index).contiguous(), self.scale)
            return torch.einsum("bhc,hvc->bhv", o_lat, w_uv)
        tables = attn.block_tables.index_select(0, index)[:, :width].long()  # padding entries are block 0: masked
        layer = cache[0, :, :, 0]
        latents = _select_rows(layer, tables).reshape(len(seqs), width * block_size, layer.shape[-1]).to(q_nope.dtype)
        lengths = torch.tensor(lengths_cpu, device=latents.device)
        return absorbed_attention(q_nope.index_select(0, r), q_pe.index_select(0, r), latents, lengths, w_uk, w_uv,
                                  self.rank, self.scale)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``(x0, x1), (x2, x3) ...`` pairs regrouped as ``(x0, x2, ..., x1, x3, ...)``: rotating
    that with the half-split (neox) table equals transformers' interleaved DeepSeek rotary,
    up to the same permutation of q and k's rope dims (dot products unchanged)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)

