"""``features`` of ``/inference/v1/generate``: pre-processed image tensors from a renderer
that ran elsewhere (vLLM 0.32's ``MultiModalFeatures``, as TRL sends them).

Wire form (vLLM ``entrypoints/scale_out/token_in_token_out/{protocol,mm_features,mm_serde}.py``)::

    features = {"mm_hashes":       {modality: [hash str, ...]},
                "mm_placeholders": {modality: [{"offset": int, "length": int}, ...]},
                "kwargs_data":     {modality: [item str | null, ...]} | null,
                "mm_metadata":     {modality: [item str | null, ...]} | null}

An item string is ``base64(msgpack(MultiModalKwargsItem))`` as vLLM's ``MsgpackEncoder``
writes it with every tensor inline: a map ``{key: {"data": tensor, "field": [factory,
factory_kwargs]}}`` where a tensor is ``[torch dtype name, shape, ext(3, raw C-order
bytes)]``.  Only that safe subset is parsed here: the pickle / cloudpickle extension types
(1, 2: vLLM's insecure-serialization fallback) and out-of-band buffer indices are refused
with a 400, never unpickled.  For the Qwen2-VL family an image item holds ``pixel_values``
(``[t*h*w, C*T*P*P]``) and ``image_grid_thw`` (``[3]``); ``mm_metadata`` items (the
``keep_on_cpu`` subset, e.g. the grid) are merged over them, as vLLM does.

Each item becomes the same wire ``MultiModalItem`` content_parts produce
(gateway/multimodal.py).  Its ``mm_hash`` is the client's hash string, namespaced
(``features:``) so that it can never alias the gateway's own content hashes.
"""
from __future__ import annotations

import base64
import binascii
from typing import Any

import msgspec
import numpy as np

from common.errors import BadRequest
from common.multimodal import features_hash, num_placeholder_tokens
from common.protocol import MultiModalItem

PARAM = "features"
MAX_HASH_CHARS = 256
_RAW_VIEW = 3  # vLLM serial_utils.CUSTOM_TYPE_RAW_VIEW
_PICKLE_TYPES = {1: "pickle", 2: "cloudpickle"}
_DTYPES = {"float32": "<f4", "float16": "<f2", "float64": "<f8", "int64": "<i8", "int32": "<i4",
           "int16": "<i2", "int8": "i1", "uint8": "u1", "bool": "?"}
_KEYS = ("pixel_values", "image_grid_thw")
_MAX_ITEMS = 64


class _Refused(Exception):
    pass


def _bad(msg: str, param: str = PARAM) -> BadRequest:
    return BadRequest(msg, param)


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == _RAW_VIEW:
        return bytes(data)
    kind = _PICKLE_TYPES.get(code)
    if kind:
        raise _Refused(f"it holds a {kind}-serialized value (vLLM's VLLM_ALLOW_INSECURE_SERIALIZATION "
                       "fallback); only tensors serialized inline are accepted, nothing is unpickled")
    raise _Refused(f"unknown msgpack extension type {code}")


def _tensor(obj: Any, where: str) -> np.ndarray:
    if not (isinstance(obj, list) and len(obj) == 3 and isinstance(obj[0], str) and isinstance(obj[1], list)):
        raise _Refused(f"{where} is not a tensor [dtype, shape, data]")
    dtype, shape, data = obj
    if isinstance(data, (int, dict)):
        raise _Refused(f"{where} refers to an out-of-band buffer; tensors must be inline")
    if not isinstance(data, bytes):
        raise _Refused(f"{where} data is not raw bytes")
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d for d in shape):
        raise _Refused(f"{where} has an invalid shape {shape}")
    if dtype == "bfloat16":
        np_dtype, bf16 = np.dtype("<u2"), True
    elif dtype in _DTYPES:
        np_dtype, bf16 = np.dtype(_DTYPES[dtype]), False
    else:
        raise _Refused(f"{where} has an unsupported dtype {dtype!r}")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if count * np_dtype.itemsize != len(data):
        raise _Refused(f"{where} holds {len(data)} bytes, its dtype {dtype} and shape {shape} need "
                       f"{count * np_dtype.itemsize}")
    arr = np.frombuffer(data, dtype=np_dtype).reshape(shape)
    if bf16:
        arr = (arr.astype("<u4") << 16).view("<f4")
    return arr


