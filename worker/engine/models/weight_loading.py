"""Copying checkpoint tensors into a model's parameters, shared by the families.

A model says where each tensor goes (``weight_targets``: name -> parameter view) and
which part of it this tensor-parallel rank holds (``weight_slices``: name -> (dim,
start, length)); a family with its own checkpoint layout renames (``checkpoint_name``)
or re-cuts tensors (``checkpoint_tensors``: one tensor in, any number out) first.
"""
from __future__ import annotations

import logging
from typing import Iterable

import torch

log = logging.getLogger(__name__)

# Checkpoint tensors that are derived, not learned: skipped silently.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def load_named_weights(model, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Fill ``model``'s parameters from ``(name, tensor)`` pairs; returns the target
    names filled (the caller checks completeness against ``weight_targets``)."""
    targets = model.weight_targets()
    slices = model.weight_slices()  # tensor parallelism: this rank's part of sharded tensors
    rename = getattr(model, "checkpoint_name", None)
    recut = getattr(model, "checkpoint_tensors", None)
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if rename is not None:
            name = rename(name)
        for name, tensor in (recut(name, tensor) if recut is not None else ((name, tensor),)):
            dst = targets.get(name)
            if dst is None:
                if name == "lm_head.weight" and tied:
                    continue  # some tied checkpoints store the copy anyway
                if not name.endswith(IGNORED_SUFFIXES):
                    unexpected.append(name)
                continue
            if name in slices:
                tensor = tensor.narrow(*slices[name])
            if tensor.shape != dst.shape:
                # q_norm/k_norm hold one [head_dim] vector broadcast over the heads.
                if not (tensor.dim() == 1 and dst.dim() == 2 and dst.shape[1] == tensor.shape[0]):
                    raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(name)
    if unexpected:
        log.warning("ignored %d unexpected checkpoint tensor(s), e.g. %s", len(unexpected), unexpected[:4])
    return loaded
