"""``content_parts`` of ``/inference/v1/generate``: raw images resolved in the gateway.

As in vLLM 0.32, ``token_ids`` already hold each image's placeholder tokens (a run of the
model's image token, e.g. Qwen2-VL's ``<|image_pad|>``) and ``content_parts`` lists the
images in prompt order.  The gateway loads each image (data:, file: under
``--allowed-local-media-path``, http(s) with ``--allow-remote-media``), resizes it as the
model's processor does (common/multimodal) and attaches the resized uint8 image to the wire
request as a ``MultiModalItem`` over its run of placeholders; the worker normalises,
patchifies and encodes it.

Hostile images: everything an image's header decides (placeholder run, patch grid, the
decoded-pixel bounds per image and per request) is checked for every image of a request
before any is decoded, so a request of image bombs costs the gateway a header read each;
reading, decoding and fetching run in gateway/media_pools.py's bounded pools.

``features`` (pre-processed tensors, vLLM's wire form) is served too: gateway/mm_features.py.

Only ``image_url`` parts are served; other modalities are refused by name.  A part's URL
is read where vLLM reads it (``{"type": "image_url", "url": ...}``) or in the OpenAI chat
shape (``{"type": "image_url", "image_url": {"url": ...}}``).
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np

from common.errors import BadRequest
from common.multimodal import (MediaError, cache_key, decode_image_bytes, features_hash, image_size, mm_hash,
                               num_placeholder_tokens, read_image_bytes)
from common.multimodal.limits import DEFAULT_MM_LIMIT, parse_mm_limits  # noqa: F401 - the gateway's flag parses here
from common.prefix_hash import prompt_routing_hashes
from common.protocol import MultiModalItem
from gateway.media_pools import media_pools
from gateway.mm_features import feature_items

PARAM = "content_parts"
NO_IMAGE_MODEL = ("`content_parts` is not supported by this server. Reason: this model does not take image input "
                  "(image input needs a Qwen2-VL family or Gemma 3 model folder given to the gateway with "
                  "--tokenizer).")


MAX_UUID_CHARS = 256


def check_item_count(settings, modality: str, count: int) -> None:
    """vLLM's ``validate_num_items``: at most the ``--limit-mm-per-prompt`` items of a modality."""
    limit = settings.limit_mm_per_prompt.get(modality, DEFAULT_MM_LIMIT)
    if count > limit:
        raise BadRequest(f"At most {limit} {modality}(s) may be provided in one prompt.", modality)


def _check_type(i: int, part: Any) -> None:
    if not isinstance(part, dict):
        raise BadRequest(f"content_parts[{i}] must be an object.", f"{PARAM}[{i}]")
    ptype = part.get("type")
    if ptype != "image_url":
        name = ptype if isinstance(ptype, str) and ptype else "untyped"
        raise BadRequest(f"content_parts[{i}]: {name} input is not supported yet (only image_url is).",
                         f"{PARAM}[{i}].type")


def _image_url(i: int, part: dict) -> str:
    url = part.get("url")
    if url is None:
        inner = part.get("image_url")
        url = inner.get("url") if isinstance(inner, dict) else inner
    if url is None and part.get("uuid") is not None:
        raise BadRequest(f"content_parts[{i}]: an image given only by its uuid (a reference to a cached item) is "
                         "not supported: this server keeps no multimodal processor cache; send the image's `url`, "
                         "or the item as `features`.", f"{PARAM}[{i}]")
    if not isinstance(url, str) or not url:
        raise BadRequest(f"content_parts[{i}]: image_url needs a non-empty `url` string.", f"{PARAM}[{i}]")
    return url


def image_uuid(part: dict) -> Optional[str]:
    """vLLM's ``uuid`` of an image part (content part or chat message part): the client's
    identifier of the item, used as its mm_hash instead of hashing the image (so caches
    and ec_transfer_params know it by it).  ValueError when it is not a usable one."""
    uuid = part.get("uuid")
    if uuid is not None and (not isinstance(uuid, str) or not uuid or len(uuid) > MAX_UUID_CHARS):
        raise ValueError(f"`uuid` must be a non-empty string of at most {MAX_UUID_CHARS} characters")
    return uuid


def _uuid(i: int, part: dict) -> Optional[str]:
    try:
        return image_uuid(part)
    except ValueError as exc:
        raise BadRequest(f"content_parts[{i}]: {exc}.", f"{PARAM}[{i}].uuid") from None


def placeholder_runs(token_ids: list[int], token: int) -> list[tuple[int, int]]:
    """(offset, length) of every maximal run of ``token`` in ``token_ids``."""
    runs: list[tuple[int, int]] = []
    start = None
    for pos, tid in enumerate(token_ids):
        if tid == token:
            if start is None:
                start = pos
        elif start is not None:
            runs.append((start, pos - start))
            start = None
    if start is not None:
        runs.append((start, len(token_ids) - start))
    return runs


