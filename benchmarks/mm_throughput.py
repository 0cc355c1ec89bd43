"""Image-input throughput: our stack vs Hugging Face ``generate`` on the same tiny Qwen2-VL.

Requests carry 1-4 images each (sizes 112x112 .. 224x224, distinct per request unless
``--repeat-images``), ``max_tokens`` 16, ``ignore_eos``, temperature 0.

- ours: ``tokserve serve`` (broker, ``--workers`` workers (1), gateway given the model folder) on private
  ipc endpoints; the images go as data-URL ``content_parts`` to ``/inference/v1/generate``
  (streaming), so the gateway's image decode + preprocessing is part of the measurement.
- HF: the same model folder loaded with transformers; the same prompts and the same pixel
  values (preprocessed by our processor, outside the timing).  Concurrency 1: ``generate``
  per request; concurrency > 1: left-padded batches of that many requests.  TTFT is the time
  to the first generated token (a streamer records it); HF's batches start together, so a
  batch's TTFT counts for each of its requests.

- engine: the same requests straight into an in-process engine (the worker's thread count,
  images decoded and resized outside the timing, ``max_num_seqs`` = concurrency): the
  compute ceiling of the stack, so ours/engine is what serving (HTTP, base64, image
  decoding, broker hops) keeps of it.

Reports images/s (all images of the level / wall time of the level), the ratios ours/HF and
ours/engine, and TTFT p50.  The issue's target (>= 3x HF at concurrency 8) is reported,
never asserted.

    python -m benchmarks.mm_throughput                      # ~2 min on the 2-core CPU box
    python -m benchmarks.mm_throughput --repeat-images      # the same images every request
    python -m benchmarks.mm_throughput --device cuda        # both sides on the GPU
    python -m benchmarks.mm_throughput --images-per-request 1,2,3,4   # a row per image count
    python -m benchmarks.mm_throughput --workers 2 --skip-engine      # two data-parallel workers
    python -m benchmarks.mm_throughput --workers 2 --encoder-workers 1 --skip-engine   # broker-run E/P/D
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from benchmarks.serve import Stack, percentile, run_http

MODEL_VERSION = 1
IMAGE, VSTART, VEND, VIDEO = 400, 401, 402, 403
VOCAB, EOS = 512, 511
SIZES = [(112, 112), (168, 112), (112, 168), (168, 168), (224, 168), (224, 224)]
PREPROCESSOR = {"min_pixels": 56 * 56, "max_pixels": 224 * 224, "patch_size": 14, "merge_size": 2,
                "temporal_patch_size": 2}
TEXT = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=EOS, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]})
VISION = dict(depth=4, embed_dim=128, hidden_size=256, mlp_ratio=2, num_heads=4, in_channels=3, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2, hidden_act="quick_gelu")


# ----------------------------------------------------------------------------- model
def build_model(out: Optional[str] = None) -> Path:
    """A random Qwen2-VL (text 256 x 4 layers, vision depth 4) with a small-pixel preprocessor."""
    from worker.engine.loading.demo_model import default_cache_dir

    path = Path(out) if out else default_cache_dir() / f"bench-qwen2-vl-tiny-v{MODEL_VERSION}"
    if (path / "preprocessor_config.json").exists():
        return path
    import torch
    import transformers

    from tests.support.model_factory import write_tokenizer

    torch.manual_seed(0)
    cfg = transformers.Qwen2VLConfig(text_config=TEXT, vision_config=dict(VISION), image_token_id=IMAGE,
                                     video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND)
    model = transformers.Qwen2VLForConditionalGeneration(cfg).eval().to(torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name or "ln_q" in name else 0.05 * noise)
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    write_tokenizer(tmp)  # the gateway's text side wants one; the worker serves tokens only
    (tmp / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    tmp.rename(path)
    return path


# ----------------------------------------------------------------------------- workload
class Req:
    def __init__(self, ids: list[int], pngs: list[bytes], pixels: list[np.ndarray], grids: list[list[int]]):
        self.ids, self.pngs, self.pixels, self.grids = ids, pngs, pixels, grids


def _png(seed: int, width: int, height: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    # smooth-ish content: random blocks upsampled, so PNG sizes stay realistic
    small = rng.integers(0, 256, (height // 8, width // 8, 3), dtype=np.uint8)
    img = Image.fromarray(small, "RGB").resize((width, height), Image.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def make_requests(model_dir: Path, num: int, seed: int, repeat_images: bool, images: Optional[int] = None) -> list[Req]:
    """``num`` requests of ``images`` images each (None: 1-4, cycled)."""
    from PIL import Image

    from common.multimodal.qwen2_vl_processor import Qwen2VLImageConfig, preprocess_image

    cfg = Qwen2VLImageConfig.from_model_dir(model_dir)
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(num):
        n_img = images if images else 1 + i % 4
        ids = [int(v) for v in rng.integers(3, 300, 8)]
        pngs, pixels, grids = [], [], []
        for k in range(n_img):
            w, h = SIZES[(i + k) % len(SIZES)]
            img_seed = k if repeat_images else seed * 100_000 + i * 10 + k
            png = _png(img_seed, w, h)
            px, grid = preprocess_image(Image.open(io.BytesIO(png)).convert("RGB"), cfg)
            n = grid[0] * grid[1] * grid[2] // (cfg.merge_size ** 2)
            ids += [int(v) for v in rng.integers(3, 300, 3)] + [VSTART] + [IMAGE] * n + [VEND]
            pngs.append(png)
            pixels.append(np.ascontiguousarray(px, np.float32))
            grids.append(list(grid))
        ids += [int(v) for v in rng.integers(3, 300, 6)]
        reqs.append(Req(ids, pngs, pixels, grids))
    return reqs


def request_body(r: Req, max_tokens: int) -> bytes:
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(p).decode()}}
             for p in r.pngs]
    return json.dumps({"token_ids": r.ids, "content_parts": parts, "stream": True,
                       "sampling_params": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}}).encode()


# ----------------------------------------------------------------------------- ours
def bench_ours(model_dir: Path, levels: list[tuple[int, list[Req]]], warm: list[Req], args) -> dict[int, dict]:
    stack = Stack(str(model_dir), args.workers, args.worker_args, args.device)
    if args.encoder_workers:
        stack.argv += ["--encoder-workers", str(args.encoder_workers)]
    out = {}
    with stack:
        asyncio.run(run_http(stack.url, [request_body(r, args.max_tokens) for r in warm], 2, "warmup"))
        for conc, reqs in levels:
            stats = asyncio.run(run_http(stack.url, [request_body(r, args.max_tokens) for r in reqs], conc, "ours"))
            errors = [r.error for r in stats.results if r.error]
            if errors:
                print(f"ours conc {conc}: {len(errors)} errors, first: {errors[0]}", file=sys.stderr)
            images = sum(len(r.pngs) for r in reqs)
            out[conc] = {"images_s": images / stats.duration, "ttft_p50": percentile([r.ttft for r in stats.ok], 50),
                         "duration": stats.duration, "errors": len(errors),
                         "tokens": sum(r.output_tokens for r in stats.ok)}
    return out


# ----------------------------------------------------------------------------- engine
def _wire_items(r: Req, model_dir: Path) -> list:
    """The request's images as the gateway sends them (resized uint8), outside any timing."""
    from PIL import Image

    from common.multimodal import Qwen2VLImageConfig, mm_hash, resize_image
    from common.protocol import MultiModalItem

    cfg = Qwen2VLImageConfig.from_model_dir(model_dir)
    items, pos = [], 0
    for png, grid in zip(r.pngs, r.grids):
        offset = r.ids.index(IMAGE, pos)
        length = grid[0] * grid[1] * grid[2] // (cfg.merge_size ** 2)
        pos = offset + length
        raw = np.ascontiguousarray(resize_image(Image.open(io.BytesIO(png)).convert("RGB"), cfg))
        items.append(MultiModalItem(modality="image", mm_hash=mm_hash(raw, grid), offset=offset, length=length,
                                    grid_thw=list(grid), pixel_values=raw.tobytes(), shape=list(raw.shape),
                                    encoding="uint8_hwc"))
    return items


