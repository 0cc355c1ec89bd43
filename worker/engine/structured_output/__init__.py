"""Structured outputs' machinery (the engine side is components/structured_output.py):
spec checks and cache keys (spec.py), the xgrammar backend and our tokenizer's
TokenizerInfo (backend_xgrammar.py), the compiled-grammar cache and compile pool
(grammar_cache.py), per-sequence matchers (sequence_matcher.py), the step's bitmask
(bitmask.py) and reasoning markers (reasoning.py)."""
