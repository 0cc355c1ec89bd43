"""common/multimodal: image loading (vLLM rules) and Qwen2-VL preprocessing
checked against transformers' slow (PIL) Qwen2VLImageProcessor."""

from __future__ import annotations

import base64
import http.server
import io
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from PIL import Image

from common.multimodal import (
    MediaError,
    Qwen2VLImageConfig,
    grid_thw_for_size,
    load_image,
    mm_hash,
    num_placeholder_tokens,
    patchify,
    preprocess_image,
    resize_image,
    smart_resize,
)

# transformers 5.x: the PIL processor lives in its own module (the default one
# needs torchvision); transformers 4.x: the slow processor is the default one.
try:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil as HFProcessor,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize
except ImportError:  # pragma: no cover - transformers 4.x
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
        Qwen2VLImageProcessor as HFProcessor,
    )
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize as hf_smart_resize


def _rand_image(h: int, w: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    ch = {"RGB": 3, "RGBA": 4}[mode]
    return Image.fromarray(rng.integers(0, 256, (h, w, ch), dtype=np.uint8), mode)


def _hf(img: Image.Image, proc) -> tuple[np.ndarray, tuple[int, ...]]:
    out = proc(img, return_tensors="np")
    grid = np.asarray(out["image_grid_thw"])
    assert grid.shape == (1, 3)
    return np.asarray(out["pixel_values"]), tuple(int(v) for v in grid[0])


def _assert_same(img, cfg, proc):
    pv, grid = preprocess_image(img, cfg)
    ref_pv, ref_grid = _hf(img, proc)
    assert grid == ref_grid
    assert pv.dtype == np.float32 and pv.flags.c_contiguous
    assert pv.shape == ref_pv.shape == (grid[0] * grid[1] * grid[2], 3 * 2 * 14 * 14)
    np.testing.assert_allclose(pv, ref_pv, atol=1e-5, rtol=0)
    return pv, grid


# ------------------------------------------------------------ preprocessing


@pytest.mark.parametrize(
    "h,w",
    [
        (1, 1),  # tiny: upscaled to min_pixels
        (10, 13),
        (28, 28),  # exactly one merge window edge
        (56, 56),
        (100, 37),  # non-multiples of 28
        (333, 517),
        (30, 900),  # very wide
        (900, 29),  # very tall
        (512, 512),  # power of two, not a multiple of 28
    ],
)
def test_matches_hf_default_config(h, w):
    _assert_same(_rand_image(h, w, seed=h * 1000 + w), Qwen2VLImageConfig(), HFProcessor())


def test_matches_hf_above_max_pixels():
    # Small max_pixels keeps the test fast while exercising the downscale branch.
    kw = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 64}
    cfg = Qwen2VLImageConfig.from_dict(kw)
    proc = HFProcessor(**kw)
    for h, w in [(1000, 800), (600, 1400), (401, 403)]:
        pv, grid = _assert_same(_rand_image(h, w, seed=h + w), cfg, proc)
        assert grid[1] * grid[2] * 14 * 14 <= kw["max_pixels"]


def test_matches_hf_rgba_and_grayscale_inputs():
    # Direct callers may pass non-RGB images; HF composites alpha onto white.
    proc, cfg = HFProcessor(), Qwen2VLImageConfig()
    _assert_same(_rand_image(70, 90, seed=3, mode="RGBA"), cfg, proc)
    _assert_same(_rand_image(70, 90, seed=4).convert("L"), cfg, proc)


def _write_config(tmp_path, cfg: dict) -> str:
    d = tmp_path / "model"
    d.mkdir()
    (d / "preprocessor_config.json").write_text(json.dumps(cfg))
    return str(d)


QWEN2_VL_STYLE = {  # as shipped with Qwen/Qwen2-VL-*-Instruct, bounds shrunk
    "min_pixels": 28 * 28 * 8,
    "max_pixels": 28 * 28 * 100,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}


