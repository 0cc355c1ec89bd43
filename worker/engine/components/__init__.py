"""Engine components: the features that plug into ``EngineCore`` through hooks (base.py)."""
from worker.engine.components.base import READY, WAIT, EngineComponent, Hooks

__all__ = ["READY", "WAIT", "EngineComponent", "Hooks"]
