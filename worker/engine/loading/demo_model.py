"""Seeded random-weight Llama model with a byte-level tokenizer, so the whole stack
runs with no download (``tokserve demo-model`` / ``tokserve serve`` without --model).

The files are the ordinary HF layout (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json), loadable by
transformers as well as by our loader.  Same seed -> byte-identical files.
Built without transformers: only torch, safetensors and tokenizers.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

DEMO_VERSION = 2  # bump whenever the generated files change
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN)
BYTE_VOCAB = 256

DEMO_CONFIG = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ByteLevel uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def build_byte_tokenizer(special_tokens: tuple[str, ...] = SPECIAL_TOKENS) -> Tokenizer:
    """Token id == byte value for ids 0..255, then the special tokens in order.

    Every string is encodable (UTF-8 bytes) and every id sequence decodable, which
    makes it a faithful stand-in for real BPE vocabularies in tests (multi-byte
    characters split across tokens, specials, ...).
    """
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return tok


# Llama-3's turn layout with the headers spelled in text (the byte vocabulary has no header
# tokens), so /v1/chat/completions works on the demo model.
DEMO_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] | trim + eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def tokenizer_config(bos: str = BOS_TOKEN, eos: str = EOS_TOKEN, model_max_length: int = 2048) -> dict:
    added = {str(BYTE_VOCAB + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                   "single_word": False, "special": True}
             for i, t in enumerate(SPECIAL_TOKENS)}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": DEMO_CHAT_TEMPLATE,
    }


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def random_llama_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    w = {"model.embed_tokens.weight": normal(v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        w[p + "self_attn.q_proj.weight"] = normal(q, h)
        w[p + "self_attn.k_proj.weight"] = normal(kv, h)
        w[p + "self_attn.v_proj.weight"] = normal(kv, h)
        w[p + "self_attn.o_proj.weight"] = normal(h, q)
        w[p + "mlp.gate_proj.weight"] = normal(inter, h)
        w[p + "mlp.up_proj.weight"] = normal(inter, h)
        w[p + "mlp.down_proj.weight"] = normal(h, inter)
    w["model.norm.weight"] = torch.ones(h)
    w["lm_head.weight"] = normal(v, h)
    return w


def write_demo_model(out: Path, seed: int = 0) -> None:
    """Write every file of the demo model into the (existing, empty) folder ``out``."""
    bos_id, eos_id = BYTE_VOCAB, BYTE_VOCAB + 1
    cfg = dict(DEMO_CONFIG, vocab_size=BYTE_VOCAB + len(SPECIAL_TOKENS))
    config = {
        **cfg,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "use_cache": True,
        "tokserve_demo": {"version": DEMO_VERSION, "seed": seed},
    }
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})
    write_json(out / "tokenizer_config.json", tokenizer_config(model_max_length=cfg["max_position_embeddings"]))
    (out / "tokenizer.json").write_text(build_byte_tokenizer().to_str(pretty=True) + "\n", encoding="utf-8")
    save_file(random_llama_weights(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})


def default_cache_dir() -> Path:
    root = os.environ.get("TOKSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tokserve")
    return Path(root)


def build_atomically(target: Path, write: Callable[[Path], None], *, force: bool = False) -> Path:
    """Build a model folder at ``target`` with ``write(tmp)``, unless one is already there.

    The files are written into a sibling temp folder and renamed into place, so a
    concurrent or interrupted build never leaves a half-written model behind.
    """
    if target.is_dir() and (target / "model.safetensors").is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp creates 0700; the model is meant to be shared
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if target.exists():
            if not force and (target / "model.safetensors").is_file():
                return target  # another process won the race
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
            # a concurrent build renamed its (identical) copy in first
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_demo_model(cache_dir: Optional[str | Path] = None, *, seed: int = 0, force: bool = False) -> Path:
    """Path of the demo model for ``seed``, building it first if needed.

    ``cache_dir`` is the exact output folder when given, else
    ``$TOKSERVE_CACHE`` (default ``~/.cache/tokserve``) ``/demo-model-v<N>[-s<seed>]``.
    Built atomically (``build_atomically``).
    """
    if cache_dir is not None:
        target = Path(cache_dir)
    else:
        suffix = f"-s{seed}" if seed else ""
        target = default_cache_dir() / f"demo-model-v{DEMO_VERSION}{suffix}"
    return build_atomically(target, lambda tmp: write_demo_model(tmp, seed), force=force)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="tokserve demo-model", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="output folder (default: $TOKSERVE_CACHE/demo-model-v%d)" % DEMO_VERSION)
    ap.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    ap.add_argument("--force", action="store_true", help="rebuild even if present")
    args = ap.parse_args(argv)
    print(build_demo_model(args.out, seed=args.seed, force=args.force))
    return 0