def _check_size(height: int, width: int, grid, proc) -> None:
    """HF's smart_resize scales a very thin image up to ``min_pixels`` without looking at
    ``max_pixels`` again (e.g. 1x150 -> 28x700); the workers refuse images past
    ``max_pixels`` (their vision memory is sized for it): say so here, with the reason."""
    patches = grid[0] * grid[1] * grid[2]
    limit = proc.max_patches
    if patches > limit:
        raise ValueError(f"the image resizes to {height}x{width} ({patches} patches), more than the {limit} patches "
                         f"of max_pixels={proc.max_pixels} (its aspect ratio is too extreme for this model's "
                         "preprocessor)")


def _header_checks(i: int, data: bytes, spec, settings, run: Optional[tuple[int, int]]):
    """What the image's header alone decides, before any pixel is decoded: its pixel count
    against ``--max-image-decoded-pixels``, its patch grid (aspect ratio, max_pixels) and,
    for content_parts, its run of placeholders.  -> (pixels, grid)."""
    width, height = image_size(data)
    pixels = width * height
    if pixels > settings.max_image_decoded_pixels:
        raise ValueError(f"the image is {width}x{height} ({pixels} pixels), more than the "
                         f"{settings.max_image_decoded_pixels} pixels one image may decode to "
                         "(--max-image-decoded-pixels)")
    proc = spec.processor
    # smart_resize's aspect-ratio refusal included; a processor that does not resize takes
    # only sides that are multiples of the patch cell, as after decoding
    grid = proc.grid_for_size(height, width)
    # EXIF orientation may swap the sides; smart_resize is symmetric in them, so the patch
    # and placeholder counts below hold either way.
    _check_size(grid[1] * proc.patch_size, grid[2] * proc.patch_size, grid, proc)
    if run is not None:
        need = num_placeholder_tokens(grid, spec.merge_size)
        if run[1] != need:
            raise _Mismatch(_mismatch(i, run[1], grid, need))
    return pixels, grid


class _Mismatch(Exception):
    """A placeholder-count mismatch: its message names the image, not the part."""


def _mismatch(i: int, length: int, grid, need: int) -> str:
    return (f"placeholder count mismatch: image {i} has {length} placeholder tokens in token_ids, "
            f"its grid {list(grid)} needs {need}.")


def _prepare(urls: list[str], fetched: dict, spec, settings, runs: Optional[list], where: str):
    """The decode job: every image's bytes and header checked first (nothing decoded
    if any is refused, nor if their total is over ``--max-request-decoded-pixels``),
    then each decoded and resized for the model.  -> ([(uint8 [H, W, 3], grid_thw)], pixels)."""
    policy = media_pools(settings).policy
    sources = []
    total = 0
    for i, url in enumerate(urls):
        try:
            data = fetched.get(i)
            if data is None:
                data = read_image_bytes(url, allowed_local_media_path=settings.allowed_local_media_path,
                                        policy=policy, max_bytes=settings.max_image_bytes)
            pixels, grid = _header_checks(i, data, spec, settings, runs[i] if runs is not None else None)
        except _Mismatch as exc:
            raise BadRequest(str(exc), PARAM) from None
        except (MediaError, ValueError) as exc:
            raise BadRequest(f"{where}[{i}]: {exc}", f"{where}[{i}]") from None
        total += pixels
        sources.append(data)
    if total > settings.max_request_decoded_pixels:
        raise BadRequest(f"{where}: the images decode to {total} pixels in all, more than the "
                         f"{settings.max_request_decoded_pixels} one request may decode to "
                         "(--max-request-decoded-pixels)", where)
    out = []
    for i in range(len(sources)):
        data, sources[i] = sources[i], None  # each encoded image freed once decoded
        try:
            image = decode_image_bytes(data, max_pixels=settings.max_image_decoded_pixels)
            del data
            resized = spec.processor.resize(image)
            del image  # the full-size decode, before the next one is made
            grid = spec.processor.check_patchable(resized.shape[0], resized.shape[1])
            _check_size(resized.shape[0], resized.shape[1], grid, spec.processor)
        except (MediaError, ValueError) as exc:
            raise BadRequest(f"{where}[{i}]: {exc}", f"{where}[{i}]") from None
        out.append((resized, grid))
    return out, total


async def _load_all(urls: list[str], spec, settings, runs: Optional[list] = None, where: str = PARAM):
    """Each URL's image resized for the model: ``[(uint8 [H, W, 3], grid_thw)]``.  ``runs``:
    the images' placeholder runs (content_parts), checked against their headers first."""
    pools = media_pools(settings)
    fetched = await pools.fetch_remote(urls, where)
    return await pools.decode(functools.partial(_prepare, urls, fetched, spec, settings, runs, where))


