"""``--speculative-config``: vLLM's JSON, the ngram method's keys and defaults.

``SpeculativeConfig`` lives with the engine's configuration (``worker.engine.config``),
which validates it with the other settings; the spec_decode package reads it here.
"""
from worker.engine.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
