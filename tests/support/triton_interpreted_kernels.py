"""The Triton kernels against plain torch references, on CPU tensors under Triton's
interpreter.  Run by tests/integration/test_triton_interpreted.py in a subprocess with
TRITON_INTERPRET=1 (it must be set before the kernels are decorated)."""
from __future__ import annotations

import os
import random

import pytest
import torch

from worker.engine.models.layers import silu_and_mul as torch_silu_and_mul
from worker.engine.models.rotary import apply_rotary, build_cos_sin_table, rotary_factors, rotation_table

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")

TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _ops():
    from worker.engine.kernels.triton import ops

    return ops()


def reference_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, window=None,
                        sinks=None):
    """Per sequence: gather its blocks, lower-right causal (and windowed) softmax in fp32;
    ``sinks [Hq]``: a sink logit column joins each head's softmax and is dropped after
    (transformers' GPT-OSS eager attention)."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    block_size, hkv, d = k_cache.shape[1:]
    g = q.shape[1] // hkv
    for i in range(len(seq_lens)):
        s, e, n = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(seq_lens[i])
        blocks = block_tables[i, : -(-n // block_size)].long()
        k = k_cache[blocks].reshape(-1, hkv, d)[:n].float().repeat_interleave(g, 1)
        v = v_cache[blocks].reshape(-1, hkv, d)[:n].float().repeat_interleave(g, 1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), k) * scale
        qpos = torch.arange(n - (e - s), n)[:, None]
        kpos = torch.arange(n)[None, :]
        visible = kpos <= qpos
        if window:
            visible &= qpos - kpos < window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            column = sinks.float().view(-1, 1, 1).expand(-1, e - s, 1)
            probs = torch.cat((scores, column), dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def _paged_batch(q_lens, ctx_lens, hq, hkv, d, block_size, dtype, seed):
    """Caches with shuffled block ids, ragged rows, q a strided view of a fused qkv."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 3
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables = torch.zeros(len(q_lens), max(need) + 2, dtype=torch.int32)  # padded wider than needed
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    t = sum(q_lens)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k_cache, v_cache, qsl, torch.tensor(seq_lens, dtype=torch.int32), tables


CASES = [
    # (q_lens, context lens, heads, kv heads, head_dim, block_size, dtype, window)
    ([1, 9, 1, 20], [11, 0, 40, 6], 4, 4, 64, 16, torch.float32, None),  # mixed: decode + prefill with context
    ([1, 1, 1], [5, 70, 33], 8, 2, 128, 16, torch.bfloat16, None),  # decode-only, GQA 4
    ([13, 1, 7], [0, 29, 3], 16, 2, 64, 32, torch.float32, None),  # GQA 8
    ([17, 1], [0, 0], 4, 1, 80, 16, torch.float16, None),  # fresh prefill, head_dim 80 (padded)
    ([6, 1, 12], [30, 44, 9], 8, 2, 64, 16, torch.float32, 8),  # sliding window
    ([5, 1], [20, 3], 4, 2, 64, 16, torch.bfloat16, 6),  # sliding window, bf16
    ([3, 1], [9, 14], 2, 2, 64, 1, torch.float32, None),  # block size 1
    ([4, 1], [300, 10], 4, 2, 64, 256, torch.float32, None),  # block size 256
    # Decode-only batches of few (sequence, KV head) pairs take the split-KV path: keys in
    # segments, partial softmax states merged by a second kernel.
    ([1], [700], 8, 1, 64, 16, torch.float32, None),  # one long sequence: every segment busy
    ([1, 1], [3, 250], 16, 2, 128, 1, torch.bfloat16, None),  # block size 1, a segment-less short row
    ([1, 1, 1], [90, 40, 7], 8, 2, 64, 16, torch.float32, 20),  # window: early segments empty
    ([1] * 64, [5 + 3 * i for i in range(64)], 4, 2, 64, 16, torch.float32, None),  # 128 pairs: the 2-D grid
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"q{c[0]}-hq{c[2]}-hkv{c[3]}-d{c[4]}-bs{c[5]}-{c[6]}-w{c[7]}")
def test_unified_attention_matches_reference(case):
    q_lens, ctx, hq, hkv, d, bs, dtype, window = case
    q, kc, vc, qsl, sl, bt = _paged_batch(q_lens, ctx, hq, hkv, d, bs, dtype, seed=len(q_lens) + d + bs)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    _ops().unified_attention(q, kc, vc, out, query_start_loc=qsl, seq_lens=sl, block_tables=bt, scale=d ** -0.5,
                             sliding_window=window, max_query_len=max(q_lens))
    ref = reference_attention(q, kc, vc, qsl, sl, bt, d ** -0.5, window)
    err = (out.float() - ref).abs().max().item()
    assert err < TOL[dtype], err


