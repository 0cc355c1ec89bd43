"""What a step runs for one sequence: the scheduler's plan, read by the runner, the
components and speculative decoding.

A leaf (it imports nothing of the engine), so that those readers need not import the
core to know the step's shape (tests/unit/common/test_import_layers.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ScheduledSeq:
    seq: Any  # records.EngineSequence: its tokens, progress (num_computed_tokens) and blocks
    num_new_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens
    # Speculative decoding: draft tokens verified this step, after the sequence's last
    # token (counted in num_new_tokens; their KV counts only where they are accepted).
    spec: tuple = ()
