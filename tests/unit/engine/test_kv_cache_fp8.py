"""FP8 KV cache (vLLM's ``--kv-cache-dtype fp8``): the cache stores one byte per value
(e4m3, or e5m2; scale 1.0, saturated on write), attention reads it back in the model
dtype, and a given KV memory holds twice bf16's tokens (four times fp32's).  Checked:
the values the cache holds and what attention computes from them (exactly the
attention over the same rounded values in a model-dtype cache), the model against its
own model-dtype cache (close, not equal), the engine's block count and outputs."""
from __future__ import annotations

import pytest
import torch

from tests.support.engine_helpers import make_engine, random_prompts, request
from tests.unit.engine.test_model import BLOCK, PagedSeqs, _tokens
from worker.engine.attention.backends.base import as_stored, to_kv_storage
from worker.engine.attention.backends.torch_sdpa import TorchSDPABackend
from worker.engine.attention.metadata import build_attention_metadata
from worker.engine.config import EngineConfig
from worker.engine.loading.loader import load_model
from worker.engine.models import kv_cache_shape


def test_flag_values():
    base = dict(model="unused", dtype="float32")
    assert EngineConfig(**base).kv_dtype is None
    assert EngineConfig(**base, kv_cache_dtype="fp8").kv_dtype == torch.float8_e4m3fn
    assert EngineConfig(**base, kv_cache_dtype="fp8_e5m2").kv_dtype == torch.float8_e5m2
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_inc is not supported"):
        EngineConfig(**base, kv_cache_dtype="fp8_inc")
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2"):
        EngineConfig(**base, kv_cache_dtype="int4")


def test_storage_saturates_instead_of_overflowing():
    x = torch.tensor([1000.0, -1000.0, 0.3, 1e-9])
    stored = to_kv_storage(x, torch.float8_e4m3fn)
    assert stored.dtype == torch.float8_e4m3fn
    assert stored.float().tolist()[:2] == [448.0, -448.0]
    assert torch.isfinite(stored.float()).all()
    assert as_stored(x, torch.float32) is x  # a model-dtype cache stores values unchanged


class _Seqs(PagedSeqs):
    """PagedSeqs with the KV cache in ``kv_dtype``."""

    def __init__(self, model, kv_dtype, **kw):
        super().__init__(model, **kw)
        self.kv = torch.zeros(kv_cache_shape(model.config, 96, BLOCK), dtype=kv_dtype)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_model_over_an_fp8_cache_tracks_its_model_dtype_cache(tiny_model, fp8):
    model = load_model(tiny_model("llama"), dtype=torch.float32)
    model.use_attention_backend(TorchSDPABackend())
    ids = _tokens(40, seed=2)
    ref, q8 = _Seqs(model, torch.float32), _Seqs(model, fp8)
    out_ref = [ref.step([("a", ids[:30])])[0]] + [ref.step([("a", [t])])[0] for t in ids[30:]]
    out_8 = [q8.step([("a", ids[:30])])[0]] + [q8.step([("a", [t])])[0] for t in ids[30:]]
    assert q8.kv.dtype == fp8 and q8.kv.float().abs().sum() > 0
    diff = max((a - b).abs().max().item() for a, b in zip(out_ref, out_8))
    assert 0 < diff < 0.5  # FP8 rounding of K/V moves the logits, a little
    # the first layer's cache holds exactly the model's K/V rounded to FP8 (later layers'
    # K/V already depend on attention over rounded values)
    used = [b for table in q8.tables.values() for b in table]
    for blk in used:
        torch.testing.assert_close(q8.kv[:, 0, blk].float(), to_kv_storage(ref.kv[:, 0, blk], fp8).float(),
                                   rtol=0, atol=0)


def test_attention_over_fp8_equals_attention_over_the_rounded_values():
    """The SDPA backend over an FP8 cache computes what it computes over a float32 cache
    holding the same rounded values: prefill without context, with context, and decode."""
    from worker.engine.attention.layer import PagedAttention

    torch.manual_seed(0)
    heads, kvh, d, bs = 4, 2, 16, 4
    layer_8, layer_32 = PagedAttention(heads, kvh, d), PagedAttention(heads, kvh, d)
    cache_8 = torch.zeros(2, 12, bs, kvh, d, dtype=torch.float8_e4m3fn)
    cache_32 = torch.zeros(2, 12, bs, kvh, d)
    tables = [[3, 7, 1, 9, 2]]
    for q_len, ctx in ((7, 0), (5, 7), (1, 12)):
        q = torch.randn(q_len, heads, d)
        k, v = torch.randn(q_len, kvh, d) * 3, torch.randn(q_len, kvh, d) * 3
        out_8 = layer_8(q, k, v, cache_8, build_attention_metadata([q_len], [ctx], tables, bs, "cpu"))
        out_32 = layer_32(q, as_stored(k, torch.float8_e4m3fn), as_stored(v, torch.float8_e4m3fn), cache_32,
                          build_attention_metadata([q_len], [ctx], tables, bs, "cpu"))
        torch.testing.assert_close(out_8, out_32, rtol=0, atol=1e-6)


def test_engine_fp8_cache_holds_four_times_fp32_tokens_and_serves(tiny_model):
    path = tiny_model("llama")
    budget = 1 << 20
    dense = make_engine(path, kv_cache_memory_bytes=budget, num_kv_blocks=None)
    fp8 = make_engine(path, kv_cache_memory_bytes=budget, num_kv_blocks=None, kv_cache_dtype="fp8")
    assert fp8.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert fp8.block_manager.num_blocks == 4 * dense.block_manager.num_blocks  # 1 byte vs float32's 4
    prompts = random_prompts(4, 10, 40, seed=3)
    outs = []
    for engine in (dense, fp8):
        reqs = [request(f"r{i}", p, max_tokens=12, ignore_eos=True) for i, p in enumerate(prompts)]
        outs.append({rid: list(ds[-1].token_ids) if len(ds) == 1 else [t for d in ds for t in d.token_ids]
                     for rid, ds in engine.generate(reqs).items()})
        engine.close()
    assert all(len(v) == 12 for v in outs[1].values())
    # greedy over a random tiny model: FP8 K/V may flip a near tie, most tokens agree
    same = sum(a == b for rid in outs[0] for a, b in zip(outs[0][rid], outs[1][rid]))
    assert same >= 0.5 * 48, (outs[0], outs[1])
