"""FP8 KV cache (vLLM's ``--kv-cache-dtype fp8``): the cache stores one byte per value
(e4m3, or e5m2; scale 1.0, saturated on write), attention reads it back in the model
dtype, and a given KV memory holds twice bf16's tokens (four times fp32's).  Checked:
the values the cache holds and what attention computes from them (exactly the
attention over the same rounded values in a model-dtype cache), the model against its
own model-dtype cache (close, not equal), the engine's block count and outputs.  The
attention checks run on both CPU backends: torch SDPA (which converts the blocks it
gathers) and the native kernels (which read the FP8 blocks in place), and the two agree
over the same FP8 cache."""
from __future__ import annotations

import pytest
import torch

from tests.support.engine_helpers import make_engine, random_prompts, request
from tests.unit.engine.test_model import BLOCK, PagedSeqs, _tokens
from worker.engine.attention.backends.base import as_stored, to_kv_storage
from worker.engine.attention.backends.cpu_native import CpuNativeBackend, CpuNativeImpl
from worker.engine.attention.backends.torch_sdpa import TorchSDPABackend
from worker.engine.attention.metadata import build_attention_metadata
from worker.engine.config import EngineConfig
from worker.engine.kernels import load_cpu_kernels
from worker.engine.loading.loader import load_model
from worker.engine.models import kv_cache_shape

KERNELS = load_cpu_kernels()
NEEDS_KERNELS = pytest.mark.skipif(KERNELS is None, reason="CPU kernels could not be built here")
BACKENDS = ["torch", pytest.param("native", marks=NEEDS_KERNELS)]


def _backend(name: str):
    """The CPU attention backend ``name`` as the engine builds it over an FP8 cache."""
    return TorchSDPABackend() if name == "torch" else CpuNativeBackend(KERNELS, kv_fp8=True)


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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_model_over_an_fp8_cache_tracks_its_model_dtype_cache(tiny_model, fp8, backend):
    model = load_model(tiny_model("llama"), dtype=torch.float32)
    model.use_attention_backend(_backend(backend))
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_over_fp8_equals_attention_over_the_rounded_values(backend):
    """Each backend over an FP8 cache computes what it computes over a float32 cache
    holding the same rounded values: prefill without context, with context, and decode."""
    from worker.engine.attention.layer import PagedAttention

    torch.manual_seed(0)
    heads, kvh, d, bs = 4, 2, 16, 4
    layer_8, layer_32 = PagedAttention(heads, kvh, d), PagedAttention(heads, kvh, d)
    layer_8.set_backend(_backend(backend))
    layer_32.set_backend(_backend(backend))
    if backend == "native":
        assert isinstance(layer_8.impl, CpuNativeImpl)
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


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_rl_weight_update_over_an_fp8_cache_equals_a_fresh_engine(tiny_model, quantization):
    """An RL weight update into an engine serving an FP8 KV cache (and online FP8 weights):
    the same prompts afterwards -- their prefixes cached under the old weights -- give
    exactly what a fresh engine started on the new weights gives (logprobs included), so no
    KV computed with the old weights survives the update."""
    from safetensors.torch import load_file

    path, other = tiny_model("llama"), tiny_model("llama", seed=1)
    kw = dict(kv_cache_dtype="fp8", enable_prefix_caching=True, quantization=quantization)
    prompts = random_prompts(3, 12, 30, seed=5)

    def run(engine, tag):
        out = engine.generate([request(f"{tag}{i}", p, max_tokens=8, ignore_eos=True, logprobs=0)
                               for i, p in enumerate(prompts)])
        return [([t for d in out[f"{tag}{i}"] for t in d.token_ids],
                 [lp for d in out[f"{tag}{i}"] if d.logprobs for lp in d.logprobs.logprobs])
                for i in range(len(prompts))]

    engine = make_engine(path, **kw)
    before = run(engine, "a")
    engine.rl.write_weights(load_file(str(other / "model.safetensors")))
    engine.rl.end_weight_writes()
    after = run(engine, "b")
    engine.close()
    fresh = make_engine(other, **kw)
    want = run(fresh, "c")
    fresh.close()
    assert after == want and after != before


