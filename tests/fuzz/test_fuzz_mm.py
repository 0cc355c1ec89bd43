"""Seeded fuzz of the image input paths against a real broker, worker (tiny Qwen2-VL) and
gateway (the model folder with a Qwen2-VL chat template, a byte tokenizer):

* ``/inference/v1/generate`` with ``content_parts`` (image URLs: corrupt / truncated /
  non-image data, 1x1 and extreme-aspect images, junk parts, wrong placeholder runs)
  and with ``features`` (vLLM's mm_serde tensors: wrong types, grids, shapes, dtypes,
  bytes, placeholders, duplicate hashes);
* ``/v1/chat/completions``, ``/v1/chat/completions/render`` and ``/tokenize`` with image
  parts (and junk) in the chat messages;
* ``GenerateRequest.mm_items`` sent by a direct ZeroMQ client (the gateway's checks
  skipped: the worker's ``check_mm_items`` must refuse, with a 4xx, what is wrong).

Every answer is 2xx or a 4xx in vLLM's error shape (200 where the case is valid by
construction), never a 5xx, a hang or a dropped request; afterwards every process is
alive and a valid image request returns the same tokens as before the fuzzing.
Cases come from ``random.Random(SEED)``: the same cases on every run.
"""
from __future__ import annotations

import base64
import concurrent.futures
import io
import random
import struct
import zlib

import msgspec
import numpy as np
import pytest

pytest.importorskip("transformers")

import httpx  # noqa: E402
from PIL import Image  # noqa: E402

from common.client import Client, RequestError  # noqa: E402
from common.multimodal import (Qwen2VLImageConfig, check_patchable, load_image, mm_hash,  # noqa: E402
                               preprocess_image, resize_image)
from common.protocol import GenerateRequest, MultiModalItem, SamplingParams  # noqa: E402
from tests.support.gateway_helpers import GENERATE, start_gateway  # noqa: E402
from tests.support.procs import ProcGroup, wait_for_workers  # noqa: E402
from tests.integration.test_mm_chat import model_dir  # noqa: E402,F401  (the chat-template Qwen2-VL folder)
from tests.integration.test_mm_features import _grid_elem, _item, _pixel_elem, _tensor  # noqa: E402
from tests.integration.test_mm_http import _data_url, _png, _prompt  # noqa: E402
from tests.unit.engine.test_qwen2_vl_engine import IMAGE, VSTART  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SEED = 20261204
MAX_TOKENS = 3
WORKER_ARGS = ("--max-model-len", "256", "--max-num-seqs", "8", "--num-kv-blocks", "64", "--threads", "1")
CONTENT_PART_CASES, FEATURE_CASES, CHAT_CASES, ZMQ_CASES = 120, 100, 90, 100
ROUTES = ("/v1/chat/completions", "/v1/chat/completions/render", "/tokenize")


# ----------------------------------------------------------------------------- stack
@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-media")
    (root / "allowed").mkdir()
    (root / "allowed" / "a.png").write_bytes(_png(1, 56, 56))
    (root / "allowed" / "junk.png").write_bytes(b"not a png at all")
    (root / "allowed" / "dir.png").mkdir()
    (root / "outside.png").write_bytes(_png(1, 56, 56))
    return root


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dir, media):  # noqa: F811
    with ProcGroup(tmp_path_factory.mktemp("fuzz-mm")) as procs:
        broker = procs.broker()
        procs.worker(broker, 0, "--model", str(model_dir), *WORKER_ARGS)
        wait_for_workers(broker.frontend, 1, timeout=120)
        gw = start_gateway(procs, broker.frontend, "--tokenizer", str(model_dir),
                           "--allowed-local-media-path", str(media / "allowed"))
        with httpx.Client(base_url=gw.url, timeout=60) as http, Client(broker.frontend) as client:
            stack = dict(procs=procs, http=http, client=client)
            stack["reference"] = _reference(http)
            yield stack


def _reference(http) -> list:
    """Greedy tokens of a valid two-image request (content_parts) and a chat request."""
    ids = _prompt([4, 6])
    body = {"token_ids": ids, "content_parts": [{"type": "image_url", "url": _data_url(_png(1, 56, 56))},
                                                {"type": "image_url", "url": _data_url(_png(2, 84, 56))}],
            "sampling_params": {"temperature": 0, "max_tokens": 6, "ignore_eos": True}}
    gen = http.post(GENERATE, json=body)
    assert gen.status_code == 200, gen.text
    chat = http.post("/v1/chat/completions", json=_chat([_img(_data_url(_png(3, 56, 56))), _text("what?")]))
    assert chat.status_code == 200, chat.text
    return [gen.json()["choices"][0]["token_ids"], chat.json()["choices"][0]["message"]["content"]]


