"""The CPU int4 GEMM (worker/engine/kernels/int4_gemm.cpp) against the dequantized
weight's matmul: symmetric and asymmetric groups, channel-wise, N not a multiple of the
block, every row count from decode to prefill (every tile shape: 1x8, 2x4, 4x2 and their tails), bf16
and fp32 activations, bias; and a row's result does not depend on the rows beside it.

The bound: the kernel computes, per group, ``s * (sum x * q - z * sum x)`` in fp32 (q, z
exact small integers), then sums the groups in fp32, so against the exact (float64)
``x @ dequant(W).T`` it is off by at most the fp32 rounding of those sums:
``(group + G + 4) * 2^-24 * sum_k |x_k| * s_k * (q_k + z_k)`` (each term's magnitude
bounded by ``s (q + z) |x|``; Higham's n*u bound per sum), plus the bias's rounding."""
from __future__ import annotations

import pytest
import torch

from worker.engine.kernels import load_cpu_kernels
from worker.engine.quantization.int4_cpu import dequantized, int4_linear, pack_int4, unpack_int4

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not hasattr(kernels, "int4_linear"),
                                reason="compiled CPU kernels unavailable")


def _weight(n, k, group, sym, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    zeros = torch.full_like(scales, 8.0) if sym else torch.randint(0, 16, scales.shape, generator=g).float()
    dense = (q.float() - zeros.repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)
    return q, scales, zeros, dense


@pytest.mark.parametrize("n,k,group,sym", [(64, 128, 32, True), (72, 256, 128, False), (13, 64, 64, False),
                                           (256, 512, 128, True), (200, 256, 64, False), (24, 4096, 128, False)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17, 64])
def test_matches_dequantized_matmul(n, k, group, sym, rows):
    q, scales, zeros, dense = _weight(n, k, group, sym)
    w = pack_int4(q, scales, zeros, group)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n)
    got = int4_linear(x, w, bias, kernels)
    want = x.double() @ dense.double().t() + bias.double()
    mag = (q.double() + zeros.repeat_interleave(group, 1).double()) * scales.repeat_interleave(group, 1).double()
    bound = (group + k // group + 4) * 2.0 ** -24 * (x.double().abs() @ mag.t()) + 2.0 ** -24 * bias.double().abs()
    assert ((got.double() - want).abs() <= bound).all(), float(((got.double() - want).abs() / bound).max())


def test_unpack_and_dequantized_give_the_checkpoint_back():
    q, scales, zeros, dense = _weight(72, 256, 64, False)
    w = pack_int4(q, scales, zeros, 64)
    assert torch.equal(unpack_int4(w), q.to(torch.int32))
    assert torch.equal(dequantized(w, torch.float32), dense)


def test_bf16_activations_give_bf16():
    q, scales, zeros, dense = _weight(64, 128, 32, True)
    w = pack_int4(q, scales, zeros, 32)
    x = torch.randn(5, 128).to(torch.bfloat16)
    got = int4_linear(x, w, None, kernels)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), (x.float() @ dense.t()), atol=2e-2, rtol=2e-2)


def test_rows_are_batch_invariant():
    q, scales, zeros, _ = _weight(96, 256, 64, False)
    w = pack_int4(q, scales, zeros, 64)
    x = torch.randn(11, 256)
    together = int4_linear(x, w, None, kernels)
    for i in range(11):
        assert torch.equal(int4_linear(x[i:i + 1], w, None, kernels)[0], together[i])


def test_packing_is_a_quarter_of_bf16():
    q, scales, zeros, _ = _weight(4096, 4096, 128, True)
    w = pack_int4(q, scales, zeros, 128)
    assert w.packed.numel() * 4 == 4096 * 4096 // 2  # half a byte per weight
    assert w.nbytes() < 4096 * 4096 * 2 * 0.3  # scales and zeros included


def test_bad_shapes_are_refused():
    q, scales, zeros, _ = _weight(16, 64, 32, True)
    with pytest.raises(ValueError, match="needs scales/zeros"):
        pack_int4(q, scales[:, :1], zeros, 32)
    with pytest.raises(ValueError, match="unsigned"):
        pack_int4(q + 16, scales, zeros, 32)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(q, torch.ones(16, 16), torch.ones(16, 16), 4)