def bench_engine(model_dir: Path, levels: list[tuple[int, list[Req]]], warm: list[Req], args) -> dict[int, dict]:
    from common.launcher import cpu_worker_threads
    from common.protocol import GenerateRequest, SamplingParams
    from worker.engine import Engine, EngineConfig

    threads = args.engine_threads or cpu_worker_threads(1)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    out = {}
    for conc, reqs in levels:
        engine = Engine(EngineConfig(model=str(model_dir), device=args.device, max_model_len=1024, max_num_seqs=conc,
                                     num_kv_blocks=512, tokens_only=True, num_threads=threads))
        engine.generate([GenerateRequest(request_id=f"w{i}", prompt_token_ids=r.ids, params=params,
                                         mm_items=_wire_items(r, model_dir)) for i, r in enumerate(warm)])
        try:
            batch = [GenerateRequest(request_id=f"r{i}", prompt_token_ids=r.ids, params=params,
                                     mm_items=_wire_items(r, model_dir)) for i, r in enumerate(reqs)]
            start = time.perf_counter()
            engine.generate(batch)
            duration = time.perf_counter() - start
        finally:
            engine.close()  # (gpu_check runs HF next in the same process)
        out[conc] = {"images_s": sum(len(r.pngs) for r in reqs) / duration, "duration": duration,
                     "threads": threads}
        del engine
    return out