def _chat(parts, **extra) -> dict:
    return {"messages": [{"role": "user", "content": parts}], "temperature": 0, "max_tokens": MAX_TOKENS, **extra}


def _img(url) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _text(text) -> dict:
    return {"type": "text", "text": text}


def _alive(stack) -> None:
    procs = stack["procs"]
    assert all(p.alive() for p in procs.procs), procs.tails()


# ----------------------------------------------------------------------------- checks
OUTCOMES: dict = {}  # status -> count, printed at the end (-s)


def _check(resp: httpx.Response, case, expect_ok: bool = False) -> None:
    OUTCOMES[resp.status_code] = OUTCOMES.get(resp.status_code, 0) + 1
    where = f"{case!r:.600}"
    assert resp.status_code < 500, f"{resp.status_code} {resp.text[:600]}\ncase: {where}"
    if expect_ok:
        assert resp.status_code == 200, f"{resp.text[:600]}\ncase: {where}"
    if resp.status_code >= 400:
        assert resp.status_code < 500
        err = resp.json().get("error")
        assert isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"], resp.text
        assert "param" in err and err.get("code") == resp.status_code, resp.text
        if resp.status_code == 400:
            assert err.get("type") == "BadRequestError", resp.text


# ----------------------------------------------------------------------------- images
def _encode(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def _rgb(seed: int, width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def _png_claiming(width: int, height: int) -> bytes:
    """A 1x1 PNG whose IHDR claims ``width x height`` (a decompression bomb's header)."""
    png = bytearray(_encode(_rgb(0, 1, 1), "PNG"))
    ihdr = bytearray(png[12:29])  # b"IHDR" + 13 bytes
    ihdr[4:12] = struct.pack(">II", width, height)
    png[12:29] = ihdr
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(png)


def _corrupt(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    how = rng.randrange(3)
    if how == 0:
        return bytes(data[:rng.randrange(1, len(data))])
    if how == 1:
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(8, len(data))] = rng.randrange(256)
        return bytes(data)
    start = rng.randrange(8, len(data))
    return bytes(data[:start] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))))