# --- the native kernels over the FP8 cache against torch SDPA over it ---------------------
def _schedule_logprobs(path, dtype, fp8, backend):
    """Log-probs of every row of a schedule with each kind of step (two prompts, decode-only
    steps of uneven lengths, a fresh prefill between decode rows, prefill chunks after cached
    context beside a decode row), teacher-forced over an FP8 cache, attention on ``backend``."""
    model = load_model(path, dtype=dtype)
    model.use_attention_backend(_backend(backend))
    full = {name: _tokens(n, seed=i) for i, (name, n) in enumerate([("a", 45), ("b", 25), ("c", 12)])}
    seqs = _Seqs(model, fp8)
    outs = seqs.step([("a", full["a"][:30]), ("b", full["b"][:10])])
    for pos in range(6):
        outs += seqs.step([("a", [full["a"][30 + pos]]), ("b", [full["b"][10 + pos]])])
    outs += seqs.step([("b", [full["b"][16]]), ("c", full["c"][:7]), ("a", [full["a"][36]])])
    outs += seqs.step([("c", full["c"][7:]), ("a", full["a"][37:45]), ("b", [full["b"][17]])])
    assert seqs.kv.dtype == fp8
    return torch.log_softmax(torch.cat(outs).float(), -1)


@NEEDS_KERNELS
@pytest.mark.parametrize("dtype,mean_tol,max_tol", [(torch.float32, 1e-5, 1e-4), (torch.bfloat16, 0.03, 0.3)])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_native_kernels_match_sdpa_over_the_same_fp8_cache(tiny_model, dtype, mean_tol, max_tol, fp8):
    """Both read the same FP8 values, widened exactly: in float32 they differ by summation
    order only (measured: max |dlogprob| 1.4e-6 over every vocabulary entry of every row).
    In bf16 they also differ in where they round (SDPA's bf16 products and softmax, the
    kernels' float32 math), and a later layer's K/V that moved by that much can land on the
    other side of an FP8 rounding boundary, a whole FP8 step: measured mean 0.010 and max
    0.07 (e4m3) / 0.11 (e5m2), against mean 0.005 and max 0.03 for the same comparison over
    a bf16 cache."""
    path = tiny_model("llama")
    native = _schedule_logprobs(path, dtype, fp8, "native")
    sdpa = _schedule_logprobs(path, dtype, fp8, "torch")
    gap = (native - sdpa).abs()
    print(f"{dtype} {fp8}: |dlogprob| native vs SDPA mean {gap.mean().item():.2e}, max {gap.max().item():.2e}")
    assert gap.mean().item() < mean_tol and gap.max().item() < max_tol, (gap.mean().item(), gap.max().item())


@NEEDS_KERNELS
def test_engine_fp8_cache_attends_on_the_native_kernels(tiny_model):
    """The engine's CPU default over an FP8 cache is the kernels on every ordinary layer
    (its start-up line says so), with the greedy tokens of the torch SDPA backend; layers
    with a sliding window stay on SDPA, and describe() says that too."""
    from worker.engine.attention.backends.torch_sdpa import TorchSDPAImpl

    path = tiny_model("llama")
    native = make_engine(path, kv_cache_dtype="fp8")
    sdpa = make_engine(path, kv_cache_dtype="fp8", cpu_attention="torch")
    assert native.attention_backend.describe() == "native (kernels read the FP8 KV cache)"
    assert all(isinstance(layer.attn.impl, CpuNativeImpl) for layer in native.runner.model.layers)
    prompts = random_prompts(5, 10, 40, seed=8)
    outs = []
    for engine in (native, sdpa):
        reqs = [request(f"r{i}", p, max_tokens=10, ignore_eos=True) for i, p in enumerate(prompts)]
        outs.append({rid: [t for d in ds for t in d.token_ids] for rid, ds in engine.generate(reqs).items()})
        engine.close()
    assert outs[0] == outs[1]

    swa = make_engine(tiny_model("mistral_swa"), kv_cache_dtype="fp8_e5m2")
    assert swa.runner.kv_cache.dtype == torch.float8_e5m2
    assert swa.attention_backend.describe() == \
        "native (kernels read the FP8 KV cache; sliding-window / sink layers on torch SDPA)"
    assert all(isinstance(layer.attn.impl, TorchSDPAImpl) for layer in swa.runner.model.layers)
    swa.close()


