"""The Triton kernels on a real GPU against the same torch references as the
interpreted checks (skipped without one)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_unified_attention_on_gpu(dtype):
    from tests.support.triton_interpreted_kernels import CASES, TOL, _paged_batch, reference_attention
    from worker.engine.kernels.triton import ops

    for q_lens, ctx, hq, hkv, d, bs, _, window in CASES:
        q, kc, vc, qsl, sl, bt = _paged_batch(q_lens, ctx, hq, hkv, d, bs, dtype, seed=7)
        dev = [x.cuda() for x in (q, kc, vc, qsl, sl, bt)]
        out = torch.empty(q.shape, dtype=dtype, device="cuda")
        ops().unified_attention(dev[0], dev[1], dev[2], out, query_start_loc=dev[3], seq_lens=dev[4],
                                block_tables=dev[5], scale=d ** -0.5, sliding_window=window,
                                max_query_len=max(q_lens))
        ref = reference_attention(q, kc, vc, qsl, sl, bt, d ** -0.5, window)
        tol = TOL[dtype] if dtype != torch.float32 else 1e-4  # no TF32: fp32 dots are IEEE
        assert (out.cpu().float() - ref).abs().max() < tol


def test_elementwise_on_gpu():
    from worker.engine.kernels.triton import ops
    from worker.engine.models.layers import silu_and_mul
    from worker.engine.models.rotary import apply_rotary, build_cos_sin_table, rotary_factors, rotation_table

    x = torch.randn(33, 2 * 700, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(ops().silu_and_mul(x).float(), silu_and_mul(x.float()), rtol=4e-2, atol=3e-2)
    h, r, w = (torch.randn(17, 512, device="cuda") for _ in range(3))
    res = r.clone()
    out = ops().rms_norm(h, w[0], 1e-6, res)
    torch.testing.assert_close(res, h + r)
    torch.testing.assert_close(out, torch.nn.functional.rms_norm(h + r, (512,), w[0], 1e-6), rtol=1e-5, atol=1e-5)
    table = rotation_table(build_cos_sin_table(128, 1e6, 4096, None)).cuda()
    qk = torch.randn(9, 12, 128, device="cuda")
    pos = torch.randint(0, 4096, (9,), device="cuda")
    expected = apply_rotary(qk.clone(), rotary_factors(table, pos, 12))
    ops().rotary_(qk, table, pos)
    torch.testing.assert_close(qk, expected, rtol=1e-5, atol=1e-5)


def test_grammar_bitmask_on_gpu():
    from worker.engine.kernels.triton import ops
    from worker.engine.structured_output.bitmask import apply_bitmask_torch_

    for vocab in (320, 151_936):
        gen = torch.Generator().manual_seed(vocab)
        logits = torch.randn(9, vocab, generator=gen)
        bitmask = torch.randint(-2**31, 2**31 - 1, (4, (vocab + 31) // 32), generator=gen,
                                dtype=torch.int64).to(torch.int32)
        indices = torch.tensor([8, 0, 3, 5])
        want = logits.clone()
        apply_bitmask_torch_(want, bitmask, indices)
        got = logits.cuda()
        ops().apply_bitmask_(got, bitmask.cuda(), indices.cuda())
        assert torch.equal(got.cpu(), want)
