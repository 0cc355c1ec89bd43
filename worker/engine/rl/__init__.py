"""The engine's side of the RL control plane (``control``: weight versions and writes,
prefix-cache reset, sleep / wake)."""
