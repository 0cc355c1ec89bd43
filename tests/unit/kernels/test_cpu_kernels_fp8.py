"""The compiled attention kernels over an FP8 KV cache (``--kv-cache-dtype fp8`` /
``fp8_e5m2``), q and out in float32 or bfloat16, against torch references over the cache
converted to float (``cache.float()``, torch's own widening).

Tolerances: every FP8 value widens to float32 exactly and the math is then the float32
path's, so with float32 q the kernels equal themselves over a float32 cache holding
``cache.float()`` bit for bit, and the SDPA reference to the float32 tests' tolerance;
with bf16 q they are off the float32 reference by one bf16 rounding of the result (as
tests/unit/kernels/test_cpu_kernels_bf16.py)."""
from __future__ import annotations

import pytest
import torch

from tests.unit.kernels.test_cpu_kernels import prefill_reference, reference, scattered_block_tables
from worker.engine.kernels import load_cpu_kernels

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="CPU kernels could not be built here")

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
FP32 = dict(atol=2e-5, rtol=1e-5)
ONE_ROUNDING = dict(rtol=2 ** -8, atol=1e-6)


def _fp8_cache(*shape, fmt, g):
    """Random K or V in FP8, spread over the format's range (e5m2: wider than e4m3's max)."""
    x = torch.randn(*shape, generator=g) * 3
    limit = torch.finfo(fmt).max
    return x.clamp(-limit, limit).to(fmt)


