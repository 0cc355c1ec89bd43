"""Engine components: the features that plug into ``EngineCore`` through hooks (base.py)."""
from worker.engine.components.base import EngineComponent, Hooks

__all__ = ["EngineComponent", "Hooks"]
