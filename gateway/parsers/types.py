"""Types the parsers share (no imports of ours): the tool-call parsers build them, the
output parser (``gateway.parsers.output``) collects them."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text (json.dumps(..., ensure_ascii=False)), as function.arguments
