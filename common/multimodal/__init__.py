"""Model-free multimodal front half (image loading + Qwen2-VL preprocessing).

Lives in ``common/`` so the gateway (placeholder expansion) and the workers
(pixel tensors) share one implementation; it must not import from gateway/,
broker/ or worker/, and never from transformers (a test-only reference).
"""

from common.multimodal.hashing import mm_hash
from common.multimodal.media import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_PIXELS,
    MediaError,
    decode_image_bytes,
    load_image,
)
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

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_PIXELS",
    "MediaError",
    "Qwen2VLImageConfig",
    "decode_image_bytes",
    "grid_thw_for_size",
    "load_image",
    "mm_hash",
    "num_placeholder_tokens",
    "patchify",
    "preprocess_image",
    "resize_image",
    "check_patchable",
    "smart_resize",
]
