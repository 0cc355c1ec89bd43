"""The inference engine a worker process runs (``Engine``, ``EngineConfig``).

Exports are lazy so that importing a light submodule (e.g. attn_metadata) does
not load the whole engine.
"""
from __future__ import annotations

from typing import Any

__all__ = ["Engine", "EngineConfig"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from worker.engine.engine import Engine

        return Engine
    if name == "EngineConfig":
        from worker.engine.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'worker.engine' has no attribute {name!r}")