SINK_CASES = [
    ([1, 9, 1, 20], [11, 0, 40, 6], 4, 4, 64, 16, torch.float32, None),  # mixed, fresh prefill
    ([6, 1, 12], [30, 44, 9], 16, 2, 64, 16, torch.float32, 8),  # GQA 8 (GPT-OSS's), sliding window
    ([5, 1], [20, 3], 8, 2, 64, 16, torch.bfloat16, 6),  # bf16, window
    ([1], [700], 8, 1, 64, 16, torch.float32, None),  # split-KV decode: the sink joins the combine once
    ([1, 1, 1], [90, 40, 7], 8, 2, 64, 16, torch.float32, 20),  # split decode, early segments empty
    ([1, 1], [3, 250], 16, 2, 64, 16, torch.bfloat16, None),  # split decode, bf16 sinks
]


@pytest.mark.parametrize("case", SINK_CASES, ids=lambda c: f"q{c[0]}-hq{c[2]}-hkv{c[3]}-{c[6]}-w{c[7]}")
def test_unified_attention_with_sinks_matches_reference(case):
    """GPT-OSS's attention sinks: a per-head logit in every softmax denominator."""
    q_lens, ctx, hq, hkv, d, bs, dtype, window = case
    q, kc, vc, qsl, sl, bt = _paged_batch(q_lens, ctx, hq, hkv, d, bs, dtype, seed=len(q_lens) + d + 7)
    # Around the rows' logits, so the sink takes a real share (some rows mostly sink).
    sinks = (2.0 * torch.randn(hq, generator=torch.Generator().manual_seed(1)) + 1.0).to(dtype)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    _ops().unified_attention(q, kc, vc, out, query_start_loc=qsl, seq_lens=sl, block_tables=bt, scale=d ** -0.5,
                             sliding_window=window, max_query_len=max(q_lens), sinks=sinks)
    ref = reference_attention(q, kc, vc, qsl, sl, bt, d ** -0.5, window, sinks)
    err = (out.float() - ref).abs().max().item()
    assert err < TOL[dtype], err
    # ... and without them the rows would differ: the sinks are really applied.
    assert (reference_attention(q, kc, vc, qsl, sl, bt, d ** -0.5, window) - ref).abs().max() > 10 * TOL[dtype]


def test_decode_paths_agree():
    """The split-KV and the 2-D decode kernels give the same rows."""
    from worker.engine.kernels.triton import attention

    q, kc, vc, qsl, sl, bt = _paged_batch([1, 1, 1], [300, 41, 128], 8, 2, 64, 16, torch.float32, seed=4)
    outs = []
    for below in (10 ** 9, 0):  # force split, then force 2-D
        attention.SPLIT_KV_BELOW = below
        out = torch.empty(q.shape)
        _ops().unified_attention(q, kc, vc, out, query_start_loc=qsl, seq_lens=sl, block_tables=bt, scale=0.125,
                                 max_query_len=1)
        outs.append(out)
    attention.SPLIT_KV_BELOW = 128
    assert (outs[0] - outs[1]).abs().max() < 1e-5