# --- the checkpoint's KV-cache scales (quantization/kv_scales.py) --------------------------
@pytest.mark.parametrize("name,want", [
    ("model.layers.3.self_attn.k_scale", (3, "k")),
    ("model.layers.3.self_attn.v_scale", (3, "v")),
    ("model.layers.0.self_attn.attn.k_scale", (0, "k")),
    ("model.layers.1.self_attn.k_proj.k_scale", (1, "k")),  # ModelOpt
    ("model.layers.1.self_attn.v_proj.v_scale", (1, "v")),
    ("model.layers.2.self_attn.k_proj.output_scale", (2, "k")),  # compressed-tensors kv_cache_scheme
    ("model.layers.2.self_attn.v_proj.output_scale", (2, "v")),
    ("model.layers.2.self_attn.kv_scale", (2, "k")),  # deprecated single scale
    ("model.language_model.layers.4.self_attn.v_scale", (4, "v")),
    ("model.layers.2.self_attn.q_proj.output_scale", None),
    ("model.layers.2.self_attn.o_proj.input_scale", None),
    ("model.layers.2.mlp.down_proj.output_scale", None),
])
def test_kv_scale_names(name, want):
    from worker.engine.quantization.kv_scales import kv_scale_target
    assert kv_scale_target(name) == want


def test_kv_scales_follow_vllms_rule():
    from worker.engine.quantization.kv_scales import KvScales
    s = KvScales()
    s.add("a", 0, "k", torch.tensor(2.0))
    s.add("b", 0, "v", torch.tensor([0.5]))
    s.add("c", 1, "k", torch.tensor(3.0))  # kv_scale alone: K's, for both
    assert s.scales() == {0: (2.0, 0.5), 1: (3.0, 3.0)}
    with pytest.raises(ValueError, match="only one scale per tensor"):
        s.add("model.layers.0.self_attn.k_scale", 0, "k", torch.ones(4, 1, 1))


def test_reader_routes_kv_scales_and_drops_them_without_a_hook():
    from worker.engine.quantization.config import parse_quantization
    from worker.engine.quantization.reader import dequantize_stream
    quant = parse_quantization({"quant_method": "fp8", "activation_scheme": "dynamic"})
    w = torch.randn(4, 8)
    tensors = [("model.layers.0.self_attn.k_proj.weight", (w / 0.01).to(torch.float8_e4m3fn)),
               ("model.layers.0.self_attn.k_proj.weight_scale", torch.tensor(0.01)),
               ("model.layers.0.self_attn.k_proj.input_scale", torch.tensor(0.5)),
               ("model.layers.0.self_attn.k_scale", torch.tensor(2.0)),
               ("model.layers.0.self_attn.v_proj.output_scale", torch.tensor(3.0))]
    got = []
    names = [n for n, _ in dequantize_stream(iter(tensors), quant, kv=lambda *a: got.append(a[:3]))]
    assert names == ["model.layers.0.self_attn.k_proj.weight"]
    assert got == [("model.layers.0.self_attn.k_scale", 0, "k"), ("model.layers.0.self_attn.v_proj.output_scale", 0, "v")]
    assert [n for n, _ in dequantize_stream(iter(tensors), quant)] == names  # no hook: dropped


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_applies_kv_scales_over_fp8_only(backend):
    """K/V of a range e4m3 saturates at scale 1 (|x| up to ~2000 > 448): with calibrated
    scales the cache holds k / k_scale and attention equals the float32 attention up to
    FP8 rounding; at scale 1.0 the saturation is far off.  Over a float32 cache the scales
    change nothing."""
    from tests.support.fp8_kv_scale_case import kv_scale_case

    run, ks, vs, qkv = kv_scale_case(lambda cache_dtype: _backend(backend))
    ref, _ = run(torch.float32, None)
    scaled, cache = run(torch.float8_e4m3fn, (ks, vs))
    unscaled, _ = run(torch.float8_e4m3fn, None)
    assert torch.equal(run(torch.float32, (ks, vs))[0], ref)  # ignored over a model-dtype cache
    # the cache holds k / k_scale rounded (first step's keys, block 3)
    torch.testing.assert_close(cache[0, 3].float(), to_kv_storage(qkv[0][1][:4] / ks, torch.float8_e4m3fn).float(),
                               rtol=0, atol=0)
    err_scaled, err_unscaled = (scaled - ref).abs().max().item(), (unscaled - ref).abs().max().item()
    assert err_scaled < 0.1 * err_unscaled, (err_scaled, err_unscaled)
    assert err_scaled < 0.07 * ref.abs().max().item()  # e4m3's rounding (2^-4 relative) only


