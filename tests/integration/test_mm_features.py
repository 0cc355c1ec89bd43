"""``features`` on /inference/v1/generate: pre-processed image tensors in vLLM 0.32's wire
form (``MultiModalFeatures``; items serialized as vLLM's ``mm_serde`` /
``MsgpackEncoder(size_threshold=2**62)`` does: base64 of msgpack
``{key: {"data": [dtype, shape, ext(3, raw bytes)], "field": [factory, kwargs]}}``),
against the same image sent as ``content_parts``, on the stack of tests/integration/test_mm_http.py."""
from __future__ import annotations

import base64

import msgspec
import numpy as np
import pytest

pytest.importorskip("transformers")

from common.multimodal import Qwen2VLImageConfig, load_image, preprocess_image  # noqa: E402
from tests.support.gateway_helpers import GENERATE  # noqa: E402
from tests.integration.test_mm_http import (  # noqa: E402,F401
    MAX_TOKENS, _body, _data_url, _error, _part, _png, _prompt, gw, media, model_dir,
)
from tests.unit.engine.test_qwen2_vl_engine import IMAGE  # noqa: E402

_ENC = msgspec.msgpack.Encoder()


# ---- vLLM's encoding, re-implemented (vllm/v1/serial_utils.py MsgpackEncoder, mm_serde.py)

def _tensor(arr: np.ndarray, dtype: str):
    # _encode_tensor: (str(dtype) without "torch.", shape, Ext(CUSTOM_TYPE_RAW_VIEW=3, bytes))
    return [dtype, list(arr.shape), msgspec.msgpack.Ext(3, np.ascontiguousarray(arr).tobytes())]


def _item(fields: dict) -> str:
    # _encode_mm_item -> {key: {"data": ..., "field": (factory name, dataclass fields)}}; b64
    return base64.b64encode(_ENC.encode(fields)).decode("ascii")


def _pixel_elem(pixels):
    n = pixels.shape[0]
    return {"data": _tensor(np.asarray(pixels, "<f4"), "float32"),
            "field": ["flat", {"keep_on_cpu": False, "slices": [[0, n, None]], "dim": 0}]}


def _grid_elem(grid):
    return {"data": _tensor(np.asarray(grid, "<i8"), "int64"), "field": ["batched", {"keep_on_cpu": True}]}


def _processed(model_dir, png):
    cfg = Qwen2VLImageConfig.from_model_dir(model_dir)
    return preprocess_image(load_image(_data_url(png), allowed_local_media_path=None), cfg)


