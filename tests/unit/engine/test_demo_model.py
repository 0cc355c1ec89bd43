"""The embedded demo model: deterministic, atomic/idempotent build, loadable by
transformers and by our loader with matching logits."""
from __future__ import annotations

import hashlib
import json

import torch

from tests.support.model_factory import load_hf_model
from tests.unit.engine.test_model import PagedSeqs, hf_logits
from worker.engine.loading import demo_model
from worker.engine.loading.loader import load_model
from worker.engine.models.config import ModelConfig
from common.tokenizer import load_tokenizer

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def _digests(path):
    return {f: hashlib.sha256((path / f).read_bytes()).hexdigest() for f in FILES}


def test_build_is_deterministic_per_seed(demo_model_dir, tmp_path):
    again = demo_model.build_demo_model(tmp_path / "again")
    assert _digests(again) == _digests(demo_model_dir)
    other = demo_model.build_demo_model(tmp_path / "seed1", seed=1)
    assert _digests(other)["model.safetensors"] != _digests(demo_model_dir)["model.safetensors"]
    assert sorted(p.name for p in demo_model_dir.iterdir()) == FILES  # no temp leftovers


def test_build_is_idempotent_force_rebuilds_and_honours_cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKSERVE_CACHE", str(tmp_path / "cache"))
    path = demo_model.build_demo_model()
    assert path == tmp_path / "cache" / f"demo-model-v{demo_model.DEMO_VERSION}"
    weights = path / "model.safetensors"
    weights.write_bytes(b"sentinel")  # an existing build is reused untouched
    assert demo_model.build_demo_model() == path and weights.read_bytes() == b"sentinel"
    assert demo_model.build_demo_model(force=True) == path
    assert weights.read_bytes() != b"sentinel"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # temp folder renamed away


def test_cli_prints_path(tmp_path, capsys):
    from common.cli import main

    assert main(["demo-model", "--out", str(tmp_path / "cli")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert (tmp_path / "cli" / "model.safetensors").is_file()


def test_demo_config_and_tokenizer(demo_model_dir):
    cfg = ModelConfig.from_dir(demo_model_dir)
    assert (cfg.architecture, cfg.hidden_size, cfg.num_hidden_layers) == ("LlamaForCausalLM", 256, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 64)
    assert cfg.vocab_size == 258 and cfg.max_position_embeddings == 2048 and cfg.eos_token_ids == (257,)
    tok = load_tokenizer(demo_model_dir)
    text = "Grüße, 世界! \x00\n\t🙂"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))  # byte-level: every string is encodable
    assert tok.decode(ids + [257]) == text
    assert tok.all_special_ids == [256, 257] and tok.eos_token_id == 257 and tok.bos_token_id == 256
    assert json.loads((demo_model_dir / "config.json").read_text())["tokserve_demo"]["seed"] == 0


def test_transformers_and_our_loader_agree(demo_model_dir):
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(demo_model_dir)
    text = "The quick brown fox — ünïcödé"
    ids = hf_tok.encode(text, add_special_tokens=False)
    assert ids == load_tokenizer(demo_model_dir).encode(text)
    assert hf_tok.eos_token_id == 257
    hf = load_hf_model(demo_model_dir)
    ref = hf_logits(hf, ids)
    seqs = PagedSeqs(load_model(demo_model_dir))
    (got,) = seqs.step([("a", ids[:-3])])
    torch.testing.assert_close(got, ref[:-3], atol=1e-4, rtol=0)
    for pos in range(len(ids) - 3, len(ids)):
        (got,) = seqs.step([("a", [ids[pos]])])
        torch.testing.assert_close(got[0], ref[pos], atol=1e-4, rtol=0)


def test_concurrent_builds_leave_one_complete_model(tmp_path, demo_model_dir):
    from concurrent.futures import ThreadPoolExecutor

    target = tmp_path / "shared"
    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: demo_model.build_demo_model(target), range(3)))
    assert paths == [target] * 3
    assert _digests(target) == _digests(demo_model_dir)
    assert [p.name for p in tmp_path.iterdir()] == ["shared"]
