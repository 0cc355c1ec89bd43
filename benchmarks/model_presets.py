"""Random-weight Llama model folders for serving benchmarks, in sizes.

Same recipe as the demo model (worker/engine/loading/demo_model.py: seeded weights, byte-level
tokenizer, plain HF layout readable by our loader, by vLLM and by transformers), with
the shape picked by a size preset.  Vocabularies larger than the 256 bytes + 2
specials are filled with ``<|reserved_N|>`` special tokens so every id decodes.
head_dim is 64 in every preset: vLLM's CPU attention kernels accept only 64 or 128.

    python -m benchmarks.model_presets --size 125m      # builds if needed, prints the folder
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from worker.engine.loading.demo_model import (BOS_TOKEN, BYTE_VOCAB, EOS_TOKEN, build_atomically, build_byte_tokenizer,
                                      default_cache_dir, random_llama_weights, write_json)

PRESET_VERSION = 1  # bump whenever the generated files change

_LLAMA = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
              rms_norm_eps=1e-5, rope_theta=10000.0)

SIZES: dict[str, dict] = {
    # The demo model's shape: per-step overheads dominate; a sweep takes minutes on 2 cores.
    "small": dict(_LLAMA, hidden_size=256, intermediate_size=768, num_hidden_layers=4, vocab_size=BYTE_VOCAB + 2),
    # In between: the matmuls start to matter, still quick.
    "30m": dict(_LLAMA, hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                num_key_value_heads=4, vocab_size=8192),
    # issue 40's side-by-side model (benchmarks/vs_vllm_cpu.py): 8 x 512, ~21M parameters a
    # decode step reads (~42 MB in bf16), big enough that batch-1 decode is weight-bandwidth bound.
    "8x512": dict(_LLAMA, hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=4096),
    # issue 43's kept-int4 vs dequantized decode (benchmarks/int4_gemm_bench.py --engine): 8 x
    # 1024, ~90M projection weights (~180 MB in bf16, ~50 MB in int4): far past the caches.
    "8x1024": dict(_LLAMA, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                   num_key_value_heads=4, vocab_size=4096),
    # Llama-style ~125M (GPT-2 small sized): 12 x 768, 32k vocabulary (same shape as
    # benchmarks/bench_model.py and benchmarks/engine_throughput.py).
    "125m": dict(_LLAMA, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=32000),
    # ~500M (Qwen2.5-0.5B sized), for weight-transfer benchmarks: 2 GB of fp32 weights.
    "500m": dict(_LLAMA, hidden_size=1280, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=20,
                 num_key_value_heads=4, vocab_size=32000),
}


def special_tokens(vocab_size: int) -> tuple[str, ...]:
    if vocab_size < BYTE_VOCAB + 2:
        raise ValueError(f"vocab_size must be at least {BYTE_VOCAB + 2}, got {vocab_size}")
    return (BOS_TOKEN, EOS_TOKEN) + tuple(f"<|reserved_{i}|>" for i in range(vocab_size - BYTE_VOCAB - 2))


def _check_size(size: str) -> dict:
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {sorted(SIZES)}")
    return SIZES[size]


# Checkpoint dtypes a preset can be saved in (config.json's torch_dtype and the tensors).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def write_preset_model(out: Path, size: str, seed: int = 0, dtype: str = "float32") -> None:
    """Write every file of the ``size`` preset into the existing, empty folder ``out``,
    weights stored in ``dtype`` (the same seeded fp32 draw, rounded: a bf16 checkpoint
    is the fp32 one cast, as a released bf16 model would be)."""
    cfg = _check_size(size)
    if dtype not in DTYPES:
        raise ValueError(f"unknown checkpoint dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    bos_id, eos_id = BYTE_VOCAB, BYTE_VOCAB + 1
    specials = special_tokens(cfg["vocab_size"])
    write_json(out / "config.json", {
        **cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "bos_token_id": bos_id,
        "eos_token_id": eos_id, "torch_dtype": dtype, "initializer_range": 0.02, "use_cache": True,
        "tokserve_bench": {"version": PRESET_VERSION, "size": size, "seed": seed},
    })
    write_json(out / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})
    added = {str(BYTE_VOCAB + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                   "single_word": False, "special": True} for i, t in enumerate(specials)}
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN,
        "model_max_length": cfg["max_position_embeddings"], "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
    })
    (out / "tokenizer.json").write_text(build_byte_tokenizer(specials).to_str() + "\n", encoding="utf-8")
    weights = {k: v.to(DTYPES[dtype]).contiguous() for k, v in random_llama_weights(cfg, seed).items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})


def build_preset_model(size: str = "small", out: Optional[str | Path] = None, *, seed: int = 0,
                       force: bool = False, dtype: str = "float32") -> Path:
    """Folder of the ``size`` preset, built first if missing.

    Default location: ``$TOKSERVE_CACHE/bench-model-<size>-v<N>[-s<seed>][-<dtype>]`` (no
    dtype suffix for float32).  Written to a sibling temp folder and renamed into place,
    so an interrupted build leaves nothing.
    """
    _check_size(size)
    if out is None:
        suffix = (f"-s{seed}" if seed else "") + (f"-{dtype}" if dtype != "float32" else "")
        out = default_cache_dir() / f"bench-model-{size}-v{PRESET_VERSION}{suffix}"
    return build_atomically(Path(out), lambda tmp: write_preset_model(tmp, size, seed, dtype), force=force)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.model_presets", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--out", default=None, help="output folder (default: under $TOKSERVE_CACHE)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if present")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="checkpoint dtype")
    args = ap.parse_args(argv)
    print(build_preset_model(args.size, args.out, seed=args.seed, force=args.force, dtype=args.dtype))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