def decode_item(data: Any, where: str) -> dict[str, np.ndarray]:
    """One serialized ``MultiModalKwargsItem`` -> {key: array} (400 on anything outside the
    safe subset)."""
    if not isinstance(data, str):
        raise _bad(f"{where} must be a base64 string or null.")
    try:
        raw = base64.b64decode(data, validate=True)
        obj = msgspec.msgpack.decode(raw, ext_hook=_ext_hook)
        if not isinstance(obj, dict) or not obj:
            raise _Refused("it is not a map of tensor fields")
        out = {}
        for key, elem in obj.items():
            if not isinstance(key, str):
                raise _Refused("a field name is not a string")
            if not isinstance(elem, dict) or "data" not in elem:
                raise _Refused(f"field {key!r} is not {{data, field}}")
            if key not in _KEYS:
                raise _Refused(f"field {key!r} is not served (only {', '.join(_KEYS)} for images)")
            out[key] = _tensor(elem["data"], f"field {key!r}")
        return out
    except _Refused as exc:
        raise _bad(f"{where}: cannot decode the multimodal tensor payload: {exc}.") from None
    except (binascii.Error, ValueError, msgspec.MsgspecError) as exc:
        raise _bad(f"{where}: cannot decode the multimodal tensor payload (base64 of vLLM's msgpack "
                   f"MultiModalKwargsItem expected): {exc}.") from None


def _dict_of_lists(features: dict, name: str, *, required: bool):
    value = features.get(name)
    if value is None:
        if required:
            raise _bad(f"`features` is not supported in this form: `features.{name}` is required.",
                       f"{PARAM}.{name}")
        return None
    if not isinstance(value, dict) or not all(isinstance(v, list) for v in value.values()):
        raise _bad(f"features.{name} must map each modality to a list.", f"{PARAM}.{name}")
    return value


def _check_shape(features: dict) -> tuple[dict, dict, Any, Any]:
    hashes = _dict_of_lists(features, "mm_hashes", required=True)
    places = _dict_of_lists(features, "mm_placeholders", required=True)
    kwargs = _dict_of_lists(features, "kwargs_data", required=False)
    meta = _dict_of_lists(features, "mm_metadata", required=False)
    modalities = set(hashes)
    other = sorted((set(hashes) | set(places) | set(kwargs or {}) | set(meta or {})) - {"image"})
    if other:
        raise _bad(f"features: {', '.join(map(str, other))} input is not supported yet (only image is).", PARAM)
    if set(places) != modalities:
        raise _bad("features: mm_hashes and mm_placeholders must use the same modalities.")
    for name, value in (("kwargs_data", kwargs), ("mm_metadata", meta)):
        if value is not None and set(value) != modalities:
            raise _bad(f"features: {name} must use the same modalities as mm_hashes.")
    n = len(hashes.get("image", []))
    if n > _MAX_ITEMS:
        raise _bad(f"features: at most {_MAX_ITEMS} images per request.")
    if len(places.get("image", [])) != n:
        raise _bad("features: image mm_hashes and mm_placeholders must have the same length.")
    for name, value in (("kwargs_data", kwargs), ("mm_metadata", meta)):
        if value is not None and len(value.get("image", [])) != n:
            raise _bad(f"features: image {name} and mm_hashes must have the same length.")
    return hashes, places, kwargs, meta


def _placeholder(p: Any, i: int) -> tuple[int, int]:
    if not isinstance(p, dict):
        raise _bad(f"features.mm_placeholders.image[{i}] must be an object {{offset, length}}.")
    off, length = p.get("offset"), p.get("length")
    if not (isinstance(off, int) and not isinstance(off, bool) and off >= 0 and isinstance(length, int)
            and not isinstance(length, bool) and length > 0):
        raise _bad(f"features.mm_placeholders.image[{i}] needs an integer offset >= 0 and length > 0.")
    return off, length


