"""Model implementations and what they read from a Hugging Face model directory
(``config.py``: ``ModelConfig``).  One Llama-family network covers every supported
architecture (see ``config.SUPPORTED_ARCHITECTURES``)."""
from worker.engine.models.llama import LlamaForCausalLM, kv_bytes_per_block, kv_cache_shape, local_kv_heads

__all__ = ["LlamaForCausalLM", "kv_cache_shape", "kv_bytes_per_block", "local_kv_heads"]
