"""Peak host memory of loading a multi-shard checkpoint (issue 42: "model load of a
multi-shard checkpoint streams shard by shard, peak RSS ~ weights + one shard").

Writes a random Llama checkpoint split into shards, then loads it in a fresh
process exactly as the worker does (``loading.loader.load_model``) and reads the
process's resident-set high-water mark (``VmHWM``) before and after.  The figure
that matters is the growth over the baseline (interpreter, torch and the model
code already imported): streaming reads one memory-mapped shard at a time, so it
should stay near ``weights + one shard``; a loader that materialised the whole
checkpoint first would need ``weights + checkpoint``.

    python -m benchmarks.load_rss                        # ~400 MB bf16 in 8 shards
    python -m benchmarks.load_rss --layers 4 --hidden 512 --shards 6
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs in the child: everything the load needs is imported, and run once on a tiny
# checkpoint of the same architecture, before the baseline is read, so the growth is
# the load's own memory (weights, mapped shard pages, copies), not the code pages of
# torch's copy kernels and the safetensors reader touched for the first time (several
# MiB, and more or less of them on another CPU).  The high-water mark is reset after
# the warm-up (``clear_refs``), so the peak is this load's.
_CHILD = r"""
import json, sys
import torch
from worker.engine.loading.loader import load_model, safetensors_files
from worker.engine.models.config import ModelConfig

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)

model_dir, warmup_dir, as_worker = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
config = ModelConfig.from_dir(model_dir)
if as_worker:
    from common.malloc_tuning import keep_freed_memory

    keep_freed_memory()  # as worker/main.py does before loading


def load(path, config=None):
    if not as_worker:
        return load_model(path, dtype=torch.bfloat16, config=config)
    # As the worker builds it: a quantized checkpoint's layers kept quantized where they are.
    from worker.engine.config import EngineConfig
    from worker.engine.loading.model_setup import build_model

    cfg = EngineConfig(model=str(path), dtype="bfloat16", num_threads=1)
    return build_model(cfg, config or ModelConfig.from_dir(path), cfg.torch_device)[0]


load(warmup_dir)  # result dropped: only its code paths matter
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
baseline = status("VmRSS")
model = load(model_dir, config)
peak = status("VmHWM")
import gc
gc.collect()
final = status("VmRSS")
shards = [p.stat().st_size for p in safetensors_files(model_dir)]
weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
print(json.dumps(dict(baseline=baseline, peak=peak, final=final, weights=weights, shards=shards)))
"""


def write_checkpoint(out: Path, *, layers: int, hidden: int, vocab: int, shards: int, seed: int = 0) -> Path:
    """A random bf16 Llama checkpoint in about ``shards`` safetensors files (with the
    index HF writes), plus its config."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3,
                                   num_hidden_layers=layers, num_attention_heads=max(hidden // 64, 1),
                                   num_key_value_heads=max(hidden // 128, 1), head_dim=64,
                                   max_position_embeddings=2048, tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    # HF splits at tensor boundaries: a shard size of total/shards gives about that many.
    model.save_pretrained(out, max_shard_size=max(total // shards, 1), safe_serialization=True)
    return out


def measure(model_dir: Path, as_worker: bool = False) -> dict:
    """Load ``model_dir`` in a fresh process (``as_worker``: as the worker builds the model,
    quantized layers kept quantized and linears packed); its memory figures in bytes
    (``final``: resident after the load, ``weights``: the model's parameters)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(Path(model_dir) / "config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    with tempfile.TemporaryDirectory() as tmp:
        # One layer and a small vocabulary: the same code paths, a few hundred KiB of weights.
        warmup = write_checkpoint(Path(tmp) / "warmup", layers=1, hidden=cfg["hidden_size"], vocab=256, shards=1)
        out = subprocess.run([sys.executable, "-c", _CHILD, str(model_dir), str(warmup), "1" if as_worker else "0"],
                             capture_output=True,
                             text=True, env=env, check=False, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"loading {model_dir} failed:\n{out.stderr[-4000:]}")
    fig = json.loads(out.stdout.strip().splitlines()[-1])
    fig["growth"] = fig["peak"] - fig["baseline"]
    fig["kept"] = fig["final"] - fig["baseline"]
    fig["checkpoint"] = sum(fig["shards"])
    fig["largest_shard"] = max(fig["shards"])
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    mib = 1 << 20
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(Path(tmp) / "ckpt", layers=args.layers, hidden=args.hidden, vocab=args.vocab,
                                     shards=args.shards)
        for r in range(args.rounds):
            f = measure(model_dir)
            bound = f["weights"] + f["largest_shard"]
            print(f"round {r}: {len(f['shards'])} shards, checkpoint {f['checkpoint'] / mib:.1f} MiB "
                  f"(largest shard {f['largest_shard'] / mib:.1f}), weights in memory {f['weights'] / mib:.1f} MiB; "
                  f"RSS baseline {f['baseline'] / mib:.1f} MiB, peak {f['peak'] / mib:.1f} MiB, "
                  f"growth {f['growth'] / mib:.1f} MiB = {f['growth'] / bound:.2f}x (weights + one shard), "
                  f"{f['growth'] / (f['weights'] + f['checkpoint']):.2f}x (weights + whole checkpoint)")


if __name__ == "__main__":
    main()