@pytest.mark.parametrize(
    "cfg",
    [
        QWEN2_VL_STYLE,
        # size-dict style (newer checkpoints) + custom mean/std
        {
            "size": {"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 50},
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
        # top-level min/max_pixels take precedence over size
        {
            "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
            "min_pixels": 28 * 28 * 20,
            "max_pixels": 28 * 28 * 30,
        },
    ],
)
def test_matches_hf_from_preprocessor_config(tmp_path, cfg):
    model_dir = _write_config(tmp_path, cfg)
    ours = Qwen2VLImageConfig.from_model_dir(model_dir)
    proc = HFProcessor.from_pretrained(model_dir)
    for h, w in [(5, 7), (300, 200), (1000, 700)]:
        _, grid = _assert_same(_rand_image(h, w, seed=h), ours, proc)
        assert grid == grid_thw_for_size(h, w, ours)


def test_config_defaults_and_missing_file(tmp_path):
    assert Qwen2VLImageConfig.from_model_dir(tmp_path) == Qwen2VLImageConfig()
    c = Qwen2VLImageConfig()
    assert (c.min_pixels, c.max_pixels, c.patch_size, c.temporal_patch_size, c.merge_size) == (
        56 * 56, 28 * 28 * 1280, 14, 2, 2)  # fmt: skip
    with pytest.raises(ValueError, match="pixel bounds"):
        Qwen2VLImageConfig.from_dict({"min_pixels": 1000, "max_pixels": 10})


def test_smart_resize_matches_hf_on_grid():
    sizes = [1, 2, 13, 27, 28, 29, 41, 55, 56, 57, 100, 111, 224, 300, 448, 479, 1000, 1023, 2048, 4000]
    bounds = [(56 * 56, 28 * 28 * 1280), (3136, 12845056), (28 * 28 * 4, 28 * 28 * 16)]
    for h in sizes:
        for w in sizes:
            if max(h, w) / min(h, w) > 200:
                continue
            for lo, hi in bounds:
                for factor in (28, 32):
                    assert smart_resize(h, w, factor, lo, hi) == hf_smart_resize(
                        h, w, factor=factor, min_pixels=lo, max_pixels=hi
                    ), (h, w, factor, lo, hi)


def test_smart_resize_aspect_ratio_error_matches_hf():
    with pytest.raises(ValueError) as ours:
        smart_resize(1, 201)
    with pytest.raises(ValueError) as theirs:
        hf_smart_resize(1, 201)
    assert str(ours.value) == str(theirs.value)
    assert "absolute aspect ratio must be smaller than 200" in str(ours.value)
    smart_resize(1, 200)  # exactly 200 is allowed, as in HF


def test_num_placeholder_tokens():
    assert num_placeholder_tokens((1, 4, 4), 2) == 4
    assert num_placeholder_tokens((1, 34, 28)) == 238
    pv, grid = preprocess_image(_rand_image(100, 37))
    assert num_placeholder_tokens(grid) * 4 == pv.shape[0]


@pytest.mark.parametrize("size", [(100, 37), (640, 480), (56, 56)])
def test_resized_uint8_then_patchify_is_the_processor(size):
    """The gateway sends ``resize_image``'s uint8 image; the worker's torch patchify and
    common's numpy patchify give the processor's float32 patches bit for bit."""
    torch = pytest.importorskip("torch")

    cfg = Qwen2VLImageConfig(max_pixels=448 * 448)
    img = _rand_image(*size)
    resized = resize_image(img, cfg)
    assert resized.dtype == np.uint8 and resized.shape[2] == 3
    pv, grid = preprocess_image(img, cfg)
    pv2, grid2 = patchify(resized, cfg)
    assert grid == grid2 and np.array_equal(pv, pv2)
    assert np.array_equal(cfg.torch_patches(torch.from_numpy(resized.copy())).numpy(), pv)


# ------------------------------------------------------------------ hashing


def test_mm_hash_stable_and_sensitive():
    pv, grid = preprocess_image(_rand_image(60, 80))
    h = mm_hash(pv, grid, model_id="m")
    assert h == mm_hash(pv.copy(), grid, model_id="m") and len(h) == 64
    assert h == mm_hash(pv.astype(">f4"), grid, model_id="m")  # byte order canonicalised
    assert h != mm_hash(pv, grid, model_id="other")
    assert h != mm_hash(pv, grid, model_id="m", extra="lora-a")
    assert mm_hash(pv, grid, model_id="m", extra="") != h
    pv2 = pv.copy()
    pv2[0, 0] += 1e-3
    assert h != mm_hash(pv2, grid, model_id="m")
    assert h != mm_hash(pv.reshape(-1, 588), grid, model_id="m")
    raw = resize_image(_rand_image(60, 80))  # uint8 images hash as uint8, not as floats
    assert mm_hash(raw, grid) != mm_hash(raw.astype(np.float32), grid)
    assert mm_hash(raw, grid) == mm_hash(raw.copy(), grid)


# ------------------------------------------------------------------- media


def _encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def _data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def test_data_url_png_roundtrip():
    img = _rand_image(17, 23)
    out = load_image(_data_url(_encode(img, "PNG")), allowed_local_media_path=None)
    assert out.mode == "RGB" and out.size == (23, 17)
    assert np.array_equal(np.asarray(out), np.asarray(img))


def test_data_url_jpeg_roundtrip():
    raw = _encode(_rand_image(40, 30), "JPEG", quality=90)
    out = load_image(_data_url(raw, "image/jpeg"), allowed_local_media_path=None)
    assert out.mode == "RGB" and out.size == (30, 40)
    assert np.array_equal(np.asarray(out), np.asarray(Image.open(io.BytesIO(raw)).convert("RGB")))


def test_rgba_pasted_on_white_and_exif_orientation():
    rgba = Image.new("RGBA", (4, 4), (10, 20, 30, 0))  # fully transparent
    out = load_image(_data_url(_encode(rgba, "PNG")), allowed_local_media_path=None)
    assert out.mode == "RGB" and out.getpixel((0, 0)) == (255, 255, 255)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW on display
    raw = _encode(_rand_image(10, 20), "JPEG", exif=exif)
    assert load_image(_data_url(raw, "image/jpeg"), allowed_local_media_path=None).size == (10, 20)


def test_data_url_errors():
    with pytest.raises(MediaError, match="Invalid base64"):
        load_image("data:image/png;base64,@@@not-base64@@@", allowed_local_media_path=None)
    with pytest.raises(MediaError, match=r"cannot identify image file \(not an image") as err:
        load_image(_data_url(b"definitely not an image"), allowed_local_media_path=None)
    assert " at 0x" not in str(err.value)  # no object address in the message
    with pytest.raises(MediaError, match="Only base64 data URLs"):
        load_image("data:image/png,rawbytes", allowed_local_media_path=None)
    with pytest.raises(MediaError, match="missing ',' separator"):
        load_image("data:image/png;base64", allowed_local_media_path=None)
    # EPS would run Ghostscript: not in vLLM's decoder allow-list.
    with pytest.raises(MediaError, match="Failed to load image"):
        load_image(_data_url(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 1 1\n"), allowed_local_media_path=None)
    assert issubclass(MediaError, ValueError)


def test_oversize_bytes_and_pixels():
    raw = _encode(_rand_image(64, 64), "PNG")
    with pytest.raises(MediaError, match="too large.*limit of 100 bytes"):
        load_image(_data_url(raw), allowed_local_media_path=None, max_bytes=100)
    # Decompression bomb: tiny file, huge header -> refused before decoding.
    bomb = _encode(Image.new("L", (5000, 5000)), "PNG")
    assert len(bomb) < 100_000
    with pytest.raises(MediaError, match=r"5000x5000 \(25000000 pixels\) exceed the maximum of 1000000"):
        load_image(_data_url(bomb), allowed_local_media_path=None, max_pixels=1_000_000)


def test_unknown_scheme_refused():
    with pytest.raises(MediaError, match="HTTP, data or file URL"):
        load_image("ftp://example.com/a.png", allowed_local_media_path=None)


def test_file_urls(tmp_path):
    allowed = tmp_path / "media"
    (allowed / "sub").mkdir(parents=True)
    img = _rand_image(12, 9)
    (allowed / "sub" / "a.png").write_bytes(_encode(img, "PNG"))
    outside = tmp_path / "secret.png"
    outside.write_bytes(_encode(img, "PNG"))

    out = load_image(f"file://{allowed}/sub/a.png", allowed_local_media_path=str(allowed))
    assert np.array_equal(np.asarray(out), np.asarray(img))

    with pytest.raises(MediaError, match="without `--allowed-local-media-path`"):
        load_image(f"file://{allowed}/sub/a.png", allowed_local_media_path=None)
    with pytest.raises(MediaError, match="must be a subpath of `--allowed-local-media-path"):
        load_image(f"file://{outside}", allowed_local_media_path=str(allowed))
    with pytest.raises(MediaError, match="must be a subpath"):
        load_image(f"file://{allowed}/sub/../../secret.png", allowed_local_media_path=str(allowed))
    with pytest.raises(MediaError, match="must be a subpath"):  # the dir itself
        load_image(f"file://{allowed}", allowed_local_media_path=str(allowed))
    os.symlink(outside, allowed / "link.png")
    with pytest.raises(MediaError, match="must be a subpath"):  # symlink escape
        load_image(f"file://{allowed}/link.png", allowed_local_media_path=str(allowed))
    with pytest.raises(MediaError, match="does not exist"):
        load_image(f"file://{allowed}/sub/a.png", allowed_local_media_path=str(tmp_path / "nope"))
    with pytest.raises(MediaError, match="Cannot read local media file"):
        load_image(f"file://{allowed}/missing.png", allowed_local_media_path=str(allowed))
    with pytest.raises(MediaError, match="too large"):
        load_image(f"file://{allowed}/sub/a.png", allowed_local_media_path=str(allowed), max_bytes=50)


def test_http_refused_without_allow_remote():
    for url in ("http://127.0.0.1:1/a.png", "https://example.com/a.png"):
        with pytest.raises(MediaError, match="http\\(s\\) URLs is disabled"):
            load_image(url, allowed_local_media_path=None)


@pytest.fixture
def http_server():
    png = _encode(_rand_image(8, 8), "PNG")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path == "/a.png":
                self.send_response(200)
                self.send_header("Content-Length", str(len(png)))
                self.end_headers()
                self.wfile.write(png)
            else:
                self.send_error(404)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", png
    srv.shutdown()
    srv.server_close()


def test_http_allowed(http_server):
    base, png = http_server
    # the test server is on loopback, which remote fetches refuse unless its network is opted in
    with pytest.raises(MediaError, match="resolves to a blocked address: 127.0.0.1"):
        load_image(f"{base}/a.png", allowed_local_media_path=None, allow_remote=True, timeout_s=5)
    loopback = {"allowed_local_media_path": None, "allow_remote": True, "private_networks": ["127.0.0.0/8"]}
    out = load_image(f"{base}/a.png", timeout_s=5, **loopback)
    assert out.size == (8, 8) and out.mode == "RGB"
    with pytest.raises(MediaError, match="too large"):
        load_image(f"{base}/a.png", max_bytes=len(png) - 1, **loopback)
    with pytest.raises(MediaError, match="HTTP 404 error"):
        load_image(f"{base}/nope.png", **loopback)
    with pytest.raises(MediaError, match="allowed domains: \\['example.com'\\]. Input URL domain: 127.0.0.1"):
        load_image(f"{base}/a.png", allowed_domains=["example.com"], **loopback)


def test_package_imports_nothing_forbidden():
    code = (
        "import sys, common.multimodal;"
        "bad=[m for m in sys.modules if m.split('.')[0] in ('gateway','broker','worker','transformers','torch')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_engine_imports_without_pillow():
    """A GPU box running only the engine may lack Pillow: the workers take resized images
    and must not import it (image loading imports it on first use)."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'PIL' or name.startswith('PIL.'):\n"
        "            raise ModuleNotFoundError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import worker.engine, worker.engine.multimodal.images, common.multimodal as mm\n"
        "assert mm.Qwen2VLImageConfig().resample == 3\n"
        "try:\n"
        "    mm.load_image\n"
        "except ModuleNotFoundError:\n"
        "    print('lazy')\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0 and out.stdout.strip() == "lazy", out.stderr[-2000:]