# ----------------------------------------------------------------------------- HF
class _FirstToken:
    """generate's streamer: first ``put`` is the prompt, the second the first new token."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def _hf_inputs(batch: list[Req], pad: int):
    import torch

    width = max(len(r.ids) for r in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for b, r in enumerate(batch):  # left padding
        ids[b, width - len(r.ids):] = torch.tensor(r.ids)
        mask[b, width - len(r.ids):] = 1
    pixels = torch.from_numpy(np.concatenate([p for r in batch for p in r.pixels]))
    grids = torch.tensor([g for r in batch for g in r.grids])
    return dict(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grids,
                mm_token_type_ids=(ids == IMAGE).long())


def bench_hf(model_dir: Path, levels: list[tuple[int, list[Req]]], warm: list[Req], args) -> dict[int, dict]:
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(args.hf_threads)
    device = torch.device(args.device)
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32 if device.type == "cpu" else torch.bfloat16).eval().to(device)
    gen_kw = dict(max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False,
                  pad_token_id=0, eos_token_id=None)

    def run(batch: list[Req]) -> tuple[float, float, int]:
        s = _FirstToken()
        t0 = time.perf_counter()
        with torch.inference_mode():
            inputs = {k: v.to(device) for k, v in _hf_inputs(batch, 0).items()}
            out = model.generate(**inputs, streamer=s, **gen_kw)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        return (s.first or t1) - t0, t1 - t0, (out.shape[1] - max(len(r.ids) for r in batch)) * len(batch)

    for r in warm[:2]:
        run([r])
    out = {}
    for conc, reqs in levels:
        ttfts, tokens, start = [], 0, time.perf_counter()
        for i in range(0, len(reqs), conc):
            batch = reqs[i:i + conc]
            ttft, _, n = run(batch)
            ttfts += [ttft] * len(batch)
            tokens += n
        duration = time.perf_counter() - start
        images = sum(len(r.pngs) for r in reqs)
        out[conc] = {"images_s": images / duration, "ttft_p50": percentile(ttfts, 50), "duration": duration,
                     "tokens": tokens}
    return out


# ----------------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder: used if it holds preprocessor_config.json, else the tiny random Qwen2-VL is built there (default: under $TOKSERVE_CACHE)")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--requests", default="48,160", help="requests per concurrency level (comma list, same order)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeat-images", action="store_true", help="every request reuses the same images")
    ap.add_argument("--images-per-request", default="1-4",
                    help="1-4: requests cycle through 1..4 images (one table row per concurrency); a comma list "
                         "such as 1,2,3,4: a row per count, every request of a row carrying that many")
    ap.add_argument("--hf-threads", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1, help="our stack's workers (tokserve serve --workers)")
    ap.add_argument("--encoder-workers", type=int, default=0,
                    help="of those, encoder-only ones (tokserve serve --encoder-workers: broker-run E/P/D)")
    ap.add_argument("--worker-args", default="--max-model-len 1024 --max-num-seqs 8 --num-kv-blocks 512 --tokens-only")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-engine", action="store_true", help="skip the in-process engine ceiling")
    ap.add_argument("--engine-threads", type=int, default=None,
                    help="torch threads of the in-process engine (default: what tokserve serve gives its worker)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N], for the stack, the engine and HF (bf16 on CUDA)")
    ap.add_argument("--json", default=None, help="also write the results here")
    return ap.parse_args(argv)


def run_group(model_dir: Path, images: Optional[int], args) -> tuple[list, dict, dict, dict]:
    """One set of concurrency levels whose requests carry ``images`` images (None: 1-4)."""
    concs = [int(c) for c in args.concurrency.split(",")]
    nums = [int(n) for n in args.requests.split(",")]
    nums += [nums[-1]] * (len(concs) - len(nums))
    levels = [(c, make_requests(model_dir, n, seed=10 + k, repeat_images=args.repeat_images, images=images))
              for k, (c, n) in enumerate(zip(concs, nums))]
    warm = make_requests(model_dir, 4, seed=1, repeat_images=False)
    t = time.perf_counter()
    ours = bench_ours(model_dir, levels, warm, args)
    print(f"[{images or '1-4'} images/request] ours done in {time.perf_counter() - t:.1f}s", flush=True)
    eng = {}
    if not args.skip_engine:
        t = time.perf_counter()
        eng = bench_engine(model_dir, levels, warm, args)
        print(f"[{images or '1-4'} images/request] engine done in {time.perf_counter() - t:.1f}s", flush=True)
    hf = {}
    if not args.skip_hf:
        t = time.perf_counter()
        hf = bench_hf(model_dir, levels, warm, args)
        print(f"[{images or '1-4'} images/request] HF done in {time.perf_counter() - t:.1f}s", flush=True)
    return levels, ours, eng, hf


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    model_dir = build_model(args.model)
    counts: list[Optional[int]] = [None] if args.images_per_request == "1-4" else \
        [int(c) for c in args.images_per_request.split(",")]
    print(f"model {model_dir}; images/request {args.images_per_request}, sizes {SIZES[0]}..{SIZES[-1]}, "
          f"max_tokens {args.max_tokens}, {'repeated' if args.repeat_images else 'distinct'} images", flush=True)
    groups = [(count, *run_group(model_dir, count, args)) for count in counts]
    threads = next((e["threads"] for _, _, _, eng, _ in groups for e in eng.values()), None)
    print(f"device {args.device}" + (f"; in-process engine at {threads} torch thread(s)" if threads else ""))
    print(f"{'img/req':>7}  {'conc':>4}  {'reqs':>4}  {'images':>6}  {'ours img/s':>10}  {'HF img/s':>9}  "
          f"{'ours/HF':>7}  {'engine img/s':>12}  {'ours/engine':>11}  {'ours TTFT p50':>13}  {'HF TTFT p50':>11}")
    report = []
    for count, levels, ours, eng, hf in groups:
        for (conc, reqs) in levels:
            o, h, e = ours[conc], hf.get(conc), eng.get(conc)
            images = sum(len(r.pngs) for r in reqs)
            ratio = f"{o['images_s'] / h['images_s']:.2f}x" if h else "-"
            of_engine = f"{o['images_s'] / e['images_s']:.2f}" if e else "-"
            print(f"{count or '1-4':>7}  {conc:>4}  {len(reqs):>4}  {images:>6}  {o['images_s']:>10.2f}  "
                  f"{(h['images_s'] if h else float('nan')):>9.2f}  {ratio:>7}  "
                  f"{(e['images_s'] if e else float('nan')):>12.2f}  {of_engine:>11}  "
                  f"{o['ttft_p50'] * 1e3:>10.0f} ms  {(h['ttft_p50'] * 1e3 if h else float('nan')):>8.0f} ms")
        if 8 in ours and 8 in hf:
            r = ours[8]["images_s"] / hf[8]["images_s"]
            print(f"issue target (>= 3x HF images/s at concurrency 8), {count or '1-4'} images/request: "
                  f"{r:.2f}x -> {'met' if r >= 3 else 'NOT met'}")
        report.append({"images_per_request": count or "1-4", "ours": ours, "engine": eng, "hf": hf})
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "groups": report}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