def test_reference_sees_a_wrong_window():
    """The tolerance is tight enough that a window off by one is caught."""
    q, kc, vc, qsl, sl, bt = _paged_batch([6, 1], [30, 44], 4, 2, 64, 16, torch.float32, seed=3)
    out = torch.empty(q.shape)
    _ops().unified_attention(q, kc, vc, out, query_start_loc=qsl, seq_lens=sl, block_tables=bt, scale=0.125,
                             sliding_window=8)
    assert (out - reference_attention(q, kc, vc, qsl, sl, bt, 0.125, 8)).abs().max() < 2e-5
    assert (out - reference_attention(q, kc, vc, qsl, sl, bt, 0.125, 9)).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_writes_slots_and_skips_padding(dtype):
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(7, 2 * 3 * 80, generator=g).to(dtype)  # strided views of a fused projection
    k, v = kv[:, :240].view(7, 3, 80), kv[:, 240:].view(7, 3, 80)
    kc = torch.zeros(5, 4, 3, 80, dtype=dtype)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([3, 17, -1, 0, 9, -1, 19])
    _ops().reshape_and_cache(k, v, kc, vc, slots)
    flat_k, flat_v = kc.view(-1, 3, 80), vc.view(-1, 3, 80)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat_k[s], k[t]) and torch.equal(flat_v[s], v[t])
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [i for i in range(20) if i not in written]
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_reshape_and_cache_into_fp8_saturates(fp8):
    """--kv-cache-dtype fp8: values rounded to FP8 (scale 1.0), out-of-range ones saturated."""
    g = torch.Generator().manual_seed(1)
    k = torch.randn(5, 2, 32, generator=g).to(torch.bfloat16) * 4
    v = torch.randn(5, 2, 32, generator=g).to(torch.bfloat16) * 4
    k[0, 0, 0], v[1, 1, 3] = 1e4, -1e5  # beyond e4m3's 448 (and e5m2's 57344)
    kc = torch.zeros(3, 4, 2, 32, dtype=fp8)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([2, 5, -1, 11, 0])
    _ops().reshape_and_cache(k, v, kc, vc, slots)
    limit = torch.finfo(fp8).max
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            for x, c in ((k, kc), (v, vc)):
                want = x[t].float().clamp(-limit, limit).to(fp8)
                assert torch.equal(c.view(-1, 2, 32)[s].float(), want.float())
    assert torch.isfinite(kc.float()).all() and torch.isfinite(vc.float()).all()