def _every_finite_byte(fmt, n):
    """n FP8 values covering every finite encoding (subnormals, both zeros, the extremes)."""
    bits = torch.arange(256, dtype=torch.uint8)
    vals = bits.view(fmt)
    finite = bits[torch.isfinite(vals.float())]
    return finite.repeat(-(-n // len(finite)))[:n].view(fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kv_heads,head_dim", [(4, 64), (1, 255)])  # 255: a row ending in the scalar tail
def test_every_fp8_value_widens_exactly(fmt, kv_heads, head_dim):
    """One cached token with K = 0: every query head's output is its KV head's V row
    (weight exactly 1), so decode and prefill return the widened values themselves."""
    n = kv_heads * head_dim
    v = _every_finite_byte(fmt, n).view(1, 1, kv_heads, head_dim)
    k = torch.zeros(1, 1, kv_heads, head_dim).to(fmt)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    want = v.float()[0, 0].repeat_interleave(2, 0)  # 2 query heads per KV head
    q = torch.randn(1, 2 * kv_heads, head_dim)
    got = kernels.paged_decode_attention(q, k, v, table, lens, 0.1)
    assert torch.equal(got[0], want)
    out = torch.empty(1, 2 * kv_heads, head_dim)
    kernels.paged_prefill_attention(q, k, v, table, lens, torch.tensor([0, 1], dtype=torch.int32),
                                    torch.tensor([0]), 0.1, out)
    assert torch.equal(out[0], want)


def _decode_case(fmt, q_dtype, batch, max_len, kv_heads, group, head_dim, block):
    g = torch.Generator().manual_seed(batch * 1000 + max_len + head_dim)
    per_seq = -(-max_len // block) + 1
    num_blocks = batch * per_seq + 3
    k_cache = _fp8_cache(num_blocks, block, kv_heads, head_dim, fmt=fmt, g=g)
    v_cache = _fp8_cache(num_blocks, block, kv_heads, head_dim, fmt=fmt, g=g)
    tables = scattered_block_tables([per_seq] * batch, num_blocks, seed=max_len)
    lens = torch.randint(1, max_len + 1, (batch,), generator=g, dtype=torch.int32)
    lens[0] = max_len
    q = torch.randn(batch, kv_heads * group, head_dim, generator=g).to(q_dtype)
    return q, k_cache, v_cache, tables, lens, head_dim ** -0.5


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,max_len,kv_heads,group,head_dim,block", [
    (5, 70, 2, 2, 64, 16), (1, 1, 1, 1, 64, 16), (7, 300, 4, 3, 64, 16), (3, 37, 1, 4, 128, 8),
    (4, 33, 2, 1, 36, 4),  # a K/V row (72 values) off the 8-wide widening
])
def test_decode_over_fp8_matches_reference(fmt, q_dtype, batch, max_len, kv_heads, group, head_dim, block):
    q, k, v, tables, lens, scale = _decode_case(fmt, q_dtype, batch, max_len, kv_heads, group, head_dim, block)
    got = kernels.paged_decode_attention(q, k, v, tables, lens, scale)
    assert got.dtype == q_dtype
    ref = reference(q.float(), k.float(), v.float(), tables, lens, scale)
    if q_dtype == torch.float32:
        torch.testing.assert_close(got, ref, **FP32)
        # the float32 kernel over the widened cache: the same arithmetic, bit for bit
        assert torch.equal(got, kernels.paged_decode_attention(q, k.float(), v.float(), tables, lens, scale))
    else:
        torch.testing.assert_close(got.float(), ref, **ONE_ROUNDING)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunks,kv_heads,group,head_dim,block", [
    # (query_len, context_len) per sequence; query_len 1 = a decode row the call must leave alone
    ([(512, 0)], 2, 2, 64, 16),
    ([(37, 5), (1, 40), (100, 0), (2, 300)], 2, 2, 64, 16),  # fresh and after cached context, a decode row between
    ([(20, 7), (33, 0)], 4, 1, 36, 8),  # head_dim off the 8-wide widening and the 16-column tile
    ([(9, 0), (16, 16)], 2, 3, 128, 4),
])
def test_prefill_over_fp8_matches_reference(fmt, q_dtype, chunks, kv_heads, group, head_dim, block):
    g = torch.Generator().manual_seed(sum(q + c for q, c in chunks) + head_dim)
    heads = kv_heads * group
    per_seq = [-(-(q + c) // block) for q, c in chunks]
    num_blocks = sum(per_seq) + 3
    k = _fp8_cache(num_blocks, block, kv_heads, head_dim, fmt=fmt, g=g)
    v = _fp8_cache(num_blocks, block, kv_heads, head_dim, fmt=fmt, g=g)
    tables = scattered_block_tables(per_seq, num_blocks, seed=len(chunks))
    q_lens = [q for q, _ in chunks]
    total = sum(q_lens)
    q = torch.randn(total, heads + 2 * kv_heads, head_dim, generator=g).to(q_dtype)[:, :heads]  # strided, as in the model
    seq_lens = torch.tensor([q + c for q, c in chunks], dtype=torch.int32)
    starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    prefills = torch.tensor([i for i, n in enumerate(q_lens) if n > 1])
    scale = head_dim ** -0.5

    def run(k_cache, v_cache):
        out = torch.full((total, heads, head_dim), 7.0, dtype=q_dtype)
        kernels.paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, starts, prefills, scale, out)
        return out

    out = run(k, v)
    if q_dtype == torch.float32:
        assert torch.equal(out, run(k.float(), v.float()))
    for i, (q_len, ctx) in enumerate(chunks):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        if q_len == 1:
            assert torch.all(out[rows] == 7.0)  # not asked for: untouched
            continue
        expected = prefill_reference(q[rows].float(), k.float(), v.float(), tables[i], q_len + ctx, scale)
        torch.testing.assert_close(out[rows].float(), expected, **(FP32 if q_dtype == torch.float32 else ONE_ROUNDING))


def test_wrong_dtype_combinations_are_errors():
    q = torch.zeros(2, 4, 64)
    k8 = torch.zeros(4, 16, 2, 64).to(torch.float8_e4m3fn)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([20, 5], dtype=torch.int32)
    decode = kernels.paged_decode_attention
    decode(q, k8, k8, tables, lens, 0.1)  # valid
    decode(q.bfloat16(), k8, k8, tables, lens, 0.1)  # valid
    with pytest.raises(RuntimeError, match="tensors of one dtype"):
        decode(q, k8, k8.to(torch.float8_e5m2), tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="tensors of one dtype"):
        decode(q, k8, k8.float(), tables, lens, 0.1)
    with pytest.raises(RuntimeError, match=r"q's dtype .* or FP8"):
        decode(q, k8.half(), k8.half(), tables, lens, 0.1)
    with pytest.raises(RuntimeError, match=r"q's dtype .* or FP8"):
        fnuz = torch.zeros(4, 16, 2, 64).to(torch.float8_e4m3fnuz)
        decode(q, fnuz, fnuz, tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="q must be float32 or bfloat16"):
        decode(q.to(torch.float8_e4m3fn), k8, k8, tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="block id out of range"):
        decode(q, k8, k8, torch.tensor([[0, 9], [2, 3]], dtype=torch.int32), lens, 0.1)
    with pytest.raises(RuntimeError, match="head shapes"):
        decode(torch.zeros(2, 3, 64), k8, k8, tables, lens, 0.1)

    prefill = kernels.paged_prefill_attention
    qp = torch.zeros(10, 4, 64)
    starts, seqs = torch.tensor([0, 5, 10], dtype=torch.int32), torch.tensor([0, 1])
    prefill(qp, k8, k8, tables, lens, starts, seqs, 0.1, torch.empty_like(qp))  # valid
    with pytest.raises(RuntimeError, match="out must be"):  # out holds q's dtype, never the cache's
        prefill(qp, k8, k8, tables, lens, starts, seqs, 0.1, torch.empty(10, 4, 64).to(torch.float8_e4m3fn))
    with pytest.raises(RuntimeError, match=r"q's dtype .* or FP8"):
        prefill(qp, k8.bfloat16(), k8.bfloat16(), tables, lens, starts, seqs, 0.1, torch.empty_like(qp))
    with pytest.raises(RuntimeError, match="block id out of range"):
        prefill(qp, k8, k8, torch.tensor([[0, 9], [2, 3]], dtype=torch.int32), lens, starts, seqs, 0.1,
                torch.empty_like(qp))
