"""Engine components: features that plug into ``EngineCore`` through the hooks of
``worker/engine/component.py`` (the interface, a leaf the core shares with them)."""