@pytest.mark.parametrize("case", [([7, 1, 1], [0, 40, 9], 8, 2, 64, 16, None), ([5], [20], 4, 4, 32, 4, 8)])
def test_unified_attention_over_fp8_caches(case):
    """The attention kernels read an FP8 cache converted to q's dtype: equal to the
    reference over the dequantized cache (prefill, decode and the split-KV decode)."""
    q_lens, ctx, hq, hkv, d, bs, window = case
    q, kc, vc, qsl, sl, bt = _paged_batch(q_lens, ctx, hq, hkv, d, bs, torch.float32, seed=7)
    kc8, vc8 = (c.mul(3).clamp(-448, 448).to(torch.float8_e4m3fn) for c in (kc, vc))
    out = torch.full(q.shape, float("nan"))
    _ops().unified_attention(q, kc8, vc8, out, query_start_loc=qsl, seq_lens=sl, block_tables=bt, scale=d ** -0.5,
                             sliding_window=window, max_query_len=max(q_lens))
    ref = reference_attention(q, kc8.float(), vc8.float(), qsl, sl, bt, d ** -0.5, window)
    assert (out - ref).abs().max().item() < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_residual(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 100, generator=g).to(dtype)
    r = torch.randn(9, 100, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(100, generator=g)).to(dtype)

    def ref(h):  # transformers' LlamaRMSNorm
        hf = h.float()
        return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)

    tol = dict(rtol=TOL[dtype], atol=TOL[dtype])  # bf16: a rounding step apart at most
    torch.testing.assert_close(_ops().rms_norm(x, w, 1e-6).float(), ref(x).float(), **tol)
    res = r.clone()
    out = _ops().rms_norm(x, w, 1e-6, res)
    # Residual updated in place, in the model dtype (the interpreter rounds bf16 by
    # truncation, a GPU to nearest: one ulp apart at most).
    if dtype == torch.float32:
        assert torch.equal(res, x + r)
    else:
        torch.testing.assert_close(res.float(), (x + r).float(), rtol=1 / 64, atol=1e-2)
    torch.testing.assert_close(out.float(), ref(x + r).float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_strided_view(dtype):
    d, heads, kv_heads, t = 64, 4, 2, 6
    table = rotation_table(build_cos_sin_table(d, 10000.0, 512, None)).to(dtype)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=torch.Generator().manual_seed(2)).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * d].view(t, heads + kv_heads, d)
    untouched = qkv[:, (heads + kv_heads) * d:].clone()
    positions = torch.tensor([0, 1, 17, 200, 511, 3])
    expected = apply_rotary(qk.float(), rotary_factors(table.float(), positions, heads + kv_heads))
    _ops().rotary_(qk, table, positions)
    assert (qk.float() - expected).abs().max() < TOL[dtype]
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], untouched)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype):
    x = (torch.randn(5, 2 * 1500, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    got = _ops().silu_and_mul(x)
    assert got.shape == (5, 1500)
    # bf16 rounds silu's output and the product: two rounding steps of relative error.
    torch.testing.assert_close(got.float(), torch_silu_and_mul(x.float()), rtol=2 * TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (37, 8, 2), (20, 16, 1), (5, 4, 4)])
def test_fused_experts_matches_grouped_torch(dtype, tokens, experts, top_k):
    """The Triton grouped GEMMs (gather by sorted pair, weighted second GEMM, sum over
    k) equal the per-expert torch path, experts with no token included."""
    from worker.engine.kernels.triton.fused_moe import fused_experts
    from worker.engine.models.moe import fused_experts_torch, select_experts

    g = torch.Generator().manual_seed(tokens * 7 + experts)
    hidden, inter = 48, 40  # not powers of two: masked K and N tails
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.1).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, -1] = -1e4  # the last expert never routed: an empty group
    weights, ids = select_experts(logits, top_k, renormalize=True)
    got = fused_experts(x, w13, w2, weights, ids, _ops().silu_and_mul)
    ref = fused_experts_torch(x.float(), w13.float(), w2.float(), weights, ids)
    tol = TOL[dtype] * (1 if dtype == torch.float32 else 4)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    assert (got.float() - ref).abs().max() < tol * max(1.0, ref.abs().max().item())