def feature_items(http, token_ids: list[int], spec) -> list[MultiModalItem]:
    """``http.features`` -> wire ``MultiModalItem``s in prompt order (400 on anything wrong)."""
    features = http.features
    if not isinstance(features, dict):
        raise _bad("features must be an object.")
    hashes, places, kwargs, meta = _check_shape(features)
    n = len(hashes.get("image", []))
    kw_items = (kwargs or {}).get("image", [None] * n)
    meta_items = (meta or {}).get("image", [None] * n)
    items: list[MultiModalItem] = []
    ranges = []
    for i in range(n):
        h = hashes["image"][i]
        if not isinstance(h, str) or not h or len(h) > MAX_HASH_CHARS:
            raise _bad(f"features.mm_hashes.image[{i}] must be a non-empty string of at most {MAX_HASH_CHARS} "
                       "characters.")
        offset, length = _placeholder(places["image"][i], i)
        ranges.append((offset, offset + length))
        if kw_items[i] is None:
            if meta_items[i] is not None:
                if not http.ec_transfer_params:
                    raise _bad("features: metadata-only multimodal items require ec_transfer_params "
                               f"(image {i} has mm_metadata but no kwargs_data).")
                announced = http.ec_transfer_params.get(h) if isinstance(http.ec_transfer_params, dict) else None
                if not isinstance(announced, dict) or "peer_host" not in announced:
                    raise _bad(f"features: image {i} is metadata-only (no kwargs_data) but ec_transfer_params "
                               f"names no encoder worker for its mm_hash {h!r} (an entry with peer_host and "
                               "peer_port, as an ec_producer's response gives it).", "ec_transfer_params")
                meta = decode_item(meta_items[i], f"features.mm_metadata.image[{i}]")
                items.append(_to_wire(i, meta, h, offset, length, token_ids, spec, remote=True))
                continue
            raise _bad(f"features: image {i} has no kwargs_data (an item to resolve from a multimodal cache); "
                       "this server keeps no such cache, send the tensors in kwargs_data.")
        item = decode_item(kw_items[i], f"features.kwargs_data.image[{i}]")
        if meta_items[i] is not None:
            item.update(decode_item(meta_items[i], f"features.mm_metadata.image[{i}]"))  # vLLM: metadata wins
        items.append(_to_wire(i, item, h, offset, length, token_ids, spec))
    ranges.sort()
    for (_, end), (nxt, _) in zip(ranges, ranges[1:]):
        if nxt < end:
            raise _bad("features: mm_placeholders must be globally non-overlapping and sorted.")
    total = sum(1 for t in token_ids if t == spec.image_token_id)
    covered = sum(it.length for it in items)
    if total != covered:
        raise _bad(f"placeholder count mismatch: token_ids has {total} image placeholder token(s) "
                   f"({spec.image_token_id}), features.mm_placeholders cover {covered}.", PARAM)
    items.sort(key=lambda it: it.offset)
    return items


def _to_wire(i, item, h, offset, length, token_ids, spec, remote: bool = False) -> MultiModalItem:
    """``remote``: a metadata-only item (the grid alone; its encoder output is pulled from
    the worker ``ec_transfer_params`` names)."""
    where = f"features.{'mm_metadata' if remote else 'kwargs_data'}.image[{i}]"
    missing = [k for k in (("image_grid_thw",) if remote else _KEYS) if k not in item]
    if missing:
        raise _bad(f"{where}: missing {', '.join(missing)} (an image item here needs "
                   f"{'image_grid_thw' if remote else 'pixel_values and image_grid_thw'}).")
    grid = item["image_grid_thw"].reshape(-1)
    if grid.size != 3 or grid.dtype.kind not in "iu" or (grid <= 0).any() or (grid > 1 << 16).any():
        raise _bad(f"{where}: image_grid_thw must be 3 positive integers, got {grid.tolist()}.")
    grid = tuple(int(v) for v in grid)
    if grid[1] % spec.merge_size or grid[2] % spec.merge_size:
        raise _bad(f"{where}: image_grid_thw {list(grid)} is not divisible by the merge size {spec.merge_size}.")
    if remote:
        _check_placeholder(i, grid, offset, length, token_ids, spec)
        return MultiModalItem(modality="image", mm_hash=features_hash(h), offset=offset, length=length,
                              grid_thw=list(grid), pixel_values=b"", shape=[], encoding="remote")
    pixels = item["pixel_values"]
    proc = spec.processor
    cols = 3 * proc.temporal_patch_size * proc.patch_size ** 2
    rows = grid[0] * grid[1] * grid[2]
    if pixels.dtype.kind != "f" or pixels.shape != (rows, cols):
        raise _bad(f"{where}: pixel_values must be a float tensor of shape [{rows}, {cols}] for grid "
                   f"{list(grid)}, got {pixels.dtype} {list(pixels.shape)}.")
    pixels = np.ascontiguousarray(pixels, dtype="<f4")
    if not np.isfinite(pixels).all():
        raise _bad(f"{where}: pixel_values holds non-finite values.")
    _check_placeholder(i, grid, offset, length, token_ids, spec)
    return MultiModalItem(modality="image", mm_hash=features_hash(h), offset=offset, length=length,
                          grid_thw=list(grid), pixel_values=pixels.tobytes(), shape=list(pixels.shape))


def _check_placeholder(i, grid, offset, length, token_ids, spec) -> None:
    need = num_placeholder_tokens(grid, spec.merge_size)
    if length != need:
        raise _bad(f"placeholder count mismatch: image {i} has a placeholder of {length} tokens, "
                   f"its grid {list(grid)} needs {need}.", PARAM)
    if offset + length > len(token_ids) or any(t != spec.image_token_id for t in token_ids[offset:offset + length]):
        raise _bad(f"placeholder mismatch: features.mm_placeholders.image[{i}] (offset {offset}, length {length}) "
                   f"is not a run of the image placeholder token {spec.image_token_id} in token_ids.", PARAM)