def _url_pool(rng: random.Random, media, cfg: Qwen2VLImageConfig) -> list[tuple]:
    """(url value, placeholder tokens it needs or None when the gateway must refuse it)."""

    def need(data: bytes):
        try:
            img = resize_image(load_image(_data_url(data), allowed_local_media_path=None), cfg)
            grid = check_patchable(img.shape[0], img.shape[1], cfg)
        except Exception:
            return None
        if grid[0] * grid[1] * grid[2] > cfg.max_pixels // (14 * 14):
            return None  # past max_pixels (a thin image scaled up to min_pixels): refused
        return grid[0] * grid[1] * grid[2] // 4

    png, jpeg = _png(11, 56, 56), _encode(_rgb(12, 70, 42), "JPEG")
    good = {
        "png 56x56": png, "png 84x56": _png(13, 84, 56), "jpeg 70x42": jpeg, "1x1 png": _png(14, 1, 1),
        "gray png": _encode(Image.new("L", (40, 60), 128), "PNG"),
        "rgba png": _encode(Image.new("RGBA", (30, 30), (1, 2, 3, 0)), "PNG"),
        "palette gif": _encode(Image.new("P", (57, 29)), "GIF"), "bmp": _encode(_rgb(15, 33, 33), "BMP"),
        "aspect 150 (1x150)": _encode(_rgb(16, 150, 1), "PNG"),
        "aspect 190 (190x1)": _encode(_rgb(17, 1, 190), "PNG"),
        "aspect 250 (1x250)": _encode(_rgb(18, 250, 1), "PNG"), "aspect 300 (300x1)": _encode(_rgb(19, 1, 300), "PNG"),
        "tall 2x800": _encode(_rgb(20, 2, 800), "PNG"),
    }
    pool = [(_data_url(v), need(v), name) for name, v in good.items()]
    pool += [(_data_url(_corrupt(rng, png)), None, "corrupt png") for _ in range(4)]
    pool += [(_data_url(_corrupt(rng, jpeg)), None, "corrupt jpeg") for _ in range(3)]
    # corrupt data may still decode (a flipped byte in JPEG data): ask the loader what it needs
    pool = [(u, need(base64.b64decode(u.split(",", 1)[1])) if n is None and "corrupt" in name else n, name)
            for u, n, name in pool]
    b64 = base64.b64encode(png).decode()
    pool += [
        ("data:image/png;base64," + b64[:-3], None, "truncated base64"),
        ("data:image/png;base64," + b64[: len(b64) // 2], None, "half base64"),
        ("data:image/png;base64,@@not base64@@", None, "garbage base64"),
        ("data:image/png;base64," + base64.b64encode(bytes(rng.randrange(256) for _ in range(64))).decode(), None,
         "random bytes"),
        ("data:text/plain;base64," + base64.b64encode(b"hello world").decode(), None, "text data url"),
        ("data:application/pdf;base64," + base64.b64encode(b"%PDF-1.4\n%%EOF").decode(), None, "pdf data url"),
        ("data:image/png," + "x" * 20, None, "data url without base64"),
        ("data:image/png;base64", None, "data url without comma"),
        ("data:", None, "bare data:"), ("data:image/png;base64,", None, "empty payload"),
        (_data_url(_png_claiming(20000, 20000)), None, "bomb header 20000x20000"),
        (_data_url(_png_claiming(0, 5)), None, "zero-width header"),
        ("data:image/svg+xml;base64," + base64.b64encode(b"<svg xmlns='http://www.w3.org/2000/svg'/>").decode(),
         None, "svg"),
        ((media / "allowed" / "a.png").as_uri(), 4, "allowed file"),
        ((media / "allowed" / "junk.png").as_uri(), None, "allowed junk file"),
        ((media / "allowed" / "dir.png").as_uri(), None, "allowed directory"),
        ((media / "allowed" / "missing.png").as_uri(), None, "missing file"),
        ((media / "outside.png").as_uri(), None, "outside file"),
        ((media / "allowed" / ".." / "outside.png").as_uri(), None, "dotdot file"),
        ("file:///etc/passwd", None, "/etc/passwd"), ("http://127.0.0.1:1/x.png", None, "http disabled"),
        ("ftp://x/y.png", None, "ftp"), ("not a url", None, "not a url"), ("", None, "empty string"),
        (5, None, "int"), (None, None, "null"), ([_data_url(png)], None, "list"), ({"url": 1}, None, "dict"),
        (True, None, "bool"), ("\x00", None, "nul"),
    ]
    return pool


JUNK = [None, True, 0, -1, 2 ** 64, 1e308, "", "x", "\ud7ff", [], [None], {}, {"a": {"b": [1, {"c": None}]}},
        [[[[]]]], {"type": "image_url"}, {"url": None}]


# ----------------------------------------------------------------------------- content_parts
def _part(rng: random.Random, url) -> tuple[object, bool]:
    """A content part holding ``url`` (and whether its shape is valid)."""
    r = rng.random()
    if r < 0.4:
        return {"type": "image_url", "url": url}, True
    if r < 0.75:
        return {"type": "image_url", "image_url": {"url": url}}, True
    junk = [rng.choice(JUNK), {"type": rng.choice(["audio_url", "video_url", "text", "input_image", "", 7, None])},
            {"type": "image_url"}, {"type": "image_url", "image_url": rng.choice(JUNK)},
            {"type": "image_url", "image_url": {"url": rng.choice(JUNK)}, "url": rng.choice(JUNK)},
            {"type": ["image_url"], "url": url}, {"image_url": {"url": url}},
            {"type": "image_url", "image_url": {"url": {"url": url}}}]
    return rng.choice(junk), False


def _runs(rng: random.Random, needs: list) -> tuple[list[int], bool]:
    """token_ids with one placeholder run per image (mostly right, sometimes not)."""
    counts = [n if n is not None else rng.choice([1, 4]) for n in needs]
    ok = True
    r = rng.random()
    if r < 0.55:
        return _prompt(counts), ok
    if r < 0.65 and counts:
        k = rng.randrange(len(counts))
        counts[k] = max(0, counts[k] + rng.choice([-1, 1, 7]))
        return _prompt(counts), False
    if r < 0.75:
        return _prompt(counts + [rng.choice([1, 4])]), False  # one run too many
    if r < 0.85 and counts:
        return _prompt(counts[:-1]), False  # one too few
    ids = _prompt(counts)
    if IMAGE in ids:  # split a run or put a stray placeholder elsewhere
        pos = ids.index(IMAGE) + rng.randrange(1, 4)
        ids.insert(pos, rng.choice([VSTART, 5]))
    else:
        ids.insert(rng.randrange(len(ids)), IMAGE)
    return ids, False


def _generate_case(rng: random.Random, pool: list) -> tuple[dict, bool]:
    n = rng.choice([0, 1, 1, 1, 2, 2, 3])
    picks = [rng.choice(pool) for _ in range(n)]
    parts, valid = [], True
    for url, need, _ in picks:
        part, ok = _part(rng, url)
        parts.append(part)
        valid &= ok and need is not None
    ids, ok = _runs(rng, [need for _, need, _ in picks])
    valid &= ok
    body = {"token_ids": ids, "content_parts": parts,
            "sampling_params": {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}}
    r = rng.random()
    if r < 0.08:
        body["content_parts"] = rng.choice(JUNK + ["image", 5, {"type": "image_url"}])
        valid = False
    elif r < 0.14:
        body["features"] = rng.choice([{}, {"mm_hashes": {"image": ["h"]}}, "x", [1]])
        valid = False
    elif r < 0.2:
        body["stream"] = True
    if not n and not isinstance(body.get("content_parts"), list) and IMAGE not in ids:
        valid = False  # a plain request is fine too, but do not claim anything
    return body, valid and bool(n)


def test_fuzz_generate_content_parts(stack, media, model_dir):  # noqa: F811
    rng = random.Random(SEED)
    pool = _url_pool(rng, media, Qwen2VLImageConfig.from_model_dir(model_dir))
    for name_url in pool:  # every url once, in a well-formed request
        url, need, name = name_url
        ids = _prompt([need if need is not None else 4])
        body = {"token_ids": ids, "content_parts": [{"type": "image_url", "url": url}],
                "sampling_params": {"max_tokens": MAX_TOKENS}}
        _check(stack["http"].post(GENERATE, json=body), name, expect_ok=need is not None)
    for _ in range(CONTENT_PART_CASES):
        body, valid = _generate_case(rng, pool)
        _check(stack["http"].post(GENERATE, json=body), body, expect_ok=valid)
    _alive(stack)


# ----------------------------------------------------------------------------- features
def _good_features(cfg, ids, pngs, hashes=None) -> dict:
    runs = [i for i, t in enumerate(ids) if t == IMAGE and (i == 0 or ids[i - 1] != IMAGE)]
    kwargs, places = [], []
    for offset, png in zip(runs, pngs):
        pixels, grid = preprocess_image(load_image(_data_url(png), allowed_local_media_path=None), cfg)
        kwargs.append(_item({"pixel_values": _pixel_elem(pixels), "image_grid_thw": _grid_elem(grid)}))
        places.append({"offset": offset, "length": grid[0] * grid[1] * grid[2] // 4})
    return {"mm_hashes": {"image": hashes or [f"h{k}" for k in range(len(pngs))]},
            "mm_placeholders": {"image": places}, "kwargs_data": {"image": kwargs}}


def _bad_item(rng: random.Random, cfg, png) -> str:
    """A kwargs_data item with one thing wrong (or a payload that is not an item)."""
    pixels, grid = preprocess_image(load_image(_data_url(png), allowed_local_media_path=None), cfg)
    pixels = np.asarray(pixels, "<f4")
    grid_arr = np.asarray(grid, "<i8")
    pv, gr = _pixel_elem(pixels), _grid_elem(grid)
    choice = rng.randrange(16)
    if choice == 0:
        gr = {"data": _tensor(np.asarray(rng.choice([[0, 4, 4], [-1, 4, 4], [1, 2 ** 40, 2], [1, 4], [1, 4, 4, 1],
                                                     [1, 3, 4], [2, 4, 4], [1, 2 ** 20, 2 ** 20]]), "<i8"), "int64"),
              "field": ["batched", {}]}
    elif choice == 1:
        gr = {"data": _tensor(grid_arr.astype("<f4"), "float32"), "field": ["batched", {}]}
    elif choice == 2:
        pv = {"data": _tensor(pixels.astype("<f2"), "float16"), "field": ["flat", {}]}  # a valid dtype
    elif choice == 3:
        pv = {"data": _tensor((pixels.view("<u4") >> 16).astype("<u2"), "bfloat16"), "field": ["flat", {}]}
    elif choice == 4:
        pv = {"data": _tensor(pixels.astype("<i8"), "int64"), "field": ["flat", {}]}
    elif choice == 5:
        pv = {"data": [rng.choice(["complex64", "float8", "", "torch.float32"]), list(pixels.shape),
                       msgspec.msgpack.Ext(3, pixels.tobytes())], "field": ["flat", {}]}
    elif choice == 6:
        pv = {"data": ["float32", list(pixels.shape), msgspec.msgpack.Ext(3, pixels.tobytes()[:-rng.randint(1, 9)])],
              "field": ["flat", {}]}
    elif choice == 7:
        pv = {"data": ["float32", rng.choice([[-1, 1176], [2 ** 32, 2 ** 32], [], [0], [16, 1176, 1], [1176, 16]]),
                       msgspec.msgpack.Ext(3, pixels.tobytes())], "field": ["flat", {}]}
    elif choice == 8:
        bad = pixels.copy()
        bad[rng.randrange(bad.shape[0]), 0] = rng.choice([np.nan, np.inf, -np.inf])
        pv = _pixel_elem(bad)
    elif choice == 9:
        pv = {"data": rng.choice(JUNK), "field": ["flat", {}]}
    elif choice == 10:
        pv = {"data": ["float32", list(pixels.shape), rng.choice([0, {"idx": 0}, "bytes", None])], "field": []}
    elif choice == 11:
        pv = {"data": msgspec.msgpack.Ext(rng.choice([1, 2, 4, 99]), b"cos\nsystem\n."), "field": ["flat", {}]}
    elif choice == 12:
        return base64.b64encode(msgspec.msgpack.encode(rng.choice(JUNK))).decode()
    elif choice == 13:
        return base64.b64encode(bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))).decode()
    elif choice == 14:
        return rng.choice(["@@", "A", "AAA", "====", _item({"pixel_values": pv, "image_grid_thw": gr})[:-5]])
    else:
        return _item({"pixel_values": pv, "image_grid_thw": gr, rng.choice(["image_embeds", "", "x" * 99]): pv})
    return _item({"pixel_values": pv, "image_grid_thw": gr})


def _features_case(rng: random.Random, cfg) -> tuple[dict, bool]:
    pngs = [_png(31, 56, 56), _png(32, 84, 56)][: rng.choice([1, 2])]
    counts = [4, 6][: len(pngs)]
    ids = _prompt(counts)
    feats = _good_features(cfg, ids, pngs)
    body = {"token_ids": ids, "features": feats,
            "sampling_params": {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}}
    r = rng.randrange(12)
    if r == 0:
        return body, True
    if r == 1:  # a field of the wrong type
        key = rng.choice(["mm_hashes", "mm_placeholders", "kwargs_data", "mm_metadata", "nonsense"])
        feats[key] = rng.choice(JUNK + [{"image": rng.choice(JUNK)}, {"video": []}, {"image": [], "audio": []}])
    elif r == 2:  # a hash of the wrong type / size
        feats["mm_hashes"]["image"][0] = rng.choice(JUNK + ["h" * 257, "\x00"])
    elif r == 3:  # placeholders: wrong types, zero/negative/huge, overlapping, past the end
        p = feats["mm_placeholders"]["image"]
        p[rng.randrange(len(p))] = rng.choice(
            JUNK + [{"offset": -1, "length": 4}, {"offset": 5, "length": 0}, {"offset": 2 ** 70, "length": 4},
                    {"offset": len(ids) - 2, "length": 4}, {"offset": 5.0, "length": 4}, {"offset": True, "length": 4},
                    {"offset": p[0]["offset"] + 1, "length": 4}, {"length": 4}, {"offset": 5, "length": -4}])
    elif r == 4 and len(pngs) == 2:  # two placeholders overlapping / swapped
        p = feats["mm_placeholders"]["image"]
        if rng.random() < 0.5:
            p[1] = dict(p[0])
        else:
            p.reverse()
            feats["kwargs_data"]["image"].reverse()
    elif r == 5:  # a bad tensor payload
        k = rng.randrange(len(pngs))
        feats["kwargs_data"]["image"][k] = _bad_item(rng, cfg, pngs[k])
    elif r == 6:  # metadata junk / overriding the grid
        feats["mm_metadata"] = {"image": [rng.choice([None, "AA==", _item({"image_grid_thw": _grid_elem([1, 2, 2])}),
                                                      _item({"image_grid_thw": _grid_elem([1, 4, 4])})])
                                          for _ in pngs]}
    elif r == 7:  # content_parts with features
        body["content_parts"] = rng.choice([[{"type": "image_url", "url": _data_url(pngs[0])}], [], JUNK[3]])
    elif r == 8:  # placeholder tokens that are not covered / a prompt without any
        body["token_ids"] = rng.choice([_prompt([]), _prompt(counts + [4]), [5, 6, 7], [IMAGE] * 10])
    elif r == 9:  # duplicate hash, different content (and size)
        feats["mm_hashes"]["image"] = ["same"] * len(pngs)
        if len(pngs) == 1:
            return body, True
    elif r == 10:  # counts that do not match
        feats["mm_hashes"]["image"].append("extra")
    else:  # a modality that is not served, and an item without kwargs
        feats[rng.choice(["kwargs_data", "mm_hashes"])] = {"image": [None] * len(pngs)}
    return body, r == 9  # duplicated hashes are the client's promise: served as vLLM does


def test_fuzz_generate_features(stack, model_dir):  # noqa: F811
    rng = random.Random(SEED + 1)
    cfg = Qwen2VLImageConfig.from_model_dir(model_dir)
    for _ in range(FEATURE_CASES):
        body, valid = _features_case(rng, cfg)
        _check(stack["http"].post(GENERATE, json=body), body, expect_ok=valid)
    _alive(stack)


def test_same_hash_different_images_in_one_step(stack, model_dir):  # noqa: F811
    """Two requests (and one request with two images) naming one hash for images of
    different sizes: the second must not get the first's embeddings (wrong row count)."""
    cfg = Qwen2VLImageConfig.from_model_dir(model_dir)
    http = stack["http"]
    a, b = _png(41, 56, 56), _png(42, 84, 56)
    one = {"token_ids": _prompt([4, 6]), "features": _good_features(cfg, _prompt([4, 6]), [a, b], ["dup", "dup"]),
           "sampling_params": {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}}
    _check(http.post(GENERATE, json=one), "one request, one hash, two sizes")
    bodies = [{"token_ids": _prompt([n]), "features": _good_features(cfg, _prompt([n]), [png], ["dup2"]),
               "sampling_params": {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}}
              for n, png in ((4, a), (6, b))]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for resp in pool.map(lambda body: http.post(GENERATE, json=body), bodies * 3):
            _check(resp, "concurrent requests, one hash, two sizes")
    _alive(stack)


# ----------------------------------------------------------------------------- chat routes
def _chat_part(rng: random.Random, pool: list):
    r = rng.random()
    url, need, _ = rng.choice(pool)
    if r < 0.35:
        return _img(url), need is not None
    if r < 0.5:
        return _text(rng.choice(["hi", "", "<|image_pad|>", "<|vision_start|>", "x" * 50])), True
    return rng.choice([
        rng.choice(JUNK), {"type": "image_url", "image_url": rng.choice(JUNK)}, {"image_url": {"url": url}},
        {"type": "image_url", "image_url": url}, {"type": "image_url", "image_url": {"url": url, "detail": [1]}},
        {"type": "image", "image": url}, {"type": "input_image", "image_url": url},
        {"type": "image_url", "url": url}, {"type": rng.choice(["audio_url", "video_url", "file", "image_embeds"])},
        {"type": "text", "text": rng.choice(JUNK)}, {"type": "image_url", "image_url": {"url": url}, "text": "x"},
        {"type": {"nested": [{"type": "image_url"}]}, "image_url": {"url": url}},
        {"type": "text", "text": "a", "image_url": {"url": url}},
    ]), False


def _chat_case(rng: random.Random, pool: list) -> tuple[dict, bool]:
    parts, valid = [], True
    for _ in range(rng.randint(0, 4)):
        part, ok = _chat_part(rng, pool)
        parts.append(part)
        valid &= ok
    messages = [{"role": "user", "content": parts}]
    if rng.random() < 0.2:
        messages.insert(0, {"role": rng.choice(["system", "assistant", "user"]),
                            "content": rng.choice([[_img(rng.choice(pool)[0])], [_text("a")], JUNK[-4], "text"])})
        valid = False  # may or may not be accepted
    if rng.random() < 0.1:
        messages = rng.choice([messages[0], [messages], [{"role": "user", "content": {"type": "image_url"}}]])
        valid = False
    return {"messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS}, valid and bool(parts)


def test_fuzz_chat_routes(stack, media, model_dir):  # noqa: F811
    rng = random.Random(SEED + 2)
    pool = _url_pool(rng, media, Qwen2VLImageConfig.from_model_dir(model_dir))
    for k in range(CHAT_CASES):
        body, valid = _chat_case(rng, pool)
        route = ROUTES[k % 3]
        if route == "/tokenize":
            body = {"messages": body["messages"]}
        _check(stack["http"].post(route, json=body), (route, body), expect_ok=valid)
    _alive(stack)


# ----------------------------------------------------------------------------- direct ZMQ clients
def _wire_item(cfg, png, offset, encoding) -> MultiModalItem:
    if encoding == "uint8_hwc":
        image = resize_image(load_image(_data_url(png), allowed_local_media_path=None), cfg)
        grid = check_patchable(image.shape[0], image.shape[1], cfg)
        pixels = np.ascontiguousarray(image, np.uint8)
    else:
        pixels, grid = preprocess_image(load_image(_data_url(png), allowed_local_media_path=None), cfg)
        pixels = np.ascontiguousarray(pixels, "<f4")
    return MultiModalItem(modality="image", mm_hash=mm_hash(pixels, grid), offset=offset,
                          length=grid[0] * grid[1] * grid[2] // 4, grid_thw=list(grid),
                          pixel_values=pixels.tobytes(), shape=list(pixels.shape), encoding=encoding)


WILD_INTS = [0, -1, 1, 2, 3, 7, 2 ** 31, 2 ** 63 - 1, -2 ** 63, 2 ** 64 - 1]


def _mutate_item(rng: random.Random, it: MultiModalItem, typed: bool) -> None:
    field = rng.choice(["modality", "mm_hash", "offset", "length", "grid_thw", "pixel_values", "shape", "encoding"])
    if not typed:  # anything at all: the broker's decoder refuses it
        setattr(it, field, rng.choice([j for j in JUNK if j != 2 ** 64] + [b"x", 1.5]))
        return
    if field in ("modality", "encoding", "mm_hash"):
        setattr(it, field, rng.choice(["", "image", "video", "audio", "float32", "uint8_hwc", "float16", "IMAGE",
                                       "\x00", "x" * 300]))
    elif field in ("offset", "length"):
        value = getattr(it, field)
        setattr(it, field, rng.choice(WILD_INTS + ([value + rng.choice([-1, 1])] if abs(value) < 2 ** 40 else [])))
    elif field in ("grid_thw", "shape"):
        setattr(it, field, rng.choice([[], [1], [1, 4], [1, 4, 4, 4], [0, 4, 4], [1, -4, 4], [2, 4, 4], [1, 4, 6],
                                       [1, 2 ** 31, 2 ** 31], [2 ** 63 - 1] * 3, [1, 3, 4], [1, 6, 4], [56, 56, 3],
                                       [16, 1176], [1176, 16], [56, 56], [56, 56, 3, 1], [-56, -56, 3]]))
    else:
        pv = it.pixel_values
        it.pixel_values = rng.choice([b"", pv[:-1], pv + b"\0", pv[: len(pv) // 2], b"\xff" * len(pv),
                                      np.full(len(pv) // 4, np.nan, "<f4").tobytes()])


def _zmq_case(rng: random.Random, cfg, k: int) -> tuple[GenerateRequest, bool]:
    pngs = [_png(51, 56, 56), _png(52, 84, 56)][: rng.choice([1, 2])]
    ids = _prompt([4, 6][: len(pngs)])
    runs = [i for i, t in enumerate(ids) if t == IMAGE and (i == 0 or ids[i - 1] != IMAGE)]
    items = [_wire_item(cfg, png, off, rng.choice(["uint8_hwc", "float32"])) for png, off in zip(pngs, runs)]
    valid = True
    r = rng.random()
    if r < 0.1:
        pass
    elif r < 0.65:
        for _ in range(rng.randint(1, 2)):
            _mutate_item(rng, rng.choice(items), typed=True)
        valid = False
    elif r < 0.72:
        _mutate_item(rng, rng.choice(items), typed=False)
        valid = False
    elif r < 0.8:  # items on a prompt without placeholders / placeholders without items
        if rng.random() < 0.5:
            ids = [5, 6, 7, 8, 9, 10]
        else:
            items = []
        valid = False
    elif r < 0.88:  # duplicated / swapped / overlapping items
        if rng.random() < 0.5:
            items.append(items[0])
        elif len(items) == 2:
            items[1].offset = items[0].offset + 1
        valid = False
    else:  # one hash for different content (of another size when there are two)
        for it in items:
            it.mm_hash = f"dup-{k % 3}"
    req = GenerateRequest(request_id=f"fuzz-mm-{k}", prompt_token_ids=ids, mm_items=items,
                          params=SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=MAX_TOKENS,
                                                ignore_eos=True, seed=k))
    return req, valid


def _direct(client: Client, req: GenerateRequest, timeout: float = 30):
    """The request's deltas or its RequestError; a TimeoutError is a silent drop."""
    def run():
        try:
            return list(client.generate(req))
        except RequestError as exc:
            return exc
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(run).result(timeout)
    except concurrent.futures.TimeoutError:
        raise AssertionError(f"no answer within {timeout}s (dropped): {req.request_id}") from None
    finally:
        pool.shutdown(wait=False)


def test_fuzz_direct_zmq_mm_items(stack, model_dir):  # noqa: F811
    rng = random.Random(SEED + 3)
    cfg = Qwen2VLImageConfig.from_model_dir(model_dir)
    reqs = [_zmq_case(rng, cfg, k) for k in range(ZMQ_CASES)]
    # in waves of a few at once: bad items share steps with good ones (and with each other)
    pool = concurrent.futures.ThreadPoolExecutor(4)
    try:
        _wave(stack, pool, reqs)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    _alive(stack)


def _wave(stack, pool, reqs) -> None:
    futures = [pool.submit(_direct, stack["client"], req) for req, _ in reqs]
    for (req, valid), fut in zip(reqs, futures):
        out = fut.result(60)
        where = f"{req.request_id}: {[(it.modality, str(it.mm_hash)[:12], it.offset, it.length, it.grid_thw, it.shape, it.encoding, len(it.pixel_values) if isinstance(it.pixel_values, bytes) else it.pixel_values) for it in req.mm_items or []]} prompt {req.prompt_token_ids}"  # noqa: E501
        if isinstance(out, RequestError):
            OUTCOMES[f"zmq {out.status}"] = OUTCOMES.get(f"zmq {out.status}", 0) + 1
            assert 400 <= out.status < 500 and not valid, f"{out.status} {out}\n{where}"
        else:
            OUTCOMES["zmq ok"] = OUTCOMES.get("zmq ok", 0) + 1
            assert out and out[-1].finish_reason is not None, where


def test_wrong_types_from_a_direct_client_get_a_400(stack, model_dir):  # noqa: F811
    """A well-framed GENERATE whose mm_items hold a value of the wrong type does not decode
    in the broker: its sender gets a 400 naming the field, not silence."""
    cfg = Qwen2VLImageConfig.from_model_dir(model_dir)
    ids = _prompt([4])
    it = _wire_item(cfg, _png(70, 56, 56), ids.index(IMAGE), "uint8_hwc")
    it.grid_thw = "1x4x4"
    req = GenerateRequest(request_id="wrong-type", prompt_token_ids=ids, mm_items=[it],
                          params=SamplingParams(max_tokens=MAX_TOKENS))
    out = _direct(stack["client"], req, timeout=10)
    assert isinstance(out, RequestError) and out.status == 400, out
    assert "malformed GENERATE request" in str(out), str(out)
    _alive(stack)


def test_non_finite_pixels_direct(stack, model_dir):  # noqa: F811
    """float32 patches holding NaN / inf (the gateway refuses them in ``features``; a
    direct client skips it), sampled with temperature 1 next to a good request."""
    cfg = Qwen2VLImageConfig.from_model_dir(model_dir)
    ids = _prompt([4])
    pool = concurrent.futures.ThreadPoolExecutor(4)
    try:
        futures = []
        for k, bad in enumerate([np.nan, np.inf, -np.inf, 3e38]):
            it = _wire_item(cfg, _png(60 + k, 56, 56), ids.index(IMAGE), "float32")
            pixels = np.frombuffer(it.pixel_values, "<f4").copy()
            pixels[:: 7 + k] = bad
            it.pixel_values = pixels.tobytes()
            for temperature in (0.0, 1.0):
                req = GenerateRequest(request_id=f"nonfinite-{k}-{temperature}", prompt_token_ids=ids, mm_items=[it],
                                      params=SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS,
                                                            ignore_eos=True, seed=1))
                futures.append(pool.submit(_direct, stack["client"], req))
            good = GenerateRequest(request_id=f"bystander-{k}", prompt_token_ids=[5, 6, 7],
                                   params=SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True))
            futures.append(pool.submit(_direct, stack["client"], good))
        for fut in futures:
            out = fut.result(60)
            if isinstance(out, RequestError):
                assert 400 <= out.status < 500, out
            else:
                assert out and out[-1].finish_reason is not None
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    _alive(stack)


# ----------------------------------------------------------------------------- afterwards
def test_everyone_alive_and_serving_the_same(stack):
    print("outcomes:", OUTCOMES)
    _alive(stack)
    assert _reference(stack["http"]) == stack["reference"]
    plain = stack["http"].post(GENERATE, json={"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3}})
    assert plain.status_code == 200, plain.text
