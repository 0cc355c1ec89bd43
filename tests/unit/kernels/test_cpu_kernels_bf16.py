"""The compiled CPU kernels in bfloat16 storage (float32 math) against float32 torch
references computed on the same bf16-rounded inputs.

Tolerances: a kernel that widens its bf16 inputs exactly, computes in float32 and
rounds once on store is off the float32 reference by at most half a bf16 ulp of the
result (2^-9 relative) plus float32 summation-order noise; ``rtol=2^-8`` allows for
that and nothing more.  RMSNorm and SwiGLU round twice, as HF does in bf16 (the
normalised row before the weight multiply, silu(gate) before the product), so they are
compared with torch's own bf16 ops, to one bf16 ulp (2^-7 relative; SwiGLU two, see
TWO_ULPS)."""
from __future__ import annotations

import random

import pytest
import torch

from tests.unit.kernels.test_cpu_kernels import prefill_reference, reference, scattered_block_tables
from worker.engine.kernels import load_cpu_kernels

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="CPU kernels could not be built here")

ONE_ROUNDING = dict(rtol=2 ** -8, atol=1e-6)
ONE_ULP = dict(rtol=2 ** -7, atol=1e-6)
# silu(gate) is rounded to bf16 before the product: where the two float32 silus (ours:
# g / (1 + e^-g) with a polynomial exp; torch's) straddle a rounding boundary the
# rounded values are one ulp apart, and the product's own rounding adds one more.
TWO_ULPS = dict(rtol=2 ** -6, atol=1e-6)


