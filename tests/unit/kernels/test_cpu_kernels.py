"""Compiled CPU kernels (worker/engine/kernels): decode and prefill attention equal
to gather + SDPA on random paged layouts, RMSNorm, SwiGLU and rotary equal to
torch's, the model with them equal to HF, bad inputs are errors, not crashes.  Skipped where the kernels
can't be built (no compiler/ninja)."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tests.support.model_factory import load_hf_model
from tests.unit.engine.test_model import ATOL, PagedSeqs, _tokens, hf_logits
from worker.engine.attention.backends.cpu_native import CpuNativeBackend
from worker.engine.kernels import load_cpu_kernels
from worker.engine.loading.loader import load_model

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="CPU kernels could not be built here")


def reference(q, k_cache, v_cache, tables, lens, scale):
    """Gather each row's blocks, mask past its length, SDPA with GQA."""
    b, h, d = q.shape
    kvh = k_cache.shape[2]
    s = int(lens.max())
    k = k_cache[tables.long()].reshape(b, -1, kvh, d)[:, :s].transpose(1, 2)
    v = v_cache[tables.long()].reshape(b, -1, kvh, d)[:, :s].transpose(1, 2)
    mask = (torch.arange(s)[None] < lens[:, None]).view(b, 1, 1, s)
    return F.scaled_dot_product_attention(q.view(b, kvh, h // kvh, d), k, v, attn_mask=mask,
                                          scale=scale).reshape(b, h, d)


@pytest.mark.parametrize("batch,max_len,kv_heads,group,head_dim,block", [
    (5, 70, 2, 2, 64, 16), (1, 1, 1, 1, 64, 16), (7, 300, 4, 3, 64, 16), (3, 37, 1, 4, 128, 8), (4, 33, 2, 1, 32, 4),
])
def test_matches_gather_and_sdpa(batch, max_len, kv_heads, group, head_dim, block):
    g = torch.Generator().manual_seed(batch * 1000 + max_len)
    per_seq = -(-max_len // block) + 1
    num_blocks = batch * per_seq + 3
    k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g)
    ids = list(range(num_blocks))
    random.Random(max_len).shuffle(ids)  # scattered, out-of-order blocks
    tables = torch.tensor([ids[i * per_seq:(i + 1) * per_seq] for i in range(batch)], dtype=torch.int32)
    lens = torch.randint(1, max_len + 1, (batch,), generator=g, dtype=torch.int32)
    lens[0] = max_len
    q = torch.randn(batch, kv_heads * group, head_dim, generator=g)
    scale = head_dim ** -0.5
    got = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, tables, lens, scale), atol=1e-5, rtol=1e-5)


def scattered_block_tables(per_seq: list[int], num_blocks: int, seed: int) -> torch.Tensor:
    """Block tables giving sequence i ``per_seq[i]`` distinct blocks, scattered and out of
    order over ``num_blocks`` (one spare column of zeros, as the engine pads)."""
    ids = list(range(num_blocks))
    random.Random(seed).shuffle(ids)
    tables = torch.zeros(len(per_seq), max(per_seq) + 1, dtype=torch.int32)
    at = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = torch.tensor(ids[at:at + n], dtype=torch.int32)
        at += n
    return tables