def _items(runs, processed, spec, uuids: Optional[list] = None) -> list[MultiModalItem]:
    items = []
    uuids = uuids or [None] * len(processed)
    for i, ((offset, length), (image, grid), uuid) in enumerate(zip(runs, processed, uuids)):
        need = num_placeholder_tokens(grid, spec.merge_size)
        if length != need:  # checked on the header already; this is the decoded image's word
            raise BadRequest(_mismatch(i, length, grid, need), PARAM)
        image = np.ascontiguousarray(image, dtype=np.uint8)
        # A client's uuid lives in the namespace of client-named hashes (features'), so it can
        # never alias the content hash of someone else's image.
        key = features_hash(uuid) if uuid is not None else mm_hash(image, grid, model_id=spec.model_id)
        items.append(MultiModalItem(modality="image", mm_hash=key,
                                    offset=offset, length=length, grid_thw=[int(v) for v in grid],
                                    pixel_values=image.tobytes(), shape=list(image.shape), encoding="uint8_hwc"))
    return items


def _set_items(mapped, items: list[MultiModalItem]) -> None:
    mapped.wire.mm_items = items
    if mapped.wire.prefix_hashes is not None:  # cache-aware routing wanted: the workers fold each image in
        mapped.wire.prefix_hashes = prompt_routing_hashes(
            mapped.wire.prompt_token_ids, mapped.kv_block_size, mapped.wire.cache_salt,
            mm_spans=[(it.offset, it.length, cache_key(it.mm_hash, it.grid_thw)) for it in items]) or None
    mapped.mm_placeholders = {"image": [{"offset": it.offset, "length": it.length} for it in items]}


async def attach_images(mapped, spec, settings, processed: Optional[list] = None) -> None:
    """Resolve ``mapped.http.content_parts`` into ``mapped.wire.mm_items`` (400 on anything wrong).
    ``processed``: the images already loaded and preprocessed, in order (chat rendering did it)."""
    parts = mapped.http.content_parts
    if mapped.http.features is not None:
        if parts:
            raise BadRequest("content_parts and features are mutually exclusive", PARAM)
        if spec is None:
            raise BadRequest(NO_IMAGE_MODEL.replace("`content_parts`", "`features`"), "features")
        items = feature_items(mapped.http, mapped.wire.prompt_token_ids, spec)
        check_item_count(settings, "image", len(items))
        _set_items(mapped, items)
        return
    if not parts:
        return
    for i, part in enumerate(parts):
        _check_type(i, part)
    if spec is None:
        raise BadRequest(NO_IMAGE_MODEL, PARAM)
    urls = [_image_url(i, part) for i, part in enumerate(parts)]
    uuids = [_uuid(i, part) for i, part in enumerate(parts)]
    check_item_count(settings, "image", len(urls))  # before any image is loaded
    runs = placeholder_runs(mapped.wire.prompt_token_ids, spec.image_token_id)
    if len(runs) != len(urls):
        raise BadRequest(
            f"content_parts has {len(urls)} image(s) but token_ids has {len(runs)} run(s) of the image "
            f"placeholder token {spec.image_token_id}; each image needs one contiguous run, in order.", PARAM)
    if processed is None or len(processed) != len(urls):
        processed = await _load_all(urls, spec, settings, runs)
    _set_items(mapped, _items(runs, processed, spec, uuids))


# ---------------------------------------------------------------- chat messages

def chat_image_urls(messages: Any) -> list[str]:
    """The URLs of the ``image_url`` parts of chat messages, in prompt order (the order
    the chat preprocessing meets them).  Malformed parts are skipped here: the
    preprocessing refuses them."""
    urls: list[str] = []
    if not isinstance(messages, list):
        return urls
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            if part.get("type") == "image_url" or (part.get("type") is None and "image_url" in part):
                inner = part.get("image_url")
                url = inner.get("url") if isinstance(inner, dict) else inner
                if isinstance(url, str) and url:
                    urls.append(url)
    return urls


async def load_chat_images(messages: Any, spec, settings) -> Optional[list]:
    """The chat messages' images loaded and resized off the event loop (400 on a
    media error); None when the model takes no images or there are none."""
    if spec is None:
        return None
    urls = chat_image_urls(messages)
    if not urls:
        return None
    check_item_count(settings, "image", len(urls))  # before any image is loaded
    return await _load_all(urls, spec, settings, where="images")


def expand_image_placeholders(ids: list[int], spec, processed: list) -> list[int]:
    """Each image's run of placeholder tokens (one token, as chat templates write it)
    replaced by the image's ``t*h*w/merge^2`` tokens."""
    runs = placeholder_runs(ids, spec.image_token_id)
    if len(runs) != len(processed):
        raise BadRequest(f"the messages hold {len(processed)} image(s) but the rendered prompt has {len(runs)} "
                         f"image placeholder(s); the chat template must write one per image.", "messages")
    out: list[int] = []
    pos = 0
    for (offset, length), (_, grid) in zip(runs, processed):
        out += ids[pos:offset]
        out += [spec.image_token_id] * num_placeholder_tokens(grid, spec.merge_size)
        pos = offset + length
    out += ids[pos:]
    return out
