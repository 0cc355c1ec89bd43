"""The ``Model`` protocol every registered implementation follows (models/registry.py).

The engine builds a model with ``cls(config, dtype=..., device=...)`` (the dtype and
device come from the engine configuration), fills it with ``load_weights`` and then
only calls what is listed here; what a family supports beyond that (LoRA target
modules, tensor parallelism, routed-experts capture, images) is declared on its
registry entry.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Protocol, runtime_checkable

import torch

from worker.engine.attention.backends.base import AttentionBackend
from worker.engine.attention.metadata import AttentionMetadata
from worker.engine.models.config import ModelConfig
from worker.engine.models.kv_layout import KVCacheLayout


@runtime_checkable
class Model(Protocol):
    config: ModelConfig
    dtype: torch.dtype

    @classmethod
    def kv_cache_layout(cls, config: ModelConfig) -> KVCacheLayout:
        """What the paged cache stores per token and layer (models/kv_layout.py): the
        runner allocates and sizes the cache by it (K/V per head for the Llama-family
        decoder, DeepSeek's latent for multi-head latent attention)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into the parameters, mapping names and
        taking this tensor-parallel rank's shard; returns the target names filled."""

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """Every tensor name the model needs -> the parameter (view) it fills."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_cache: torch.Tensor, lora: Optional[Any] = None) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of a flat batch over the paged KV cache."""

    def compute_logits(self, hidden: torch.Tensor, lora: Optional[Any] = None) -> torch.Tensor:
        """float32 ``[R, vocab]`` for selected hidden rows."""

    def use_attention_backend(self, backend: AttentionBackend) -> None:
        """Attention (and the backend's fused element-wise ops) through ``backend``."""

    def set_routing_store(self, store: Optional[torch.Tensor]) -> None:
        """MoE families: record routed experts per KV slot (others: no-op)."""