def _wide_kv_checkpoint(src, dst, factor=4000.0):
    """The tiny model with K and V ``factor`` times larger and q / o scaled back, so it
    computes the same function while its K/V overflow e4m3 at scale 1; FP8 per tensor,
    with k/v scales calibrated (amax / 448, as llm-compressor) on another prompt."""
    from safetensors.torch import load_file, save_file

    from tests.support import quantized_factory as qf
    from tests.support.model_factory import load_hf_model

    wide = dst.parent / (dst.name + "-dense")
    qf._copy_side_files(src, wide)
    state = load_file(str(src / "model.safetensors"))
    for name in state:
        for proj, f in (("q_proj", 1 / factor), ("k_proj", factor), ("v_proj", factor), ("o_proj", 1 / factor)):
            if f".self_attn.{proj}." in name:
                state[name] = state[name] * f
    save_file(state, str(wide / "model.safetensors"), metadata={"format": "pt"})
    hf = load_hf_model(wide)
    amax = {}
    for i, layer in enumerate(hf.model.layers):
        for kind in "kv":
            getattr(layer.self_attn, f"{kind}_proj").register_forward_hook(
                lambda mod, args, out, key=(i, kind): amax.__setitem__(key, out.abs().max().item()))
    with torch.no_grad():
        hf(torch.tensor([_tokens(40, seed=21)]))
    scales = {i: (1.2 * amax[(i, "k")] / 448, 1.2 * amax[(i, "v")] / 448) for i in range(len(hf.model.layers))}
    assert min(amax.values()) > 448  # really out of e4m3's range at scale 1
    return qf.write_fp8_tensor(wide, dst, kv_scales=scales), scales


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoint_kv_scales_bring_fp8_logprobs_closer(tiny_model, tmp_path, backend):
    from worker.engine.quantization.kv_scales import KvScales

    path, scales = _wide_kv_checkpoint(tiny_model("llama"), tmp_path / "fp8kv")
    found = KvScales()
    model = load_model(path, dtype=torch.float32, kv=found.add)
    model.use_attention_backend(_backend(backend))
    assert {i: pytest.approx(s, rel=1e-6) for i, s in scales.items()} == found.scales()
    ids = _tokens(36, seed=2)

    def logprobs(kv_dtype):
        seqs = _Seqs(model, kv_dtype)
        out = [seqs.step([("a", ids[:28])])[0]] + [seqs.step([("a", [t])])[0] for t in ids[28:]]
        return torch.log_softmax(torch.cat(out).float(), -1)

    ref = logprobs(torch.float32)
    unscaled = logprobs(torch.float8_e4m3fn)
    assert found.apply(model, fp8_cache=True) == len(model.layers)
    assert model.layers[1].attn.kv_scales == pytest.approx(scales[1])
    scaled = logprobs(torch.float8_e4m3fn)
    assert torch.equal(logprobs(torch.float32), ref)  # a float32 cache ignores them
    gap_scaled, gap_unscaled = (scaled - ref).abs().mean().item(), (unscaled - ref).abs().mean().item()
    print(f"mean |dlogprob| vs float32 cache: scaled {gap_scaled:.4f}, scale 1.0 {gap_unscaled:.4f}")
    assert gap_scaled < 0.5 * gap_unscaled, (gap_scaled, gap_unscaled)


def test_engine_uses_checkpoint_kv_scales_only_with_an_fp8_cache(tiny_model, tmp_path):
    path, scales = _wide_kv_checkpoint(tiny_model("llama"), tmp_path / "fp8kv")
    fp8 = make_engine(path, kv_cache_dtype="fp8")
    assert [layer.attn.kv_scales for layer in fp8.runner.model.layers] == [pytest.approx(scales[i]) for i in range(2)]
    out = fp8.generate([request("r", _tokens(12, seed=4), max_tokens=4, ignore_eos=True)])
    assert sum(len(d.token_ids) for d in out["r"]) == 4
    fp8.close()
    dense = make_engine(path)
    assert all(layer.attn.kv_scales is None for layer in dense.runner.model.layers)
    dense.close()
