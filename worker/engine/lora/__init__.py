"""LoRA adapters: PEFT checkpoints (adapter.py) and their batched application to the
decoder's fused projections (batched.py)."""
