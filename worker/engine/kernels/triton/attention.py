"""Paged attention for every row of a step in one launch (vLLM's Triton "unified
attention" design).

Program (q-block b, KV head h) takes up to BLOCK_Q consecutive query tokens of one
sequence together with the G query heads that share KV head h, so each K/V tile is
read once for BLOCK_Q * G rows (GQA without copies).  Q-blocks are numbered per
sequence with one spare each (``q_start // BLOCK_Q + seq``), so the grid,
``T // BLOCK_Q + B`` programs, depends on host-known shapes only and a program finds
its sequence by binary search over ``query_start_loc``: the launch is captured in
CUDA graphs and replays with each row's real length.  Keys are walked in tiles of
TILE_N positions, each key's page looked up in the block table, so any block size
works.  Causal (lower-right: a chunk after ``context`` cached tokens) and sliding
windows are masks on positions; tiles wholly outside them are skipped.  Online
softmax in fp32.  Attention sinks (GPT-OSS: a learned logit per query head in every
softmax denominator, with no value) start each row's running max at the sink and its
running sum at 1 (= exp(sink - max)); the split decode path adds them once, when its
segments are combined.
"""
from __future__ import annotations

from typing import Optional

import os

import torch
import triton
import triton.language as tl


# Triton's interpreter multiplies bf16 dot operands wrongly (numpy has no bf16), so
# under it the dots run on fp32 copies; compiled kernels keep bf16/fp16 tensor-core dots.
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _find_seq(query_start_loc, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(q, m_i, l_i, acc, tile, table, k_cache, v_cache, seq_len, q_pos, row_ok, kv_head, scale, window,
                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                 HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                 USE_WINDOW: tl.constexpr, IEEE: tl.constexpr):
    """One online-softmax step over the keys of tile ``tile`` (TILE_N positions, each
    key's page looked up in the block table) for rows at positions ``q_pos``:
    returns the updated (row max, row sum, unnormalised output)."""
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_DIM
    k_pos = tile * TILE_N + offs_n
    k_ok = k_pos < seq_len
    page = tl.load(table + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
    slot_in_page = k_pos % BLOCK_SIZE
    # An FP8 cache (--kv-cache-dtype, scale 1.0) is converted to q's dtype as it is loaded;
    # a cache in q's dtype passes unchanged (the conversion is a no-op).
    k = tl.load(k_cache + page[None, :] * stride_kb + slot_in_page[None, :] * stride_ks
                + kv_head * stride_kh + offs_d[:, None], mask=k_ok[None, :] & d_ok[:, None],
                other=0.0).to(q.dtype)  # [D, N]
    v = tl.load(v_cache + page[:, None] * stride_vb + slot_in_page[:, None] * stride_vs
                + kv_head * stride_vh + offs_d[None, :], mask=k_ok[:, None] & d_ok[None, :],
                other=0.0).to(q.dtype)  # [N, D]
    if IEEE:
        s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, k)
    s = s * scale
    visible = row_ok[:, None] & k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
    if USE_WINDOW:
        visible = visible & (q_pos[:, None] - k_pos[None, :] < window)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _unified_attention_kernel(
    q_ptr, k_cache, v_cache, out_ptr, query_start_loc, seq_lens, block_tables, sinks_ptr,
    scale, num_seqs, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, IEEE: tl.constexpr,  # IEEE: fp32 dots (no TF32 rounding)
    USE_SINKS: tl.constexpr,  # sinks_ptr: [Hq] sink logits (any float dtype); unused otherwise
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens + seq)
    context = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    q_idx = local * BLOCK_Q + offs_m // G  # query token within the sequence
    head = kv_head * G + offs_m % G
    row_ok = (offs_m < BLOCK_Q * G) & (q_idx < q_len)
    d_ok = offs_d < HEAD_DIM
    q_pos = context + q_idx  # its position: it sees keys 0..q_pos
    token = q_start + q_idx
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:  # the sink is the softmax's first term: max = sink, sum = exp(0)
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)

    last_pos = context + tl.minimum(local * BLOCK_Q + BLOCK_Q, q_len) - 1
    end_tile = last_pos // TILE_N + 1
    start_tile = 0
    if USE_WINDOW:
        start_tile = tl.maximum(context + local * BLOCK_Q - window + 1, 0) // TILE_N
    table = block_tables + seq * stride_bt
    for tile in range(start_tile, end_tile):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, tile, table, k_cache, v_cache, seq_len, q_pos, row_ok,
                                     kv_head, scale, window, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                     stride_vh, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, USE_WINDOW, IEEE)

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache, v_cache, m_buf, l_buf, acc_buf, query_start_loc, seq_lens, block_tables,
    scale, window,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    USE_WINDOW: tl.constexpr, IEEE: tl.constexpr,
):
    """Decode rows only: program (sequence, KV head, segment) attends over one
    segment of the sequence's key tiles and stores its partial softmax state (row
    max, row sum, unnormalised output); ``_combine_kernel`` merges the segments.  A
    lone long sequence then spreads over NUM_SEGMENTS programs per KV head instead
    of one.  The segment bounds come from ``seq_lens`` on the device (graph-safe)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    token = tl.load(query_start_loc + seq)
    seq_len = tl.load(seq_lens + seq)
    q_pos = seq_len - 1
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    head = kv_head * G + offs_m
    row_ok = offs_m < G
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + token * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    first_tile = 0
    if USE_WINDOW:
        first_tile = tl.maximum(q_pos - window + 1, 0) // TILE_N
    num_tiles = q_pos // TILE_N + 1 - first_tile
    per_segment = (num_tiles + NUM_SEGMENTS - 1) // NUM_SEGMENTS
    start_tile = first_tile + segment * per_segment
    end_tile = tl.minimum(start_tile + per_segment, first_tile + num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    table = block_tables + seq * stride_bt
    q_pos_rows = tl.zeros([BLOCK_M], tl.int32) + q_pos
    for tile in range(start_tile, end_tile):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, tile, table, k_cache, v_cache, seq_len, q_pos_rows, row_ok,
                                     kv_head, scale, window, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                     stride_vh, HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, USE_WINDOW, IEEE)

    # Partial state at [seq, head, segment]: buffers are [B, Hq, NUM_SEGMENTS(, HEAD_PAD)].
    row = (seq * (tl.num_programs(1) * G) + head) * NUM_SEGMENTS + segment
    tl.store(m_buf + row, m_i, mask=row_ok)
    tl.store(l_buf + row, l_i, mask=row_ok)
    tl.store(acc_buf + row[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _combine_kernel(m_buf, l_buf, acc_buf, out_ptr, query_start_loc, sinks_ptr, stride_ot, stride_oh, num_heads,
                    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
                    USE_SINKS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_PAD)
    base = (seq * num_heads + head) * NUM_SEGMENTS
    m = tl.load(m_buf + base + offs_s)
    l = tl.load(l_buf + base + offs_s)
    acc = tl.load(acc_buf + (base + offs_s)[:, None] * HEAD_PAD + offs_d[None, :])
    m_max = tl.max(m, 0)
    denominator_extra = 0.0
    if USE_SINKS:  # the head's sink joins the merged denominator once
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_max = tl.maximum(m_max, sink)
        denominator_extra = tl.exp(sink - m_max)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))  # empty segments weigh nothing
    out = tl.sum(acc * w[:, None], 0) / (tl.sum(l * w, 0) + denominator_extra)
    token = tl.load(query_start_loc + seq)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


# Decode batches with fewer (sequence, KV head) pairs than this split each sequence's
# keys into segments: below it the 2-D grid leaves most of a large GPU idle.
SPLIT_KV_BELOW = 128
# Under the interpreter every program costs milliseconds of Python: fewer segments keep
# the CPU tests quick while still merging several.
NUM_SEGMENTS = 4 if _INTERPRETING else 16


def launch_config(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                  max_query_len: Optional[int]) -> dict:
    """Tile sizes: 16 query rows per program (tl.dot's minimum), more when a group
    is larger; key tiles of 32 positions for prefill-like steps, 16 for decode."""
    g = num_heads // num_kv_heads
    block_m = 16 if g <= 16 else triton.next_power_of_2(g)
    block_q = max(block_m // g, 1)
    tile_n = 16 if max_query_len == 1 else 32
    head_pad = max(triton.next_power_of_2(head_dim), 16)
    return dict(G=g, HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_SIZE=block_size, BLOCK_M=block_m,
                BLOCK_Q=block_q, TILE_N=tile_n)


def unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, *,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float, sliding_window: Optional[int] = None,
                      max_query_len: Optional[int] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of every query row of a step over its sequence's paged K/V.

    q ``[T, Hq, D]`` (last dim contiguous; a strided view of a fused projection is
    fine), k/v_cache ``[num_blocks, block_size, Hkv, D]``, out ``[T, Hq, D]``;
    query_start_loc ``[B+1]``, seq_lens ``[B]`` and block_tables ``[B, W]`` int32;
    sinks ``[Hq]``: per-head sink logits joining every softmax denominator (GPT-OSS).
    """
    t, hq, d = q.shape
    num_blocks, block_size, hkv, _ = k_cache.shape
    if q.stride(2) != 1 or out.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("unified_attention needs the head dimension contiguous")
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not share {hkv} KV heads evenly")
    num_seqs = seq_lens.shape[0]
    window = int(sliding_window or 0)
    ieee = q.dtype == torch.float32 or _INTERPRETING
    if max_query_len == 1 and t == num_seqs and num_seqs * hkv < SPLIT_KV_BELOW:
        return _decode_split(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale, window, ieee,
                             sinks)
    cfg = launch_config(hq, hkv, d, block_size, max_query_len)
    grid = (t // cfg["BLOCK_Q"] + num_seqs, hkv)
    _unified_attention_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, q if sinks is None else sinks,
        float(scale), num_seqs, window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        USE_WINDOW=window > 0, IEEE=ieee, USE_SINKS=sinks is not None, **cfg)
    return out


def _split_config(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> dict:
    g = num_heads // num_kv_heads
    return dict(G=g, HEAD_DIM=head_dim, HEAD_PAD=max(triton.next_power_of_2(head_dim), 16), BLOCK_SIZE=block_size,
                BLOCK_M=max(16, triton.next_power_of_2(g)), TILE_N=16, NUM_SEGMENTS=NUM_SEGMENTS)


def _decode_split(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale, window, ieee, sinks=None):
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    cfg = _split_config(hq, hkv, d, k_cache.shape[1])
    b = seq_lens.shape[0]
    m_buf = torch.empty(b * hq * NUM_SEGMENTS, dtype=torch.float32, device=q.device)
    l_buf = torch.empty_like(m_buf)
    acc_buf = torch.empty(b * hq * NUM_SEGMENTS * cfg["HEAD_PAD"], dtype=torch.float32, device=q.device)
    _decode_split_kernel[(b, hkv, NUM_SEGMENTS)](
        q, k_cache, v_cache, m_buf, l_buf, acc_buf, query_start_loc, seq_lens, block_tables,
        float(scale), window, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        USE_WINDOW=window > 0, IEEE=ieee, **cfg)
    _combine_kernel[(b, hq)](m_buf, l_buf, acc_buf, out, query_start_loc, m_buf if sinks is None else sinks,
                             out.stride(0), out.stride(1), hq, HEAD_DIM=d, HEAD_PAD=cfg["HEAD_PAD"],
                             NUM_SEGMENTS=NUM_SEGMENTS, USE_SINKS=sinks is not None)
    return out


def compile_specs() -> list:
    specs = []
    # The last entries: GPT-OSS's shape (head_dim 64, GQA 8) with sinks, sliding and full layers.
    for dtype, head_dim, block_size, g, window, kv, sinks in (
            ("bf16", 128, 16, 4, False, "bf16", False), ("fp16", 64, 32, 8, True, "fp16", False),
            ("fp32", 80, 16, 1, False, "fp32", False), ("bf16", 64, 1, 2, True, "bf16", False),
            ("bf16", 128, 16, 4, True, "fp8e4nv", False), ("fp16", 64, 16, 8, False, "fp8e5", False),
            ("bf16", 64, 16, 8, True, "bf16", True), ("bf16", 64, 16, 8, False, "bf16", True)):
        cfg = launch_config(g * 2, 2, head_dim, block_size, None)
        sig = {"q_ptr": f"*{dtype}", "k_cache": f"*{kv}", "v_cache": f"*{kv}", "out_ptr": f"*{dtype}",
               "query_start_loc": "*i32", "seq_lens": "*i32", "block_tables": "*i32", "sinks_ptr": f"*{dtype}",
               "scale": "fp32", "num_seqs": "i32", "window": "i32"}
        for name in ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb", "stride_ks", "stride_kh",
                     "stride_vb", "stride_vs", "stride_vh", "stride_bt"):
            sig[name] = "i64"
        const = dict(cfg, USE_WINDOW=window, IEEE=dtype == "fp32", USE_SINKS=sinks)
        kv_name = "" if kv == dtype else f",kv={kv}"
        sink_name = ",sinks" if sinks else ""
        specs.append((f"unified_attention[{dtype},D={head_dim},bs={block_size},G={g},window={window}{kv_name}"
                      f"{sink_name}]", _unified_attention_kernel, sig, const))
    for dtype, head_dim, block_size, g, window, kv, sinks in (("bf16", 128, 16, 4, False, "bf16", False),
                                                              ("fp32", 80, 1, 8, True, "fp32", False),
                                                              ("bf16", 128, 16, 4, False, "fp8e4nv", False),
                                                              ("bf16", 64, 16, 8, True, "bf16", True)):
        cfg = _split_config(g * 2, 2, head_dim, block_size)
        sig = {"q_ptr": f"*{dtype}", "k_cache": f"*{kv}", "v_cache": f"*{kv}", "m_buf": "*fp32",
               "l_buf": "*fp32", "acc_buf": "*fp32", "query_start_loc": "*i32", "seq_lens": "*i32",
               "block_tables": "*i32", "scale": "fp32", "window": "i32"}
        for name in ("stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs",
                     "stride_vh", "stride_bt"):
            sig[name] = "i64"
        kv_name = "" if kv == dtype else f",kv={kv}"
        specs.append((f"decode_split[{dtype},D={head_dim},bs={block_size},G={g},window={window}{kv_name}]",
                      _decode_split_kernel, sig, dict(cfg, USE_WINDOW=window, IEEE=dtype == "fp32")))
        if kv != dtype:
            continue  # the combine kernel reads fp32 partials only: the variant above has it already
        specs.append((f"decode_combine[{dtype},D={head_dim}{',sinks' if sinks else ''}]", _combine_kernel,
                      {"m_buf": "*fp32", "l_buf": "*fp32", "acc_buf": "*fp32", "out_ptr": f"*{dtype}",
                       "query_start_loc": "*i32", "sinks_ptr": f"*{dtype}", "stride_ot": "i64", "stride_oh": "i64",
                       "num_heads": "i32"},
                      dict(HEAD_DIM=head_dim, HEAD_PAD=cfg["HEAD_PAD"], NUM_SEGMENTS=NUM_SEGMENTS, USE_SINKS=sinks)))
    return specs
