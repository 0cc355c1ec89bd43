"""Model-free multimodal front half (image loading; Qwen2-VL and Gemma 3 preprocessing).

Lives in ``common/`` so the gateway (placeholder expansion) and the workers
(pixel tensors) share one implementation; it must not import from gateway/,
broker/ or worker/, and never from transformers (a test-only reference).
"""

from common.multimodal.gemma3_processor import Gemma3ImageConfig
from common.multimodal.hashing import FEATURES_HASH_PREFIX, cache_key, client_hash, features_hash, mm_hash
from common.multimodal.qwen2_vl_processor import (
    Qwen2VLImageConfig,
    check_patchable,
    grid_thw_for_size,
    num_placeholder_tokens,
    patchify,
    preprocess_image,
    resize_image,
    smart_resize,
)

# Image loading needs Pillow; the workers never load media, so it is imported on first use
# (a GPU box running only the engine need not have Pillow).
_MEDIA = ("DEFAULT_FETCH_TIMEOUT_S", "DEFAULT_MAX_BYTES", "DEFAULT_MAX_PIXELS", "FetchPolicy", "MediaError",
          "decode_image_bytes", "image_size", "load_image", "parse_networks", "read_image_bytes")


def __getattr__(name: str):
    if name in _MEDIA:
        from common.multimodal import media

        return getattr(media, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_FETCH_TIMEOUT_S",
    "FetchPolicy",
    "image_size",
    "parse_networks",
    "read_image_bytes",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_PIXELS",
    "FEATURES_HASH_PREFIX",
    "MediaError",
    "Gemma3ImageConfig",
    "Qwen2VLImageConfig",
    "decode_image_bytes",
    "grid_thw_for_size",
    "load_image",
    "mm_hash",
    "num_placeholder_tokens",
    "patchify",
    "preprocess_image",
    "resize_image",
    "cache_key",
    "client_hash",
    "features_hash",
    "check_patchable",
    "smart_resize",
]