def _bf16(*shape, g, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


@pytest.mark.parametrize("batch,max_len,kv_heads,group,head_dim,block", [
    (5, 70, 2, 2, 64, 16), (1, 1, 1, 1, 64, 16), (7, 300, 4, 3, 128, 16), (4, 33, 2, 1, 32, 4),
    (3, 37, 1, 4, 80, 8),  # head_dim off the 32-wide bf16 dot-product path
])
def test_decode_bf16_matches_fp32_reference(batch, max_len, kv_heads, group, head_dim, block):
    g = torch.Generator().manual_seed(batch * 1000 + max_len)
    per_seq = -(-max_len // block) + 1
    num_blocks = batch * per_seq + 3
    k_cache = _bf16(num_blocks, block, kv_heads, head_dim, g=g)
    v_cache = _bf16(num_blocks, block, kv_heads, head_dim, g=g)
    ids = list(range(num_blocks))
    random.Random(max_len).shuffle(ids)
    tables = torch.tensor([ids[i * per_seq:(i + 1) * per_seq] for i in range(batch)], dtype=torch.int32)
    lens = torch.randint(1, max_len + 1, (batch,), generator=g, dtype=torch.int32)
    lens[0] = max_len
    q = _bf16(batch, kv_heads * group, head_dim, g=g)
    scale = head_dim ** -0.5
    got = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    assert got.dtype == torch.bfloat16
    ref = reference(q.float(), k_cache.float(), v_cache.float(), tables, lens, scale)
    torch.testing.assert_close(got.float(), ref, **ONE_ROUNDING)


@pytest.mark.parametrize("chunks,kv_heads,group,head_dim,block", [
    ([(512, 0)], 2, 2, 64, 16),
    ([(37, 5), (1, 40), (100, 0), (2, 300)], 2, 2, 64, 16),
    ([(20, 7), (33, 0)], 4, 1, 80, 8),
    ([(9, 0), (16, 16)], 2, 3, 128, 4),
])
def test_prefill_bf16_matches_fp32_reference(chunks, kv_heads, group, head_dim, block):
    g = torch.Generator().manual_seed(sum(q + c for q, c in chunks) + head_dim)
    heads = kv_heads * group
    per_seq = [-(-(q + c) // block) for q, c in chunks]
    num_blocks = sum(per_seq) + 3
    k_cache = _bf16(num_blocks, block, kv_heads, head_dim, g=g)
    v_cache = _bf16(num_blocks, block, kv_heads, head_dim, g=g)
    tables = scattered_block_tables(per_seq, num_blocks, seed=len(chunks))
    q_lens = [q for q, _ in chunks]
    total = sum(q_lens)
    qkv = _bf16(total, heads + 2 * kv_heads, head_dim, g=g)
    q = qkv[:, :heads]
    seq_lens = torch.tensor([q + c for q, c in chunks], dtype=torch.int32)
    starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    prefills = [i for i, n in enumerate(q_lens) if n > 1]
    out = torch.full((total, heads, head_dim), 7.0, dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    kernels.paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, starts, torch.tensor(prefills), scale, out)
    for i, (q_len, ctx) in enumerate(chunks):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        if i not in prefills:
            assert torch.all(out[rows] == 7.0)
            continue
        expected = prefill_reference(q[rows].float(), k_cache.float(), v_cache.float(), tables[i], q_len + ctx, scale)
        torch.testing.assert_close(out[rows].float(), expected, **ONE_ROUNDING)


def test_mixed_dtypes_are_refused():
    k = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    q = torch.zeros(2, 4, 64)  # float32 q over a bf16 cache
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="q's dtype"):
        kernels.paged_decode_attention(q, k, k, tables, torch.tensor([20, 5], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="of x's dtype"):
        kernels.rms_norm(torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(4), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.silu_and_mul(torch.zeros(2, 4, dtype=torch.float16))


def test_silu_and_mul_bf16_matches_torch_bf16():
    from worker.engine.models.layers import silu_and_mul

    g = torch.Generator().manual_seed(3)
    for rows, inter in ((1, 8), (37, 96), (600, 768), (3, 100)):
        gate_up = _bf16(rows, 2 * inter, g=g, scale=4)
        got = kernels.silu_and_mul(gate_up)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), silu_and_mul(gate_up).float(), **TWO_ULPS)


def test_rms_norm_bf16_matches_torch_bf16_and_adds_residual_in_place():
    from worker.engine.models.layers import RMSNorm

    g = torch.Generator().manual_seed(5)
    for rows, hidden in ((1, 8), (33, 256), (700, 100)):
        norm = RMSNorm(hidden, 1e-5, torch.bfloat16, "cpu")
        norm.weight.data.copy_(torch.randn(hidden, generator=g))
        x = _bf16(rows, hidden, g=g, scale=3)
        residual = _bf16(rows, hidden, g=g)
        expected = norm(x.clone(), residual.clone())  # torch's ops, HF's roundings
        torch.testing.assert_close(kernels.rms_norm(x, norm.weight, 1e-5).float(), norm(x).float(), **ONE_ULP)
        norm.ops = kernels
        got, new_residual = norm(x, residual)
        assert new_residual is residual
        torch.testing.assert_close(got.float(), expected[0].float(), **ONE_ULP)
        assert torch.equal(residual, expected[1])  # one bf16 add each: identical


def test_rotary_bf16_matches_fp32_reference_on_strided_views():
    from worker.engine.models.rotary import apply_rotary, build_cos_sin_table, rotary_factors, rotation_table

    table = rotation_table(build_cos_sin_table(64, 10000.0, 512, None)).bfloat16()
    g = torch.Generator().manual_seed(4)
    qkv = _bf16(50, (4 + 2 + 2) * 64, g=g)
    positions = torch.randint(0, 512, (50,), generator=g)
    qk = qkv[:, : 6 * 64].view(50, 6, 64)
    expected = apply_rotary(qk.float(), rotary_factors(table.float(), positions, 6))
    v_before = qkv[:, 6 * 64:].clone()
    kernels.rotary_(qk, table, positions)
    torch.testing.assert_close(qk.float(), expected, **ONE_ROUNDING)
    assert torch.equal(qkv[:, 6 * 64:], v_before)
