"""Routed-experts capture (``--enable-return-routed-experts``): the model runner's KV
hook (``runner.hooks.KVCacheHook``).  Beside the KV cache it keeps the routed experts
of every KV slot (``[slots, moe layers, top_k]``), which the MoE layers write in the
forward and ``ModelRunner.routed_experts`` reads when a sequence finishes."""
from __future__ import annotations

from typing import Any

import torch


class RoutingCapture:
    def on_kv_allocated(self, runner: Any, num_blocks: int) -> None:
        """One row per KV slot: a prefix-cache hit reads the routing its block was
        computed with, and recompute after preemption rewrites it."""
        moe = runner.model_config.moe
        dtype = torch.uint8 if moe.num_experts <= 256 else torch.int32
        runner.routing_store = torch.zeros((num_blocks * runner.block_size, moe.num_moe_layers, moe.top_k),
                                           dtype=dtype, device=runner.device)
        runner.model.set_routing_store(runner.routing_store)

    def on_kv_released(self, runner: Any) -> None:
        if runner.routing_store is not None:
            runner.model.set_routing_store(None)
            runner.routing_store = None
