"""Paged attention over the engine's block KV cache.

Each layer owns ``kv_layer = kv_cache[:, layer]`` of shape
``[2, num_blocks, block_size, num_kv_heads, head_dim]``.  A step first writes its
new K/V at ``attn.slot_mapping``, then every sequence attends over its blocks with
a lower-right causal mask (query j of a sequence with context c sees keys 0..c+j).

Backends, picked per call:
* CUDA, fp16/bf16, with ``vllm_flash_attn`` or ``flash_attn`` importable (and a block size the
  kernel accepts): one ``flash_attn_varlen_func`` call reading the paged cache
  through ``block_table`` for the whole mixed batch.
* Otherwise (CPU, and CUDA without those kernels) torch SDPA:
  - decode rows (query_len == 1) of all sequences in ONE batched call over keys
    gathered to ``[B, max_seq_len]`` with a padding mask.  GQA costs no KV copy:
    the G query heads sharing a KV head ride in SDPA's query-length axis.
  - prefill chunks one sequence at a time.  A chunk does O(q_len * seq_len) work,
    so the few Python ops per sequence are noise, while padding chunks of uneven
    length to one batch would waste compute quadratically.  A chunk with no
    context attends to its own fresh K/V (no gather, built-in causal kernel).
Per-step index tensors are computed once and cached on the metadata, so layers
after the first only run the attention math.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.engine.attn_metadata import AttentionMetadata


def _load_flash_varlen():
    """(varlen function, block-size multiple it pages with, takes seqused_k) or None."""
    try:  # vLLM's fork: any block size that is a multiple of 16, K lengths via seqused_k
        from vllm.vllm_flash_attn import flash_attn_varlen_func  # type: ignore

        return flash_attn_varlen_func, 16, True
    except Exception:
        pass
    try:  # upstream FlashAttention-2 pages only with multiples of 256, K lengths via cu_seqlens_k
        from flash_attn import flash_attn_varlen_func  # type: ignore

        return flash_attn_varlen_func, 256, False
    except Exception:
        return None


_FLASH = None
_FLASH_LOADED = False


def flash_backend():
    global _FLASH, _FLASH_LOADED
    if not _FLASH_LOADED:
        _FLASH = _load_flash_varlen() if torch.cuda.is_available() else None
        _FLASH_LOADED = True
    return _FLASH


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Copy whole blocks of one layer's K (or V) cache ``[num_blocks, block_size, kvh, D]``
    in table order.  Selecting rows of a 2-D view moves each block as one
    contiguous chunk, several times faster than indexing the 5-D tensor."""
    return cache.view(cache.shape[0], -1).index_select(0, blocks)


