"""vLLM's ``--limit-mm-per-prompt``: how many items of a modality one prompt may carry.

Parsed in one place for the gateway (which counts a request's items against it) and
the worker (where ``{"image": 0}`` serves a vision-language checkpoint language-model
only, as vLLM skips the vision encoder when every modality's limit is 0)."""
from __future__ import annotations

import json
from typing import Optional

DEFAULT_MM_LIMIT = 999  # vLLM's per-modality default


def parse_mm_limits(text: Optional[str]) -> dict[str, int]:
    """vLLM's ``--limit-mm-per-prompt`` JSON: ``{"image": 4}`` or ``{"image": {"count": 4, ...}}``
    (the size options of the second form only shape vLLM's profiling dummies)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("expected an object such as {\"image\": 4}")
    out = {}
    for modality, limit in value.items():
        count = limit.get("count", DEFAULT_MM_LIMIT) if isinstance(limit, dict) else limit
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{modality}: the count must be a non-negative integer, got {count!r}")
        out[str(modality)] = count
    return out
