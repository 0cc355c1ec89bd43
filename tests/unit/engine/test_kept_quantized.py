"""The kept-quantized scheme's bookkeeping (quantization/kept.py), on CPU without the
kernels: the checkpoint's integers recovered exactly from the dense weights of fused
parameters (parts aligned to whole FP8 blocks or not, int4 with zero points), dense
layers left dense, re-quantization after an RL update, and CPU's default for FP8
(dequantized at load).  The GEMMs themselves run in tests/support/triton_interpreted_quant.py."""
from __future__ import annotations

import torch

from tests.support import quantized_factory as qf
from tests.support.engine_helpers import make_engine
from worker.engine.quantization.config import CheckpointQuantization, WeightScheme
from worker.engine.quantization.kept import Fp8BlockWeight, Int4Weight, KeptQuantized, keeps_quantized
from worker.engine.quantization.kept_forms import pack_nibbles, unpack_kept
from worker.engine.quantization.dequant import dequant_float, unpack_int32
from worker.engine.quantization.online_fp8 import Fp8Weight


class _Model:
    """What ``bind`` reads: checkpoint name -> the view of the fused parameter, and the
    tensor-parallel slices (none: one rank)."""

    def __init__(self, param, parts):
        self.param, self.parts = param, parts

    def weight_targets(self):
        out, row = {}, 0
        for name, rows in self.parts:
            out[name + ".weight"] = self.param.data[row:row + rows]
            row += rows
        return out

    def weight_slices(self):
        return {}


