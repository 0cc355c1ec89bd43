"""Gemma 3 image requests in the engine, by CPU attention backend, beside transformers.

A mid-size random ``Gemma3ForConditionalGeneration`` (text: 1024 hidden, 8 layers, 3:1
local/global; SigLIP: 384 hidden, 4 layers, 224 px / 14 -> 256 patches pooled to 64
tokens), built once under ``--model-dir``.  Each request: 200 text tokens, one image (64
image tokens between ``<start_of_image>`` / ``<end_of_image>``), 300 text tokens; the
resized uint8 image as the gateway sends it (its encode is in the timing).

Reports, per backend, the median over ``--repeats`` distinct images of the prefill time
(one generated token: image encode + the 566-token prefill, whose steps attend on SDPA
with the mask opened within the image) and of the decode time per token (64 tokens; the
``native`` backend decodes on its kernels, ``torch`` on SDPA), and HF ``generate``'s for
the same prompt (eager attention, fp32).

    python -m benchmarks.gemma3_images                    # native, torch and HF; ~2 min on 2 cores
    python -m benchmarks.gemma3_images --backends native --skip-hf
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

IMAGE, BOI, EOI = 300, 301, 302
TOKENS, GRID = 64, (1, 16, 16)


def build(out: Path) -> Path:
    import transformers

    from tests.support.model_factory import _hf_config, write_tokenizer

    if (out / "config.json").is_file():
        return out
    text = _hf_config("gemma3").to_dict()
    text.update(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, head_dim=128, sliding_window=512, final_logit_softcapping=None,
                layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2)
    vision = transformers.SiglipVisionConfig(hidden_size=384, intermediate_size=1536, num_hidden_layers=4,
                                             num_attention_heads=6, image_size=224, patch_size=14,
                                             vision_use_head=False)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=TOKENS,
                                    image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI)
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    transformers.Gemma3ForConditionalGeneration(cfg).float().eval().save_pretrained(out)
    write_tokenizer(out)
    return out


def workload(seed: int):
    from PIL import Image

    from common.multimodal import Gemma3ImageConfig, mm_hash
    from common.protocol import MultiModalItem

    cfg = Gemma3ImageConfig(image_size=224, patch_size=14, merge_size=2)
    rng = np.random.default_rng(seed)
    raw = np.ascontiguousarray(cfg.resize(Image.fromarray(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8))))
    ids = [int(v) for v in rng.integers(3, 256, 200)] + [BOI] + [IMAGE] * TOKENS + [EOI]
    ids += [int(v) for v in rng.integers(3, 256, 300)]
    item = MultiModalItem(modality="image", mm_hash=mm_hash(raw, GRID), offset=201, length=TOKENS,
                          grid_thw=list(GRID), pixel_values=raw.tobytes(), shape=list(raw.shape), encoding="uint8_hwc")
    return ids, item, cfg.patchify(raw)[0]


def run_engine(model: Path, backend: str, repeats: int, threads: int) -> tuple[float, float]:
    from common.protocol import GenerateRequest, SamplingParams
    from tests.support.engine_helpers import make_engine

    eng = make_engine(model, attention_backend=backend, enable_prefix_caching=False, tokens_only=True,
                      max_num_batched_tokens=1024, max_model_len=1024, num_threads=threads)

    def gen(rid, ids, item, n):
        t0 = time.perf_counter()
        eng.generate([GenerateRequest(request_id=rid, prompt_token_ids=ids, mm_items=[item],
                                      params=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))])
        return time.perf_counter() - t0

    ids, item, _ = workload(1000)
    gen("warm", ids, item, 4)
    prefill, decode = [], []
    for i in range(repeats):
        ids, item, _ = workload(i)
        prefill.append(gen(f"p{i}", ids, item, 1))
        ids, item, _ = workload(100 + i)  # another image: the encoder cache does not help
        decode.append((gen(f"d{i}", ids, item, 65) - prefill[-1]) / 64)
    return float(np.median(prefill)), float(np.median(decode))


@torch.inference_mode()
def run_hf(model: Path, repeats: int) -> tuple[float, float]:
    import transformers

    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(model, dtype=torch.float32,
                                                                     attn_implementation="eager").eval()

    def gen(ids, patches, n):
        x = torch.tensor([ids])
        pixels = torch.from_numpy(patches).view(16, 16, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(1, 3, 224, 224)
        t0 = time.perf_counter()
        hf.generate(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=pixels,
                    token_type_ids=(x == IMAGE).long(), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    pad_token_id=0)
        return time.perf_counter() - t0

    prefill, decode = [], []
    for i in range(repeats):
        ids, _, patches = workload(i)
        prefill.append(gen(ids, patches, 1))
        decode.append((gen(ids, patches, 65) - prefill[-1]) / 64)
    return float(np.median(prefill)), float(np.median(decode))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default="/tmp/tokserve-bench-gemma3-mm")
    ap.add_argument("--backends", default="native,torch")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build(Path(args.model_dir))
    print("| side | prefill: 566 tokens, 1 image (ms) | decode (ms/token) |\n|---|---|---|")
    for backend in args.backends.split(","):
        p, d = run_engine(model, backend, args.repeats, args.threads)
        print(f"| engine, --attention-backend {backend} | {p * 1e3:.0f} | {d * 1e3:.1f} |")
    if not args.skip_hf:
        p, d = run_hf(model, args.repeats)
        print(f"| HF generate (eager, fp32) | {p * 1e3:.0f} | {d * 1e3:.1f} |")


if __name__ == "__main__":
    main()
