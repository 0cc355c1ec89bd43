"""Model implementations and what they read from a Hugging Face model directory
(``config.py``: ``ModelConfig``).  ``registry.ModelRegistry`` maps each supported
``architectures`` name to its implementation (the ``interface.Model`` protocol)."""
from worker.engine.models.llama import LlamaForCausalLM, kv_bytes_per_block, kv_cache_shape, local_kv_heads

__all__ = ["LlamaForCausalLM", "kv_cache_shape", "kv_bytes_per_block", "local_kv_heads"]