def _features(model_dir, ids, pngs, *, metadata=True):
    runs = [i for i, t in enumerate(ids) if t == IMAGE and (i == 0 or ids[i - 1] != IMAGE)]
    kwargs, meta, places = [], [], []
    for k, (offset, png) in enumerate(zip(runs, pngs)):
        pixels, grid = _processed(model_dir, png)
        kwargs.append(_item({"pixel_values": _pixel_elem(pixels), "image_grid_thw": _grid_elem(grid)}))
        meta.append(_item({"image_grid_thw": _grid_elem(grid)}))  # the keep_on_cpu subset
        places.append({"offset": offset, "length": grid[0] * grid[1] * grid[2] // 4})
    out = {"mm_hashes": {"image": [f"hash{k}" for k in range(len(pngs))]},
           "mm_placeholders": {"image": places}, "kwargs_data": {"image": kwargs}}
    if metadata:
        out["mm_metadata"] = {"image": meta}
    return out


def _fbody(ids, features, **extra):
    return {"token_ids": ids, "features": features,
            "sampling_params": {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}, **extra}


def test_features_match_content_parts(gw, model_dir):
    _, http = gw
    pngs = [_png(3, 56, 56), _png(4, 84, 56)]
    ids = _prompt([4, 6])
    ref = http.post(GENERATE, json=_body(ids, [_part(_data_url(p)) for p in pngs], return_token_ids=True))
    assert ref.status_code == 200, ref.text
    expected = ref.json()["choices"][0]["token_ids"]
    assert len(expected) == MAX_TOKENS

    for metadata in (True, False):
        resp = http.post(GENERATE, json=_fbody(ids, _features(model_dir, ids, pngs, metadata=metadata),
                                              return_token_ids=True))
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert out["choices"][0]["token_ids"] == expected
        assert out["mm_placeholders"] == ref.json()["mm_placeholders"]


def test_features_refusals(gw, model_dir):
    procs, http = gw
    png = _png(5, 56, 56)
    ids = _prompt([4])
    good = _features(model_dir, ids, [png])

    msg = _error(http.post(GENERATE, json={**_fbody(ids, good), "content_parts": [_part(_data_url(png))]}))
    assert "content_parts and features are mutually exclusive" in msg

    meta_only = {**good, "kwargs_data": None}
    assert "metadata-only multimodal items require ec_transfer_params" in _error(
        http.post(GENERATE, json=_fbody(ids, meta_only)))
    assert "names no encoder worker for its mm_hash 'hash0'" in _error(
        http.post(GENERATE, json=_fbody(ids, meta_only, ec_transfer_params={"x": 1})))

    audio = {"mm_hashes": {"audio": ["a"]}, "mm_placeholders": {"audio": [{"offset": 0, "length": 1}]},
             "kwargs_data": {"audio": ["AA=="]}}
    assert "audio input is not supported" in _error(http.post(GENERATE, json=_fbody(ids, audio)))

    # placeholders: wrong length for the grid, and a range that is not image tokens
    wrong = {**good, "mm_placeholders": {"image": [{"offset": good["mm_placeholders"]["image"][0]["offset"],
                                                    "length": 3}]}}
    assert "placeholder count mismatch" in _error(http.post(GENERATE, json=_fbody(ids, wrong)))
    shifted = {**good, "mm_placeholders": {"image": [{"offset": 0, "length": 4}]}}
    assert "placeholder mismatch" in _error(http.post(GENERATE, json=_fbody(ids, shifted)))
    assert "placeholder count mismatch" in _error(http.post(GENERATE, json=_fbody(_prompt([5]), good)))

    # malformed tensor payloads: not base64, not msgpack, truncated bytes, pickle ext, unknown field
    pixels, grid = _processed(model_dir, png)
    bad_items = {
        "@@not base64@@": "cannot decode",
        base64.b64encode(b"\xc1\xc1").decode(): "cannot decode",
        _item({"pixel_values": {"data": ["float32", list(pixels.shape), msgspec.msgpack.Ext(3, b"\0" * 8)],
                                "field": ["flat", {}]}, "image_grid_thw": _grid_elem(grid)}): "bytes",
        _item({"pixel_values": {"data": msgspec.msgpack.Ext(1, b"cos\nsystem\n."), "field": ["flat", {}]},
               "image_grid_thw": _grid_elem(grid)}): "pickle-serialized",
        _item({"image_embeds": _pixel_elem(pixels), "image_grid_thw": _grid_elem(grid)}): "image_embeds",
        _item({"pixel_values": _pixel_elem(pixels)}): "missing image_grid_thw",
        _item({"pixel_values": _pixel_elem(pixels[:-1]), "image_grid_thw": _grid_elem(grid)}): "must be a float",
    }
    for payload, needle in bad_items.items():
        body = _fbody(ids, {**good, "kwargs_data": {"image": [payload]}, "mm_metadata": None})
        assert needle in _error(http.post(GENERATE, json=body)), needle

    assert "at most 256" in _error(http.post(GENERATE, json=_fbody(ids, {**good, "mm_hashes": {"image": ["h" * 300]}})))
    assert "mm_placeholders" in _error(http.post(GENERATE, json=_fbody(ids, {"mm_hashes": {"image": ["h"]}})))

    # everyone is still up and serves
    assert all(p.alive() for p in procs.procs), procs.tails()
    again = http.post(GENERATE, json=_fbody(ids, good))
    assert again.status_code == 200, again.text
    assert len(again.json()["choices"][0]["token_ids"]) == MAX_TOKENS