class _DecodeGroup:
    """Batched single-token queries: rows of the flat batch, their block tables
    (trimmed to the longest sequence) and the key padding mask."""

    def __init__(self, attn: AttentionMetadata, seq_idx: list[int], block_size: int):
        device = attn.block_tables.device
        all_rows = len(seq_idx) == attn.num_seqs
        lens = [attn.seq_lens_cpu[i] for i in seq_idx]
        self.max_len = max(lens)
        nblocks = -(-self.max_len // block_size)
        if all_rows:
            self.rows = None  # every sequence decodes: the flat batch is already in order
            tables = attn.block_tables[:, :nblocks]
            seq_lens = attn.seq_lens
        else:
            idx = torch.tensor(seq_idx, dtype=torch.long, device=device)
            self.rows = attn.query_start_loc.index_select(0, idx).long()
            tables = attn.block_tables.index_select(0, idx)[:, :nblocks]
            seq_lens = attn.seq_lens.index_select(0, idx)
        self.flat_blocks = tables.reshape(-1).long()
        self.num = len(seq_idx)
        keys = torch.arange(self.max_len, device=device)
        self.mask = (keys[None, :] < seq_lens[:, None]).view(self.num, 1, 1, self.max_len)


class _PrefillSeq:
    __slots__ = ("start", "end", "context", "seq_len", "blocks", "mask")

    def __init__(self, attn: AttentionMetadata, i: int, start: int, block_size: int):
        q_len = attn.query_lens_cpu[i]
        self.start, self.end = start, start + q_len
        self.seq_len = attn.seq_lens_cpu[i]
        self.context = self.seq_len - q_len
        self.blocks = self.mask = None
        if self.context:
            device = attn.block_tables.device
            self.blocks = attn.block_tables[i, : -(-self.seq_len // block_size)].long()
            keys = torch.arange(self.seq_len, device=device)
            queries = torch.arange(self.context, self.seq_len, device=device)
            self.mask = keys[None, :] <= queries[:, None]  # lower-right causal


class _TorchPlan:
    def __init__(self, attn: AttentionMetadata, block_size: int):
        decode_idx: list[int] = []
        self.prefills: list[_PrefillSeq] = []
        start = 0
        for i, q_len in enumerate(attn.query_lens_cpu):
            if q_len == 1:
                decode_idx.append(i)
            else:
                self.prefills.append(_PrefillSeq(attn, i, start, block_size))
            start += q_len
        self.decode = _DecodeGroup(attn, decode_idx, block_size) if decode_idx else None


class PagedAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = head_dim ** -0.5

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                 attn: AttentionMetadata) -> torch.Tensor:
        """q ``[T, heads, D]``, k/v ``[T, kv_heads, D]`` -> ``[T, heads * D]``."""
        block_size = kv_layer.shape[2]
        flat = kv_layer.view(2, -1, self.num_kv_heads, self.head_dim)
        flat[0].index_copy_(0, attn.slot_mapping, k)
        flat[1].index_copy_(0, attn.slot_mapping, v)
        if q.is_cuda:
            flash = flash_backend()
            if flash is not None and block_size % flash[1] == 0 and q.dtype in (torch.float16, torch.bfloat16):
                return self._flash(flash, q, kv_layer, attn)
        plan = attn.cache.get("torch_plan")
        if plan is None:
            plan = attn.cache["torch_plan"] = _TorchPlan(attn, block_size)
        t = q.shape[0]
        if plan.decode is not None and plan.decode.rows is None:  # decode-only step: no scatter
            return self._decode(q, kv_layer, plan.decode).reshape(t, -1)
        if plan.decode is None and len(plan.prefills) == 1:  # single prefill chunk
            return self._prefill(q, k, v, kv_layer, plan.prefills[0]).reshape(t, -1)
        out = torch.empty_like(q)
        if plan.decode is not None:
            out.index_copy_(0, plan.decode.rows, self._decode(q, kv_layer, plan.decode))
        for seq in plan.prefills:
            out[seq.start:seq.end] = self._prefill(q, k, v, kv_layer, seq)
        return out.view(t, -1)

    def _decode(self, q: torch.Tensor, kv_layer: torch.Tensor, g: _DecodeGroup) -> torch.Tensor:
        """Outputs ``[g.num, heads, D]`` of the group's rows."""
        kvh, d = self.num_kv_heads, self.head_dim
        keys = _gather_blocks(kv_layer[0], g.flat_blocks).view(g.num, -1, kvh, d)[:, : g.max_len].transpose(1, 2)
        values = _gather_blocks(kv_layer[1], g.flat_blocks).view(g.num, -1, kvh, d)[:, : g.max_len].transpose(1, 2)
        qd = q if g.rows is None else q.index_select(0, g.rows)
        qd = qd.view(g.num, kvh, self.group, d)  # group heads as the query-length axis
        o = F.scaled_dot_product_attention(qd, keys, values, attn_mask=g.mask, scale=self.scale)
        return o.reshape(g.num, self.num_heads, d)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor,
                 s: _PrefillSeq) -> torch.Tensor:
        """Outputs ``[q_len, heads, D]`` of one sequence's chunk."""
        qs = q[s.start:s.end].transpose(0, 1).unsqueeze(0)  # [1, heads, L, D]
        if s.context == 0:
            ks = k[s.start:s.end].transpose(0, 1).unsqueeze(0)
            vs = v[s.start:s.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            shape = (-1, self.num_kv_heads, self.head_dim)
            ks = _gather_blocks(kv_layer[0], s.blocks).view(shape)[: s.seq_len].transpose(0, 1).unsqueeze(0)
            vs = _gather_blocks(kv_layer[1], s.blocks).view(shape)[: s.seq_len].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=s.mask, scale=self.scale, enable_gqa=True)
        return o[0].transpose(0, 1)

    def _flash(self, flash, q: torch.Tensor, kv_layer: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor:
        fn, _, uses_seqused_k = flash
        if uses_seqused_k:
            lens = dict(seqused_k=attn.seq_lens)
        else:
            cu_k = attn.cache.get("cu_seqlens_k")
            if cu_k is None:
                cu_k = attn.cache["cu_seqlens_k"] = F.pad(attn.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
            lens = dict(cu_seqlens_k=cu_k)
        out = fn(
            q, kv_layer[0], kv_layer[1],
            cu_seqlens_q=attn.query_start_loc, max_seqlen_q=attn.max_query_len, max_seqlen_k=attn.max_seq_len,
            softmax_scale=self.scale, causal=True,  # FA2 aligns the causal mask bottom-right
            block_table=attn.block_tables, **lens,
        )
        return out.reshape(q.shape[0], -1)