def _fp8_part(rows, cols, block, gen):
    w = torch.randn(rows, cols, generator=gen)
    r, c = block
    s = torch.rand(-(-rows // r), cols // c, generator=gen) + 0.01
    q = (w / s.repeat_interleave(r, 0)[:rows].repeat_interleave(c, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s


def _bind(kept, parts_tensors, dtype):
    """Fill a fused parameter from the parts' dense weights (as the loader does) and bind."""
    scheme = WeightScheme("fp8", 8, "block", block=kept.quant.default.block)
    dense = [dequant_float(q, s, scheme).to(dtype) for q, s in parts_tensors.values()]
    param = torch.nn.Parameter(torch.cat(dense), requires_grad=False)
    for name, (q, s) in parts_tensors.items():
        kept.keep(name, scheme, {"weight": q, "scale": s, "weight_scale_inv": s})
    kept.bind(_Model(param, [(n, q.shape[0]) for n, (q, _) in parts_tensors.items()]))
    return param


def test_fp8_blocks_fused_exactly_aligned_or_not():
    gen = torch.Generator().manual_seed(0)
    for block, rows, layout in (((32, 32), (64, 32, 32), (32, 32)), ((64, 32), (64, 32, 32), (1, 32))):
        quant = CheckpointQuantization("fp8", WeightScheme("fp8", 8, "block", block=block))
        kept = KeptQuantized(quant)
        parts = {f"l.{p}_proj": _fp8_part(n, 64, block, gen) for p, n in zip("qkv", rows)}
        param = _bind(kept, parts, torch.bfloat16)
        packed = kept.scheme().pack(param)
        assert isinstance(packed, Fp8BlockWeight) and packed.block == layout
        # the checkpoint's FP8 bytes, bit for bit, though the dense copy was bf16
        want = torch.cat([q for q, _ in parts.values()])
        assert torch.equal(packed.q.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(unpack_kept(packed), param)


def test_int4_recovered_exactly_and_requantized_after_an_update():
    gen = torch.Generator().manual_seed(1)
    n, k, group = 48, 64, 32
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // group, generator=gen) * 0.1 + 0.01
    zero = torch.randint(0, 16, (n, k // group), generator=gen)
    dense = ((q - zero.repeat_interleave(group, 1)) * scale.repeat_interleave(group, 1)).bfloat16()
    param = torch.nn.Parameter(dense.clone(), requires_grad=False)
    kept = KeptQuantized(CheckpointQuantization("compressed-tensors", None))
    scheme = WeightScheme("packed", 4, "group", group_size=group, symmetric=False)
    kept.keep("l.down_proj", scheme, {"weight_packed": pack_nibbles(q), "weight_scale": scale,
                                      "weight_shape": torch.tensor([n, k]), "weight_zero_point": zero - 8})
    kept.bind(_Model(param, [("l.down_proj", n)]))
    packs = kept.scheme()
    packed = packs.pack(param)
    assert isinstance(packed, Int4Weight)
    assert torch.equal(unpack_int32(packed.qweight, 4, k, dim=1), q.to(torch.int32))
    assert torch.equal(packed.zero.long(), zero)
    # an update: unpack, write new weights in place, pack -> quantized afresh from them
    fresh = packs.unpack(packed)
    new = torch.randn(n, k, generator=gen).bfloat16()
    fresh.copy_(new)
    again = packs.pack(fresh)
    assert isinstance(again, Int4Weight)
    err = (unpack_kept(again).float() - new.float()).abs()
    assert (err <= again.scale.repeat_interleave(group, 1) / 2 + 1e-2).all()  # round to nearest


def test_act_order_int4_kept_in_group_order_and_uneven_groups_dense():
    """compressed-tensors ``weight_g_idx`` (act-order): the kept weight holds its columns in
    group order and ``perm`` says which; unpacking puts them back, equal to the reader's
    own dequantization with ``g_idx``.  Groups of uneven size cannot be made contiguous:
    that layer stays dense, with the reason."""
    from worker.engine.quantization.dequant import dequant_packed

    gen = torch.Generator().manual_seed(3)
    n, k, group = 16, 64, 16
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // group, generator=gen) * 0.1 + 0.01
    zero = torch.randint(0, 16, (n, k // group), generator=gen)
    g_idx = (torch.randperm(k, generator=gen) // group).to(torch.int32)  # column -> group, any order
    scheme = WeightScheme("packed", 4, "group", group_size=group, symmetric=False)
    parts = {"weight_packed": pack_nibbles(q), "weight_scale": scale, "weight_shape": torch.tensor([n, k]),
             "weight_zero_point": zero - 8, "weight_g_idx": g_idx}
    dense = dequant_packed(parts["weight_packed"], scale, (n, k), scheme, zero - 8, g_idx)
    param = torch.nn.Parameter(dense.clone(), requires_grad=False)
    kept = KeptQuantized(CheckpointQuantization("compressed-tensors", None))
    kept.keep("l.down_proj", scheme, parts)
    kept.bind(_Model(param, [("l.down_proj", n)]))
    packed = kept.scheme().pack(param)
    assert isinstance(packed, Int4Weight) and packed.perm is not None
    assert torch.equal(g_idx.long()[packed.perm.long()], torch.arange(k) // group)
    assert torch.equal(unpack_kept(packed), dense)
    x = torch.randn(3, k, generator=gen)
    # the GEMM's input permuted the same way gives x @ W.T (what _linear hands the kernel)
    assert torch.allclose(x.index_select(1, packed.perm) @ unpack_kept(
        Int4Weight(**{**vars(packed), "perm": None})).T, x @ dense.T, atol=1e-5)

    uneven = g_idx.clone()
    uneven[:2] = 0  # two more columns in group 0: no order makes the groups `group` wide
    kept = KeptQuantized(CheckpointQuantization("compressed-tensors", None))
    kept.keep("l.down_proj", scheme, {**parts, "weight_g_idx": uneven})
    assert kept.refused == {"l.down_proj": "packed 4-bit with act-order groups of uneven size (g_idx)"}


def test_dense_layers_stay_dense_and_fp8_updates_requantize_per_row():
    gen = torch.Generator().manual_seed(2)
    quant = CheckpointQuantization("fp8", WeightScheme("fp8", 8, "tensor"), ignore=("o_proj",))
    kept = KeptQuantized(quant)
    q, s = _fp8_part(32, 64, (32, 64), gen)
    scheme = WeightScheme("fp8", 8, "tensor")
    param = torch.nn.Parameter(dequant_float(q, s.reshape(()), scheme), requires_grad=False)
    kept.keep("l.k_proj", scheme, {"weight": q, "scale": s.reshape(())})
    dense_layer = torch.randn(32, 64, generator=gen)
    kept.bind(_Model(param, [("l.k_proj", 32)]))
    packs = kept.scheme()
    assert packs.pack(dense_layer) is dense_layer  # no record: the checkpoint keeps it dense
    assert packs.pack(packs.unpack(dense_layer)) is dense_layer  # and an update leaves it dense
    packed = packs.pack(param)
    assert isinstance(packed, Fp8Weight) and torch.equal(packed.q.view(torch.uint8), q.view(torch.uint8))
    assert packed.scale.shape == (32,)  # one per row: the per-tensor scale laid out per row
    fresh = packs.unpack(packed)
    fresh.mul_(3)
    again = packs.pack(fresh)
    assert isinstance(again, Fp8Weight) and torch.equal(again.q.float().abs().amax(1), torch.full((32,), 448.0))


def test_cpu_default_dequantizes_at_load(tiny_model, tmp_path, monkeypatch):
    """On CPU (no FP8 dot products here) FP8 checkpoints load dequantized unless a test
    forces the CUDA scheme (int4 ones stay int4: tests/unit/engine/test_cpu_int4_kept.py)."""
    monkeypatch.delenv("TOKSERVE_KEEP_QUANTIZED", raising=False)
    assert not keeps_quantized(torch.device("cpu")) and keeps_quantized(torch.device("cuda"))
    path = qf.write_fp8_block(tiny_model("llama"), tmp_path / "fp8")
    engine = make_engine(path)
    layer = engine.runner.model.layers[0]
    assert isinstance(layer.qkv_weight, torch.Tensor) and layer.qkv_weight.dtype == torch.float32
    engine.close()


def test_a_gpu_bound_model_stages_its_projections_in_host_memory(tiny_model, tmp_path):
    """For a GPU (here the meta device stands in for it: a device whose tensors hold no
    data) the projections and expert stacks are built in host memory, and each is
    quantized onto the device as soon as the loader has filled it -- so the device never
    holds a dense projection -- while every other weight is built on the device; after
    packing nothing is left in host memory (model_setup checks the same)."""
    from worker.engine.loading.loader import load_model
    from worker.engine.loading.model_setup import _check_placed
    from worker.engine.models.config import ModelConfig
    from worker.engine.models.layers import staged_projections

    path = qf.write_fp8_block(tiny_model("mixtral"), tmp_path / "fp8", block=(32, 32))
    target = torch.device("meta")
    kept = KeptQuantized(ModelConfig.from_dir(path).quantization, device=target)
    with staged_projections("cpu"):
        model = load_model(path, dtype=torch.float32, device=target, keep=kept.keep, filled=kept.filled)
    staged = model.projection_weights() + model.expert_stacks()
    assert staged and all(w.device.type == "cpu" for w in staged)
    ids = {id(w) for w in staged}
    assert all(p.device == target for p in model.parameters() if id(p) not in ids)  # norms, embeddings, routers
    # every projection and stack was quantized onto the device while loading, none waits for the end
    assert len(kept.packed_while_loading) == len(staged) and not kept.records
    assert all(w.q.device == target for w in kept.packed_while_loading)
    kept.bind(model)
    model.pack_linears(kept.scheme())
    kept.finish()
    _check_placed(model, target)
    layer = model.layers[0]
    assert isinstance(layer.qkv_weight, Fp8BlockWeight) and layer.qkv_weight.q.device == target
    assert isinstance(layer.moe.w13, Fp8BlockWeight) and layer.moe.w13.q.device == target
