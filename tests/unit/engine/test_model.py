"""Model layer against transformers: config parsing, loading, paged attention
(prefill, decode through non-contiguous blocks, mixed chunked batches)."""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.model_factory import load_hf_model
from worker.engine.attention.metadata import build_attention_metadata
from worker.engine.config import EngineConfig
from worker.engine.loading.loader import load_model
from worker.engine.models.config import ModelConfig
from worker.engine.models import kv_bytes_per_block, kv_cache_shape
from common.dtype_policy import cpu_has_native_bf16
from worker.engine.models.cpu_gemm import (onednn_linear, onednn_supported, pack_weight, resolve_cpu_linear,
                                            row_bucket)
from common.tokenizer import load_tokenizer

ATOL = 1e-4
BLOCK = 4


class PagedSeqs:
    """Minimal stand-in for the engine: a KV cache, a shuffled block pool and
    per-sequence block tables, stepping any mix of prefill chunks and decodes."""

    def __init__(self, model, num_blocks: int = 96, device="cpu", seed: int = 0):
        self.model = model
        self.kv = torch.zeros(kv_cache_shape(model.config, num_blocks, BLOCK), dtype=model.dtype, device=device)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # non-contiguous, out-of-order block ids
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}
        self.device = device

    def step(self, chunks: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """Run one step; ``chunks`` = (seq name, new token ids).  Returns each
        chunk's logits ``[len, vocab]``."""
        q_lens, ctx, tables, ids = [], [], [], []
        for name, toks in chunks:
            c = self.lens.get(name, 0)
            table = self.tables.setdefault(name, [])
            while len(table) * BLOCK < c + len(toks):
                table.append(self.free.pop())
            q_lens.append(len(toks))
            ctx.append(c)
            tables.append(table)
            ids.extend(toks)
            self.lens[name] = c + len(toks)
        attn = build_attention_metadata(q_lens, ctx, tables, BLOCK, self.device)
        hidden = self.model(torch.tensor(ids, device=self.device), attn.positions, attn, self.kv)
        logits = self.model.compute_logits(hidden).cpu()
        return list(logits.split(q_lens))


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _tokens(n: int, seed: int, vocab: int = 320) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


KINDS = ["llama", "qwen2", "qwen3", "mistral", "llama_tied", "llama_rope_llama3", "llama_rope_linear", "llama_rope_yarn"]


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_then_paged_decode_matches_hf(tiny_model, kind):
    path = tiny_model(kind)
    hf, model = load_hf_model(path), load_model(path)
    ids = _tokens(90, seed=1)  # > original_max_position_embeddings of the rope variants
    ref = hf_logits(hf, ids)
    seqs = PagedSeqs(model)
    prompt = 83
    (got,) = seqs.step([("a", ids[:prompt])])
    torch.testing.assert_close(got, ref[:prompt], atol=ATOL, rtol=0)
    for pos in range(prompt, len(ids)):
        (got,) = seqs.step([("a", [ids[pos]])])
        torch.testing.assert_close(got[0], ref[pos], atol=ATOL, rtol=0)
    assert seqs.tables["a"] != sorted(seqs.tables["a"])  # really non-contiguous


needs_onednn = pytest.mark.skipif(not onednn_supported(torch.device("cpu"), torch.float32),
                                  reason="torch build without oneDNN linear ops")


@needs_onednn
@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_tied"])
def test_onednn_packed_linears_match_hf(tiny_model, kind):
    """Prepacked oneDNN weights (the CPU default) still match HF within the parity
    tolerance, q/k/v biases and a tied head included."""
    path = tiny_model(kind)
    hf, model = load_hf_model(path), load_model(path)
    model.pack_linears()
    assert model.layers[0].qkv_weight.is_mkldnn and "qkv_weight" not in dict(model.named_parameters())
    if kind == "llama_tied":
        assert model.lm_head is model.embed_tokens and not model.embed_tokens.is_mkldnn  # embedding stays dense
    ids = _tokens(60, seed=5)
    ref = hf_logits(hf, ids)
    seqs = PagedSeqs(model)
    (got,) = seqs.step([("a", ids[:50])])
    torch.testing.assert_close(got, ref[:50], atol=ATOL, rtol=0)
    for pos in range(50, len(ids)):
        (got,) = seqs.step([("a", [ids[pos]])])
        torch.testing.assert_close(got[0], ref[pos], atol=ATOL, rtol=0)


def test_onednn_row_buckets_bound_the_shapes():
    """Every row count maps to few shapes (oneDNN builds one primitive per shape and
    caches 1024): 72 up to 2048 rows, never more than 12.5 % padding, common sizes exact."""
    buckets = {row_bucket(m) for m in range(1, 2049)}
    assert len(buckets) == 72
    assert all(m <= row_bucket(m) <= m * 1.125 for m in range(1, 8193))
    assert all(row_bucket(m) == m for m in (1, 7, 16, 24, 32, 48, 64, 128, 256, 512, 1024, 2048))


@needs_onednn
def test_onednn_linear_pads_rows_transparently():
    w, b = torch.randn(24, 40), torch.randn(24)
    packed = pack_weight(w)
    for rows in (1, 17, 33, 130):  # 17 -> 18, 33 -> 36, 130 -> 144 rows inside
        x = torch.randn(rows, 40)
        got = onednn_linear(x, packed, b)
        assert got.shape == (rows, 24)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_cpu_linear_choice():
    cpu = torch.device("cpu")
    assert resolve_cpu_linear("torch", cpu, torch.float32) == "torch"
    assert resolve_cpu_linear("auto", torch.device("cuda"), torch.bfloat16) == "torch"
    assert resolve_cpu_linear("auto", cpu, torch.float32) == ("onednn" if onednn_supported(cpu, torch.float32)
                                                              else "torch")
    # oneDNN packs bf16 where the CPU has native bf16 dot products (emulated bf16 GEMMs lose to
    # fp32); auto's bf16 choice between it and the native GEMM: tests/unit/kernels/test_bf16_gemm.py
    bf16_ok = onednn_supported(cpu, torch.bfloat16)
    assert bf16_ok == (onednn_supported(cpu, torch.float32) and cpu_has_native_bf16())
    assert resolve_cpu_linear("auto", cpu, torch.bfloat16) in (("native", "onednn") if bf16_ok else ("native", "torch"))
    with pytest.raises(ValueError, match="cpu_linear=onednn is not supported"):
        resolve_cpu_linear("onednn", cpu, torch.float16)
    with pytest.raises(ValueError, match="cpu_linear must be one of auto, native, onednn, torch"):
        EngineConfig(model="unused", cpu_linear="mkl")


@pytest.mark.skipif(not onednn_supported(torch.device("cpu"), torch.bfloat16),
                    reason="no native bf16 dot products (or no oneDNN) on this CPU")
def test_onednn_bf16_linear_matches_fp32_reference():
    """The bf16-packed GEMM (fp32 accumulation) against an fp32 GEMM of the same
    bf16-rounded operands: only the roundings to bf16 may differ, for decode- and prefill-sized row counts and padded ones."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 200, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    packed = pack_weight(w)
    for rows in (1, 17, 32, 130, 512):
        x = torch.randn(rows, 200, generator=g).bfloat16()
        got = onednn_linear(x, packed, b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
        ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
        # Rounding bias and output to bf16 (2^-8 each) scaled by the sum's magnitude
        # before cancellation: a cancelling sum may lose all its relative precision.
        bound = 2 ** -7 * torch.nn.functional.linear(x.float().abs(), w.float().abs(), b.float().abs())
        assert ((got.float() - ref).abs() <= bound).all()


@pytest.mark.parametrize("packed", [False, True])
def test_mlp_row_blocks_are_bit_identical(tiny_model, packed):
    """Large steps run the MLP in row blocks; every row must come out exactly as
    from one whole-step call."""
    if packed and not onednn_supported(torch.device("cpu"), torch.float32):
        pytest.skip("torch build without oneDNN linear ops")
    path = tiny_model("qwen2")
    whole, blocked = load_model(path), load_model(path)
    for m in (whole, blocked):
        if packed:
            m.pack_linears()
    for layer in blocked.layers:
        layer.MLP_ROWS = 32
    ids = _tokens(150, seed=6)  # 4 full blocks + a ragged one
    a = PagedSeqs(whole).step([("a", ids[:100]), ("b", ids[100:])])
    b = PagedSeqs(blocked).step([("a", ids[:100]), ("b", ids[100:])])
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_mixed_batch_matches_separate_runs(tiny_model):
    """Fresh prefills, prefill chunks with context, and decodes of different
    lengths in one step (decodes interleaved between prefills) equal HF on each
    sequence alone; then a decode-only step over uneven lengths."""
    path = tiny_model("qwen3")
    hf, model = load_hf_model(path), load_model(path)
    full = {name: _tokens(n, seed=i) for i, (name, n) in enumerate(
        [("fresh", 11), ("chunked", 30), ("dec_short", 6), ("dec_long", 41), ("fresh2", 3)])}
    refs = {name: hf_logits(hf, ids) for name, ids in full.items()}
    seqs = PagedSeqs(model)
    # Step 1: several prefills in one batch build the contexts.
    seqs.step([("chunked", full["chunked"][:13]), ("dec_short", full["dec_short"][:5]),
               ("dec_long", full["dec_long"][:40])])
    # Step 2: mixed.
    out = seqs.step([("dec_short", full["dec_short"][5:6]), ("fresh", full["fresh"][:11]),
                     ("dec_long", full["dec_long"][40:41]), ("chunked", full["chunked"][13:25]),
                     ("fresh2", full["fresh2"][:2])])
    torch.testing.assert_close(out[0][0], refs["dec_short"][5], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], refs["fresh"][:11], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[2][0], refs["dec_long"][40], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[3], refs["chunked"][13:25], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[4], refs["fresh2"][:2], atol=ATOL, rtol=0)
    # Step 3: decode-only batch over sequences of lengths 26, 3 (padding mask matters).
    out = seqs.step([("chunked", full["chunked"][25:26]), ("fresh2", full["fresh2"][2:3])])
    torch.testing.assert_close(out[0][0], refs["chunked"][25], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1][0], refs["fresh2"][2], atol=ATOL, rtol=0)


def test_sharded_checkpoint_loads_like_single_file(tiny_model):
    single, sharded = load_model(tiny_model("llama")), load_model(tiny_model("llama_sharded"))
    assert len(list(tiny_model("llama_sharded").glob("*.safetensors"))) > 1
    a, b = single.state_dict(), sharded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_tied_embeddings_share_the_matrix(tiny_model):
    model = load_model(tiny_model("llama_tied"))
    assert model.lm_head is model.embed_tokens
    assert not load_model(tiny_model("llama")).config.tie_word_embeddings


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "hidden_size": 8}))
    with pytest.raises(ValueError, match=r"Unsupported architecture GPT2LMHeadModel; supported: "
                                         r"LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        ModelConfig.from_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_dir(tmp_path / "nowhere")


def _copy_with_weights(src, dst, edit):
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    edit(weights)
    save_file(weights, dst / "model.safetensors")
    return dst


def test_missing_and_misshapen_weights_are_clear_errors(tiny_model, tmp_path):
    src = tiny_model("llama")
    missing = _copy_with_weights(src, tmp_path / "m", lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks 1 weight\(s\): model.layers.1.mlp.up_proj.weight"):
        load_model(missing)

    def shrink(w):
        w["model.norm.weight"] = w["model.norm.weight"][:10]
    bad = _copy_with_weights(src, tmp_path / "b", shrink)
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(10,\), expected \(64,\)"):
        load_model(bad)
    empty = tmp_path / "e"
    empty.mkdir()
    shutil.copy(src / "config.json", empty)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(empty)


def test_model_config_fields(tiny_model):
    llama = ModelConfig.from_dir(tiny_model("llama"))
    assert (llama.architecture, llama.hidden_size, llama.num_hidden_layers) == ("LlamaForCausalLM", 64, 2)
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim) == (4, 2, 16)
    assert (llama.vocab_size, llama.intermediate_size, llama.max_position_embeddings) == (320, 128, 1024)
    assert llama.eos_token_ids == (257,) and llama.bos_token_id == 256 and llama.max_new_tokens is None
    assert not llama.qkv_bias and not llama.qk_norm and llama.rope_scaling is None
    assert llama.dtype == torch.float32
    qwen2 = ModelConfig.from_dir(tiny_model("qwen2"))
    assert qwen2.qkv_bias and not qwen2.o_bias
    assert qwen2.eos_token_ids == (257, 258) and qwen2.max_new_tokens == 32
    from worker.engine.models.config import generation_defaults

    assert generation_defaults("auto", qwen2.path) == {"temperature": 0.7, "top_p": 0.9, "max_tokens": 32}
    assert generation_defaults("vllm", qwen2.path) == {}
    qwen3 = ModelConfig.from_dir(tiny_model("qwen3"))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.q_size == 128
    rope = ModelConfig.from_dir(tiny_model("llama_rope_llama3"))
    assert rope.rope_scaling["rope_type"] == "llama3" and rope.rope_scaling["factor"] == 8.0


def test_model_config_legacy_keys(tmp_path):
    """Pre-transformers-5 configs: rope_theta / rope_scaling{"type"} / torch_dtype,
    derived head_dim and kv heads."""
    cfg = {"architectures": ["MistralForCausalLM"], "hidden_size": 128, "num_attention_heads": 8,
           "num_hidden_layers": 1, "intermediate_size": 256, "vocab_size": 100, "rope_theta": 1e6,
           "rope_scaling": {"type": "linear", "factor": 2.0}, "torch_dtype": "bfloat16",
           "eos_token_id": 2, "sliding_window": 4096, "max_position_embeddings": 32768}
    c = ModelConfig.from_dicts(tmp_path, cfg, {"eos_token_id": [2, 7]})
    assert c.head_dim == 16 and c.num_key_value_heads == 8 and c.rope_theta == 1e6
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert c.dtype == torch.bfloat16 and c.eos_token_ids == (2, 7)
    with pytest.raises(ValueError, match="Unsupported torch_dtype"):
        ModelConfig.from_dicts(tmp_path, {**cfg, "torch_dtype": "int8"})
    with pytest.raises(ValueError, match="lacks required key 'vocab_size'"):
        ModelConfig.from_dicts(tmp_path, {k: v for k, v in cfg.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="Unsupported rope_type 'mrope_interleaved'"):
        from worker.engine.models.llama import LlamaForCausalLM

        LlamaForCausalLM(ModelConfig.from_dicts(tmp_path, {**cfg, "rope_scaling": {"type": "mrope_interleaved"}}))
    with pytest.raises(ValueError, match="rope_type longrope needs short_factor, long_factor"):
        ModelConfig.from_dicts(tmp_path, {**cfg, "rope_scaling": {"type": "longrope"}})


def test_dynamic_ntk_rope_table():
    """Dynamic NTK: like vLLM, one enlarged base for the whole extended range."""
    from worker.engine.models.rotary import build_cos_sin_table

    plain = build_cos_sin_table(16, 10000.0, 128, None)
    dyn = build_cos_sin_table(16, 10000.0, 128, {"rope_type": "dynamic", "factor": 2.0})
    assert plain.shape == (128, 16) and dyn.shape == (256, 16)
    base = 10000.0 * (2.0 * 2.0 - 1.0) ** (16 / 14)
    inv_freq = 1.0 / base ** (torch.arange(0, 16, 2).float() / 16)
    torch.testing.assert_close(dyn[200, :8], (200 * inv_freq).cos())
    assert torch.equal(dyn[0], plain[0]) and not torch.allclose(dyn[100], plain[100])


def test_kv_cache_helpers(tiny_model):
    c = ModelConfig.from_dir(tiny_model("qwen3"))
    assert kv_cache_shape(c, 10, 16) == (2, 2, 10, 16, 2, 32)
    assert kv_bytes_per_block(c, 16, torch.bfloat16) == 2 * 2 * 16 * 2 * 32 * 2


def test_attention_metadata_build():
    m = build_attention_metadata([3, 1], [2, 5], [[7, 2], [4, 9]], 4)
    assert m.query_start_loc.tolist() == [0, 3, 4] and m.seq_lens.tolist() == [5, 6]
    assert m.positions.tolist() == [2, 3, 4, 5]
    assert m.slot_mapping.tolist() == [7 * 4 + 2, 7 * 4 + 3, 2 * 4 + 0, 9 * 4 + 1]
    assert m.block_tables.tolist() == [[7, 2], [4, 9]] and m.max_query_len == 3 and m.max_seq_len == 6
    assert not m.is_decode_only and build_attention_metadata([1], [0], [[3]], 4).is_decode_only
    with pytest.raises(ValueError, match="block table has only 1 blocks"):
        build_attention_metadata([4], [2], [[1]], 4)


def test_bfloat16_model_tracks_float32(tiny_model):
    path = tiny_model("llama")
    ids = _tokens(20, seed=3)
    ref = PagedSeqs(load_model(path)).step([("a", ids)])[0]
    got = PagedSeqs(load_model(path, dtype=torch.bfloat16)).step([("a", ids)])[0]
    assert got.dtype == torch.float32  # compute_logits always returns float32
    assert (got - ref).abs().max() < 0.1


def test_tokenizer(tiny_model, tmp_path):
    tok = load_tokenizer(tiny_model("qwen2"))
    ids = tok.encode("héllo <|end_of_text|>")
    assert ids[:3] == [104, 195, 169] and ids[-1] == 257
    assert tok.decode(ids, skip_special_tokens=True) == "héllo "
    assert tok.decode(ids, skip_special_tokens=False) == "héllo <|end_of_text|>"
    assert tok.convert_ids_to_tokens([104, 32, 256]) == ["h", "Ġ", "<|begin_of_text|>"]
    assert tok.eos_token_id == 257 and tok.bos_token_id == 256 and tok.vocab_size == 320
    assert tok.all_special_ids[:3] == [256, 257, 258] and len(tok.all_special_ids) == 320 - 256
    no_tok = tmp_path / "no-tok"
    no_tok.mkdir()
    assert load_tokenizer(no_tok) is None
    (no_tok / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="cannot load"):
        load_tokenizer(no_tok)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_cuda_paged_attention_matches_hf(tiny_model, kind):
    path = tiny_model(kind)
    hf = load_hf_model(path)
    model = load_model(path, device="cuda")
    ids = _tokens(40, seed=5)
    ref = hf_logits(hf, ids)
    seqs = PagedSeqs(model, device="cuda")
    out = seqs.step([("a", ids[:30]), ("b", ids[:7])])
    torch.testing.assert_close(out[0], ref[:30], atol=1e-3, rtol=0)
    for pos in range(30, 40):
        out = seqs.step([("a", [ids[pos]]), ("b", [ids[pos - 23]])])
        torch.testing.assert_close(out[0][0], ref[pos], atol=1e-3, rtol=0)
        torch.testing.assert_close(out[1][0], ref[pos - 23], atol=1e-3, rtol=0)


def test_quantized_checkpoints_are_refused_by_name(tiny_model, tmp_path):
    src = tiny_model("llama")
    cfg = json.loads((src / "config.json").read_text())
    for quant in ({"quant_method": "bitsandbytes", "load_in_4bit": True}, {"quant_method": "gptq", "bits": 2},
                  {"format": "float-quantized"}):
        with pytest.raises(ValueError, match=r"quantized checkpoints \(quant_method='(bitsandbytes|gptq|float-quantized)'\) "
                                             r"are not supported"):
            ModelConfig.from_dicts(src, {**cfg, "quantization_config": quant})

    # FP8 weights with scales but no quantization_config: refused by the tensors themselves.
    def to_fp8(w):
        name = "model.layers.0.mlp.down_proj.weight"
        w[name] = w[name].to(torch.float8_e4m3fn)
        w["model.layers.0.mlp.down_proj.weight_scale"] = torch.ones(())
    fp8 = _copy_with_weights(src, tmp_path / "fp8", to_fp8)
    with pytest.raises(ValueError, match=r"checkpoint tensor model.layers.0.mlp.down_proj.weight(_scale)? .* "
                                         r"names no quantization_config"):
        load_model(fp8)

    def gptq(w):
        w["model.layers.0.mlp.up_proj.qweight"] = torch.zeros(4, 4, dtype=torch.int32)
    packed = _copy_with_weights(src, tmp_path / "gptq", gptq)
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.qweight"):
        load_model(packed)


def test_large_checkpoints_log_loading_progress(tiny_model, monkeypatch, caplog):
    import logging

    import worker.engine.loading.loader as loader

    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", 1)  # the tiny checkpoint counts as large
    with caplog.at_level(logging.INFO, logger="worker.engine.loading.loader"):
        list(loader.iter_checkpoint(tiny_model("llama_sharded")))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loading weights:")]
    assert 5 <= len(lines) <= 11 and "tensors)" in lines[-1]
