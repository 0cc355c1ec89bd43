"""Stable content hash of one preprocessed multimodal item.

Used as the key for encoder-output / prefix caching and to make
image-bearing prompts hash differently from text-only ones.

What is hashed (and how it differs from vLLM): vLLM 0.32
(``vllm/multimodal/hasher.py``) hashes the *unprocessed* item -- the original
encoded bytes (or PIL mode+pixels) plus the model id and the mm processor
kwargs -- with blake3 by default.  We hash what the worker receives: the
resized uint8 image (its size is fixed by the resize bounds; mean/std and patch
sizes are the model's, which ``model_id`` covers) or, for pre-processed
``features``, the float pixel values; so no kwargs can be forgotten, and two
encodings of the same pixels (PNG vs. re-saved PNG) share a key.  The digest is *not* interchangeable with
vLLM's mm_hash values; nothing on the wire depends on them being equal.

Framing follows vLLM's idea: every chunk is length-prefixed so distinct
inputs cannot serialise to the same byte stream.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["FEATURES_HASH_PREFIX", "cache_key", "client_hash", "features_hash", "mm_hash"]

_DOMAIN = b"tokserve-mm-v2"


def _framed(h: "hashlib._Hash", chunk: bytes) -> None:
    h.update(len(chunk).to_bytes(8, "little"))
    h.update(chunk)


def mm_hash(
    pixel_values: np.ndarray,
    grid_thw: tuple[int, int, int],
    *,
    model_id: str = "",
    extra: str | bytes | None = None,
) -> str:
    """blake2b-256 hex digest of (model_id, grid_thw, dtype, shape, bytes, extra).

    ``model_id`` keeps two models' caches apart (same tensor, different tower);
    ``extra`` is for anything else that changes the encoder output (e.g. a
    LoRA name).  uint8 arrays (resized images) are hashed as they are; any other
    dtype is canonicalised to contiguous little-endian float32, so the digest is
    the same on every host.
    """
    dtype = np.uint8 if np.asarray(pixel_values).dtype == np.uint8 else np.dtype("<f4")
    arr = np.ascontiguousarray(pixel_values, dtype=dtype)
    h = hashlib.blake2b(digest_size=32)
    _framed(h, _DOMAIN)
    _framed(h, model_id.encode("utf-8"))
    _framed(h, ",".join(str(int(v)) for v in grid_thw).encode())
    _framed(h, arr.dtype.str.encode())
    _framed(h, ",".join(str(int(v)) for v in arr.shape).encode())
    _framed(h, arr.tobytes())
    if extra is None:
        _framed(h, b"")
        h.update(b"\x00")
    else:
        _framed(h, extra.encode("utf-8") if isinstance(extra, str) else bytes(extra))
        h.update(b"\x01")
    return h.hexdigest()


def cache_key(content_hash: str, grid_thw) -> str:
    """An item's key in the workers' encoder cache and prefix-cache blocks: its content
    hash with its grid, so a client naming one hash for images of different sizes never
    gets another size's embeddings.  The gateway's routing keys use the same form."""
    return f"{content_hash}#{'x'.join(str(int(v)) for v in grid_thw)}"


# Hashes a client names in ``features`` live in their own namespace, so that they can never
# alias the gateway's content hashes (a client cannot plant embeddings under a hash of
# someone else's image).
FEATURES_HASH_PREFIX = "features:"


def features_hash(client: str) -> str:
    """The wire mm_hash of an item whose hash a client named (``features``)."""
    return FEATURES_HASH_PREFIX + client


def client_hash(wire: str) -> str:
    """The hash a client sees for a wire mm_hash (``features_hash`` undone; a content
    hash the gateway computed is shown as it is)."""
    return wire[len(FEATURES_HASH_PREFIX):] if wire.startswith(FEATURES_HASH_PREFIX) else wire
