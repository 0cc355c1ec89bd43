"""When the grammar starts for a reasoning model: vLLM's ``reasoning_ended``.

The gateway turns the model's reasoning parser into token-id markers
(``StructuredOutputs.reasoning_start`` / ``reasoning_end``).  The constraint applies to
the tokens *after* the end marker; the marker's own tokens are reasoning, never fed to
the grammar.  A prompt whose last end marker comes after its last start marker (a chat
template that closed the thinking block) is past reasoning from the first token.
"""
from __future__ import annotations

from typing import Optional, Sequence


def _last_index(tokens: Sequence[int], marker: Sequence[int]) -> int:
    """Start of ``marker``'s last occurrence in ``tokens``; -1 when absent."""
    m = len(marker)
    first = marker[0]
    for i in range(len(tokens) - m, -1, -1):
        if tokens[i] == first and list(tokens[i:i + m]) == list(marker):
            return i
    return -1


def prompt_ended_reasoning(prompt: Sequence[int], start: Optional[Sequence[int]],
                           end: Optional[Sequence[int]]) -> bool:
    """True when generation starts past reasoning (no end marker: no reasoning at all)."""
    if not end:
        return True
    last_end = _last_index(prompt, end)
    if last_end < 0:
        return False
    return not start or _last_index(prompt, start) < last_end


def ends_with(tokens: Sequence[int], marker: Sequence[int]) -> bool:
    m = len(marker)
    return len(tokens) >= m and list(tokens[-m:]) == list(marker)