def test_align_by_expert_pads_each_expert_run():
    from worker.engine.kernels.triton.fused_moe import align_by_expert

    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])
    sorted_ids, block_expert, num_padded = align_by_expert(ids, 5, 4)
    pairs = ids.numel()
    used = int(num_padded)
    assert used == 12  # experts 0, 1, 3 each padded to one block of 4
    runs = sorted_ids[:used].view(-1, 4)
    assert block_expert[:3].tolist() == [0, 1, 3]
    flat = ids.reshape(-1)
    for b, expert in enumerate(block_expert[:3].tolist()):
        real = [p for p in runs[b].tolist() if p < pairs]
        assert real and all(int(flat[p]) == expert for p in real)
    assert sorted(p for p in sorted_ids.tolist() if p < pairs) == list(range(pairs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_sgmv_matches_torch(dtype):
    """Shrink + per-sub-module expand of the segmented kernels == the CPU grouped path,
    for interleaved rows of three slots and rows of none."""
    import numpy as np

    from worker.engine.lora.batch import LoRABatch
    from worker.engine.lora.weights import LoRAGroup

    g = torch.Generator().manual_seed(0)
    slots, rank, k, outs = 3, 8, 40, (24, 8, 8)
    group = LoRAGroup(("q_proj", "k_proj", "v_proj"), ((0, 24), (24, 32), (32, 40)),
                      (0.3 * torch.randn(slots, 3 * rank, k, generator=g)).to(dtype),
                      (0.3 * torch.randn(slots, sum(outs), rank, generator=g)).to(dtype), rank)
    token_slots = np.array([2, 2, -1, 0, 1, 1, 1, -1, 0, 2] + [1] * 19, dtype=np.int64)
    x = torch.randn(len(token_slots), k, generator=g).to(dtype)
    y0 = torch.randn(len(token_slots), sum(outs), generator=g).to(dtype)
    want, got = y0.clone(), y0.clone()
    LoRABatch.build(token_slots, torch.device("cpu"), use_triton=False).apply(x, want, group)
    LoRABatch.build(token_slots, torch.device("cpu"), use_triton=True).apply(x, got, group)
    base_rows = token_slots < 0
    assert torch.equal(got[base_rows], y0[base_rows])
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype] * 4, rtol=TOL[dtype])


def test_lora_static_batch_for_graphs_matches_torch():
    """The CUDA-graph batch (fixed buffers, a segment per slot, empty ones included,
    padding rows) refilled for two different steps == the CPU grouped path, for a
    projection group and the input embedding's gather."""
    import numpy as np

    from worker.engine.lora.batch import LoRABatch
    from worker.engine.lora.weights import EmbeddingLoRA, LoRAGroup

    g = torch.Generator().manual_seed(1)
    slots, rank, k, vocab, bs = 4, 8, 32, 50, 12
    group = LoRAGroup(("gate_proj", "up_proj"), ((0, 20), (20, 40)), 0.3 * torch.randn(slots, 2 * rank, k, generator=g),
                      0.3 * torch.randn(slots, 40, rank, generator=g), rank)
    emb = EmbeddingLoRA(0.3 * torch.randn(slots, vocab, rank, generator=g),
                        0.3 * torch.randn(slots, k, rank, generator=g), rank)
    static = LoRABatch.static(bs, slots, torch.device("cpu"))
    for step in (np.array([3, -1, 0, 3, 3, -1, 0], dtype=np.int64), np.array([1] * 9 + [-1, 2], dtype=np.int64)):
        x = torch.randn(bs, k, generator=g)
        ids = torch.randint(0, vocab, (bs,), generator=g)
        want_y, want_h = torch.randn(bs, 40, generator=g), torch.randn(bs, k, generator=g)
        got_y, got_h = want_y.clone(), want_h.clone()
        n = len(step)
        eager = LoRABatch.build(step, torch.device("cpu"), use_triton=False)
        eager.apply(x[:n], want_y[:n], group)
        eager.apply_embedding(ids[:n], want_h[:n], emb)
        static.fill(step)
        static.apply(x, got_y, group)
        static.apply_embedding(ids, got_h, emb)
        torch.testing.assert_close(got_y, want_y, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_h, want_h, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype,head_dim,lens", [
    (torch.float32, 80, [7, 0, 130, 64, 1]),   # padded head dim, an empty sequence, > one q-block and key tile
    (torch.bfloat16, 64, [16, 49]),
    (torch.float16, 32, [200]),
])
def test_varlen_attention_matches_per_sequence_sdpa(dtype, head_dim, lens):
    """The vision towers' attention: each packed sequence attends within itself, non-causal;
    q/k/v are strided views of one fused QKV projection, as the tower passes them."""
    torch.manual_seed(sum(lens))
    heads = 3
    total = sum(lens)
    qkv = torch.randn(total, 3, heads, head_dim).to(dtype)
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    scale = head_dim ** -0.5
    got = _ops().varlen_attention(q, k, v, cu, scale)
    ref = torch.zeros(total, heads, head_dim)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b > a:
            qs, ks, vs = (t[a:b].float().transpose(0, 1) for t in (q, k, v))
            ref[a:b] = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(0, 1)
    assert got.shape == q.shape and got.dtype == dtype
    assert (got.float() - ref).abs().max() < TOL[dtype] * 4
    # a wrong boundary is caught: the same tokens as one sequence differ
    if len(lens) > 1:
        merged = _ops().varlen_attention(q, k, v, torch.tensor([0, total], dtype=torch.int32), scale)
        assert (merged.float() - ref).abs().max() > 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [320, 5000, 4096 * 2 + 7])