def prefill_reference(q, k_cache, v_cache, table, seq_len, scale):
    """One chunk of q_len queries after seq_len - q_len cached tokens: gather, SDPA
    with the lower-right causal mask."""
    q_len, h, d = q.shape
    kvh = k_cache.shape[2]
    k = k_cache[table.long()].reshape(-1, kvh, d)[:seq_len].transpose(0, 1)[None]
    v = v_cache[table.long()].reshape(-1, kvh, d)[:seq_len].transpose(0, 1)[None]
    mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("chunks,kv_heads,group,head_dim,block", [
    # (query_len, context_len) per sequence; query_len 1 = a decode row the call must leave alone
    ([(512, 0)], 2, 2, 64, 16),
    ([(37, 5), (1, 40), (100, 0), (2, 300)], 2, 2, 64, 16),  # several row blocks, a decode row between
    ([(61, 3000)], 1, 4, 64, 16),  # long context: the row block shrinks to fit the score buffer
    ([(20, 7), (33, 0)], 4, 1, 80, 8),  # head_dim not a multiple of the 16-column tile
    ([(9, 0), (16, 16)], 2, 3, 128, 4),
    ([(5, 11)], 1, 1, 32, 16),
])
def test_prefill_matches_gather_and_sdpa(chunks, kv_heads, group, head_dim, block):
    g = torch.Generator().manual_seed(sum(q + c for q, c in chunks) + head_dim)
    heads = kv_heads * group
    per_seq = [-(-(q + c) // block) for q, c in chunks]
    num_blocks = sum(per_seq) + 3
    k_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block, kv_heads, head_dim, generator=g)
    tables = scattered_block_tables(per_seq, num_blocks, seed=len(chunks))
    q_lens = [q for q, _ in chunks]
    total = sum(q_lens)
    qkv = torch.randn(total, heads + 2 * kv_heads, head_dim, generator=g)  # q: a strided view, as in the model
    q = qkv[:, :heads]
    seq_lens = torch.tensor([q + c for q, c in chunks], dtype=torch.int32)
    starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    prefills = [i for i, n in enumerate(q_lens) if n > 1]
    out = torch.full((total, heads, head_dim), 7.0)
    scale = head_dim ** -0.5
    kernels.paged_prefill_attention(q, k_cache, v_cache, tables, seq_lens, starts, torch.tensor(prefills),
                                    scale, out)
    for i, (q_len, ctx) in enumerate(chunks):
        rows = slice(int(starts[i]), int(starts[i + 1]))
        if i not in prefills:
            assert torch.all(out[rows] == 7.0)  # not asked for: untouched
            continue
        expected = prefill_reference(q[rows], k_cache, v_cache, tables[i], q_len + ctx, scale)
        torch.testing.assert_close(out[rows], expected, atol=2e-5, rtol=1e-5)


def test_prefill_bad_inputs_raise():
    k = torch.zeros(4, 16, 2, 64)
    q = torch.zeros(10, 4, 64)
    out = torch.empty_like(q)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([20, 5], dtype=torch.int32)
    starts = torch.tensor([0, 5, 10], dtype=torch.int32)
    seqs = torch.tensor([0, 1])
    call = kernels.paged_prefill_attention
    call(q, k, k, tables, lens, starts, seqs, 0.1, out)  # valid
    with pytest.raises(RuntimeError, match="block id out of range"):
        call(q, k, k, torch.tensor([[0, 9], [2, 3]], dtype=torch.int32), lens, starts, seqs, 0.1, out)
    with pytest.raises(RuntimeError, match="seq_len shorter than its query rows"):
        call(q, k, k, tables, torch.tensor([20, 4], dtype=torch.int32), starts, seqs, 0.1, out)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        call(q, k, k, tables, torch.tensor([33, 5], dtype=torch.int32), starts, seqs, 0.1, out)
    with pytest.raises(RuntimeError, match="sequence index out of range"):
        call(q, k, k, tables, lens, starts, torch.tensor([2]), 0.1, out)
    with pytest.raises(RuntimeError, match="query rows out of range"):
        call(q, k, k, tables, lens, torch.tensor([0, 5, 11], dtype=torch.int32), seqs, 0.1, out)
    with pytest.raises(RuntimeError, match="out must be"):
        call(q, k, k, tables, lens, starts, seqs, 0.1, torch.empty(10, 4, 32))
    with pytest.raises(RuntimeError, match="int64"):
        call(q, k, k, tables, lens, starts, seqs.int(), 0.1, out)


def test_silu_and_mul_matches_torch():
    from worker.engine.models.layers import silu_and_mul

    g = torch.Generator().manual_seed(3)
    for rows, inter in ((1, 8), (37, 96), (600, 768)):
        gate_up = torch.randn(rows, 2 * inter, generator=g) * 4
        torch.testing.assert_close(kernels.silu_and_mul(gate_up), silu_and_mul(gate_up), atol=1e-5, rtol=1e-5)
    extreme = torch.tensor([[-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0, 1e-3, 1.0] * 2])  # exp clamps: finite
    torch.testing.assert_close(kernels.silu_and_mul(extreme), silu_and_mul(extreme), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="gate_up must be"):
        kernels.silu_and_mul(torch.zeros(2, 3))


def test_rms_norm_matches_torch_and_adds_residual_in_place():
    from worker.engine.models.layers import RMSNorm

    g = torch.Generator().manual_seed(5)
    for rows, hidden in ((1, 8), (33, 256), (700, 100)):
        norm = RMSNorm(hidden, 1e-5, torch.float32, "cpu")
        norm.weight.data.normal_(generator=g)
        x = torch.randn(rows, hidden, generator=g) * 3
        residual = torch.randn(rows, hidden, generator=g)
        expected = norm(x.clone(), residual.clone())
        torch.testing.assert_close(kernels.rms_norm(x, norm.weight, 1e-5), norm(x), atol=1e-5, rtol=1e-5)
        norm.ops = kernels
        got, new_residual = norm(x, residual)
        assert new_residual is residual  # updated in place, as the torch path does
        torch.testing.assert_close(got, expected[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(residual, expected[1], atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.rms_norm(torch.zeros(2, 4), torch.zeros(3), 1e-5)
    with pytest.raises(RuntimeError, match="residual must be"):
        kernels.rms_norm(torch.zeros(2, 4), torch.zeros(4), 1e-5, torch.zeros(2, 5))


def test_rotary_in_place_matches_torch_on_strided_views():
    """q and k live inside the fused qkv output: rotate that strided view in place."""
    from worker.engine.models.rotary import apply_rotary, build_cos_sin_table, rotary_factors, rotation_table

    table = rotation_table(build_cos_sin_table(64, 10000.0, 512, {"rope_type": "llama3", "factor": 8.0,
                                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                   "original_max_position_embeddings": 128}))
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(50, (4 + 2 + 2) * 64, generator=g)
    positions = torch.randint(0, 512, (50,), generator=g)
    qk = qkv[:, : 6 * 64].view(50, 6, 64)
    expected = apply_rotary(qk, rotary_factors(table, positions, 6))
    v_before = qkv[:, 6 * 64:].clone()
    kernels.rotary_(qk, table, positions)
    torch.testing.assert_close(qk, expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, 6 * 64:], v_before)  # v untouched
    with pytest.raises(RuntimeError, match="position out of range"):
        kernels.rotary_(qk, table, torch.full((50,), 512))


def test_bad_inputs_raise():
    k = torch.zeros(4, 16, 2, 64)
    q = torch.zeros(2, 4, 64)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([20, 5], dtype=torch.int32)
    call = kernels.paged_decode_attention
    with pytest.raises(RuntimeError, match="block id out of range"):
        call(q, k, k, torch.tensor([[0, 9], [2, 3]], dtype=torch.int32), lens, 0.1)
    with pytest.raises(RuntimeError, match="seq_len out of range"):
        call(q, k, k, tables, torch.tensor([33, 5], dtype=torch.int32), 0.1)
    with pytest.raises(RuntimeError, match="float32"):
        call(q.double(), k, k, tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="head shapes"):
        call(torch.zeros(2, 3, 64), k, k, tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="int32"):
        call(q, k, k, tables.long(), lens, 0.1)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_model_with_native_decode_matches_hf(tiny_model, kind):
    """Decode-only steps, mixed steps and prefill chunks with and without cached
    context through the kernels equal HF."""
    path = tiny_model(kind)
    hf, model = load_hf_model(path), load_model(path)
    model.use_attention_backend(CpuNativeBackend(kernels))
    full = {name: _tokens(n, seed=i) for i, (name, n) in enumerate([("a", 45), ("b", 25), ("c", 12)])}
    refs = {name: hf_logits(hf, ids) for name, ids in full.items()}
    seqs = PagedSeqs(model)
    seqs.step([("a", full["a"][:30]), ("b", full["b"][:10])])
    for pos in range(10):  # decode-only steps of uneven lengths
        out = seqs.step([("a", [full["a"][30 + pos]]), ("b", [full["b"][10 + pos]])])
        torch.testing.assert_close(out[0][0], refs["a"][30 + pos], atol=ATOL, rtol=0)
        torch.testing.assert_close(out[1][0], refs["b"][10 + pos], atol=ATOL, rtol=0)
    # Mixed: a fresh prefill between two decode rows.
    out = seqs.step([("b", [full["b"][20]]), ("c", full["c"][:7]), ("a", [full["a"][40]])])
    torch.testing.assert_close(out[0][0], refs["b"][20], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], refs["c"][:7], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[2][0], refs["a"][40], atol=ATOL, rtol=0)
    # Prefill chunks after cached context (chunked prefill), beside a decode row.
    out = seqs.step([("c", full["c"][7:]), ("a", full["a"][41:45]), ("b", [full["b"][21]])])
    torch.testing.assert_close(out[0], refs["c"][7:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], refs["a"][41:45], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[2][0], refs["b"][21], atol=ATOL, rtol=0)


def test_stale_build_lock_is_cleared(tmp_path):
    """A build killed mid-way leaves torch's lock file; an old one must not block loads forever."""
    import os
    import time

    from worker.engine.kernels import STALE_LOCK_S, _clear_stale_lock

    fresh, stale = tmp_path / "fresh", tmp_path / "stale"
    fresh.touch()
    stale.touch()
    old = time.time() - STALE_LOCK_S - 5
    os.utime(stale, (old, old))
    _clear_stale_lock(fresh)
    _clear_stale_lock(stale)
    _clear_stale_lock(tmp_path / "absent")
    assert fresh.exists() and not stale.exists()


def test_engine_uses_native_decode_by_default_and_torch_on_request(llama_dir):
    from tests.support.engine_helpers import make_engine, random_prompts, request
    from worker.engine import EngineConfig

    prompts = random_prompts(6, 5, 40, seed=21)
    reqs = lambda: [request(str(i), p, max_tokens=12, ignore_eos=True) for i, p in enumerate(prompts)]  # noqa: E731
    native, plain = make_engine(llama_dir), make_engine(llama_dir, cpu_attention="torch")
    assert native.cpu_attention == "native" and plain.cpu_attention == "torch"
    assert native.model.layers[0].attn.backend.module is kernels and plain.model.layers[0].attn.backend.name == "torch"
    got, ref = native.generate(reqs()), plain.generate(reqs())
    assert {k: [d.token_ids for d in v] for k, v in got.items()} == {k: [d.token_ids for d in v] for k, v in ref.items()}
    with pytest.raises(ValueError, match="cpu_attention must be one of auto, native, torch"):
        EngineConfig(model=str(llama_dir), cpu_attention="fast")
    with pytest.raises(ValueError, match="cpu_attention=native needs dtype float32 or bfloat16"):
        make_engine(llama_dir, cpu_attention="native", dtype="float16")
