"""Routed-experts capture (rollout routing replay, ``--enable-return-routed-experts``).

The model writes each position's top-k expert ids into the runner's routing store,
beside the position's KV slot.  When a choice finishes (before its blocks are freed)
this component reads the rows of every position the model ran and keeps them until
the choice's final delta carries them (``.npy`` bytes, as vLLM)."""
from __future__ import annotations

from typing import Any, Optional

from worker.engine.component import EngineComponent
from worker.engine.components.routing_capture import RoutingCapture
from worker.engine.wire_output import npy_bytes


def check_config(config, model_config) -> None:
    """Before the model is built: the capture needs expert layers."""
    if config.enable_return_routed_experts and model_config.moe is None:
        raise ValueError(f"--enable-return-routed-experts needs a mixture-of-experts model; "
                         f"{model_config.architecture} ({config.model}) has no expert layers")


def install(config, ctx, runner) -> None:
    """Runner hook: the routing store beside the KV cache (sized with it)."""
    if config.enable_return_routed_experts:
        runner.install(RoutingCapture())


def maybe_create(config, ctx, runner) -> "Optional[RoutedExpertsCapture]":
    return RoutedExpertsCapture(runner) if config.enable_return_routed_experts else None


class RoutedExpertsCapture(EngineComponent):
    name = "routed_experts"

    def __init__(self, runner):
        self.runner = runner
        self.captured: dict[int, Any] = {}  # seq_id -> numpy [positions, moe layers, top_k]

    def on_finished(self, seq) -> None:
        """Every position the model ran (the last sampled token never was), from the
        request's routed_experts_prompt_start."""
        if self.runner.routing_store is None or seq.num_computed_tokens == 0:
            return
        end = min(seq.num_tokens - 1, seq.num_computed_tokens)
        start = min(seq.request.params.routed_experts_prompt_start, seq.num_prompt_tokens, end)
        self.captured[seq.seq_id] = self.runner.routed_experts(seq.block_ids, end, start)

    def fill_deltas(self, outs, deltas) -> None:
        if self.captured:  # None (the default) without a capture
            for out, delta in zip(outs, deltas):
                self._fill_delta(out, delta)

    def _fill_delta(self, out, delta) -> None:
        seq = out.seq
        if seq is not None and seq.finish_reason is not None:
            delta.routed_experts = npy_bytes(self.captured.pop(seq.seq_id, None))
