"""What one engine-core step produced for one choice, before any wire format.

The core hands these out; ``Engine`` (engine.py) packs them into the wire's
CompletionDelta (wire_output.py).  The sequence itself carries the rest of the
state an output reports: finish/stop reason and the logprobs gathered since the
last output (``pending_logprobs``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from worker.engine.core.request import EngineSequence, Request


@dataclass
class SequenceOutput:
    request: Request
    index: int  # choice index
    seq: Optional[EngineSequence]  # None: a choice of an aborted request that was never forked
    new_token_ids: list[int] = field(default_factory=list)
    text: Optional[str] = None  # newly released text (text mode / stop strings)