def test_apply_bitmask_matches_torch(dtype, vocab):
    """The grammar bitmask kernel (structured outputs) against the torch op it replaces on CUDA."""
    from worker.engine.structured_output.bitmask import apply_bitmask_torch_

    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen).to(dtype)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[1] = 0  # a row allowing nothing but what the next word allows
    bitmask[1, -1] = -1
    indices = torch.tensor([3, 0, 4])
    want = logits.clone()
    apply_bitmask_torch_(want, bitmask, indices)
    got = logits.clone()
    _ops().apply_bitmask_(got, bitmask, indices)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 2]], logits[[1, 2]])


# --- quantized GEMMs (kernels/triton/quant_gemm.py) ---------------------------------------
def _qg():
    from worker.engine.kernels.triton import quant_gemm

    return quant_gemm


@pytest.mark.parametrize("group", [None, 32])
def test_quantize_fp8_rows(group):
    x = torch.randn(5, 96) * 3
    q, s = _qg().quantize_fp8_rows(x, group)
    g = group or 128
    assert s.shape == (5, -(-96 // g))
    for i in range(5):
        for j in range(s.shape[1]):
            chunk = x[i, j * g:(j + 1) * g]
            assert s[i, j].item() == pytest.approx(chunk.abs().max().item() / 448.0, rel=1e-6)
            want = (chunk / s[i, j]).clamp(-448, 448).to(torch.float8_e4m3fn)
            assert torch.equal(q[i, j * g:(j + 1) * g].float(), want.float())


@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
@pytest.mark.parametrize("m", [1, 7, 33])
def test_fp8_linear_matches_dequantized_reference(kind, m):
    torch.manual_seed(0)
    n, k = 96, 256  # 96 = 3 weight blocks of 32 rows; the GEMM's 64-column tiles straddle them
    w = torch.randn(n, k) * 0.05
    if kind == "block":
        block = (32, 128)
        wb = w.reshape(n // 32, 32, k // 128, 128)
        ws = wb.abs().amax((1, 3)) / 448.0
        wq = (wb / ws[:, None, :, None]).reshape(n, k).to(torch.float8_e4m3fn)
        w_deq = (wq.float().reshape(n // 32, 32, k // 128, 128) * ws[:, None, :, None]).reshape(n, k)
    else:
        block = None
        ws = w.abs().amax(1) / 448.0 if kind == "channel" else w.abs().max().reshape(1) / 448.0
        wq = (w / (ws[:, None] if kind == "channel" else ws)).to(torch.float8_e4m3fn)
        w_deq = wq.float() * (ws[:, None] if kind == "channel" else ws)
    x = torch.randn(m, k)
    bias = torch.randn(n)
    got = _qg().fp8_linear(x, wq, ws, block=block, bias=bias)
    xq, xs = _qg().quantize_fp8_rows(x, block[1] if block else None)
    x_deq = (xq.float().reshape(m, -1, block[1]) * xs[:, :, None]).reshape(m, k) if block else xq.float() * xs
    want = x_deq @ w_deq.t() + bias
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # and close to the unquantized product (FP8's rounding only)
    assert (got - (x @ w.t() + bias)).abs().max() < 0.1 * (x @ w.t()).abs().max()


@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("m", [1, 20])
def test_int4_linear_matches_dequantized_matmul(zeros, m):
    g = torch.Generator().manual_seed(1)
    n, k, group = 72, 256, 64
    q = torch.randint(0, 16, (n, k), generator=g)
    words = torch.zeros(n, k // 8, dtype=torch.int64)
    for i in range(8):
        words |= q[:, i::8].to(torch.int64) << (4 * i)
    qweight = ((words + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)
    scales = torch.rand(n, k // group, generator=g) * 0.02
    z = torch.randint(0, 16, (n, k // group), generator=g).to(torch.int32) if zeros else None
    zf = z.float() if zeros else torch.full((n, k // group), 8.0)
    w = (q.float() - zf.repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    got = _qg().int4_linear(x, qweight, scales, z, group, bias)
    torch.testing.assert_close(got, x @ w.t() + bias, atol=1e-4, rtol=1e-4)


def test_online_fp8_triton_scheme_is_the_emulated_w8a8():
    """--quantization fp8 on CUDA: weights kept in FP8, the Triton W8A8 GEMM; equal to the
    CPU emulation (FP8-rounded weights and per-token activations) and the head left dense."""
    from worker.engine.quantization.online_fp8 import Fp8Weight, round_rows, triton_fp8_scheme

    scheme = triton_fp8_scheme()
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 64, generator=g) * 0.1
    x = torch.randn(9, 64, generator=g)
    packed = scheme.pack(w)
    assert isinstance(packed, Fp8Weight) and packed.q.dtype == torch.float8_e4m3fn
    got = scheme.linear(x, packed, None)
    torch.testing.assert_close(got, round_rows(x) @ round_rows(w).t(), atol=1e-4, rtol=1e-4)
    assert torch.equal(scheme.unpack(packed), round_rows(w))
    assert scheme.head_scheme.name == "torch"


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                               (torch.bfloat16, torch.float8_e4m3fn),
                                               (torch.float32, torch.float8_e5m2)])
@pytest.mark.parametrize("heads,rank,rope,block_size,lens", [
    (4, 32, 8, 4, [1, 9, 70]),  # the tiny models' dims: heads, rank and rope below the tile widths
    (20, 64, 16, 16, [33, 5]),  # heads past one 16-head program
])
def test_mla_decode_matches_torch_absorbed(dtype, cache_dtype, heads, rank, rope, block_size, lens):
    """The latent decode kernel (kernels/triton/mla_decode.py) against the torch absorbed
    form over the same paged latent cache (in q's dtype or FP8): shuffled blocks, lengths
    crossing tiles."""
    g = torch.Generator().manual_seed(11)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    cache = torch.randn(num_blocks, block_size, rank + rope, generator=g).to(cache_dtype or dtype)
    free = list(range(num_blocks))
    random.Random(3).shuffle(free)
    width = max(-(-n // block_size) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for b, n in enumerate(lens):
        for j in range(-(-n // block_size)):
            tables[b, j] = free.pop()
    q_lat = torch.randn(len(lens), heads, rank, generator=g).to(dtype)
    q_pe = torch.randn(len(lens), heads, rope, generator=g).to(dtype)
    scale = (rank + rope) ** -0.5
    got = _ops().mla_decode(q_lat, q_pe, cache, tables, torch.tensor(lens, dtype=torch.int32), scale)
    for b, n in enumerate(lens):
        lat = cache.float()[tables[b].long()].reshape(-1, rank + rope)[:n]
        scores = (q_lat[b].float() @ lat[:, :rank].t() + q_pe[b].float() @ lat[:, rank:].t()) * scale
        want = scores.softmax(-1) @ lat[:, :rank]
        torch.testing.assert_close(got[b].float(), want, atol=TOL[dtype], rtol=TOL[dtype])
