"""The engine's wiring (issue 41): which features an engine runs with, built from its
configuration, in one place.

The core (core/engine_core.py) imports no feature.  ``Engine`` (engine.py) hands it an
``EngineFeatures``, which it asks at three points of its construction (the protocol:
component.py ``EngineWiring``):

1. ``start``       before the model is built: configuration checks, tensor parallelism's
                   followers (every rank loads only its shard);
2. ``install``     the runner exists, its KV cache is not sized yet: the features' runner
                   hooks (routing store, image inputs, LoRA's step inputs, a draft model's
                   share of the KV cache);
3. ``components``  scheduler, block manager and model info exist: the engine components,
                   in hook order.

Each feature offers ``maybe_create(config, ctx, ...)`` in its own module -- its component,
or None when the configuration leaves it off -- and, where it has them, ``install`` for
its runner hooks; this module only calls them in order and hands over what one feature
shares with another (the transfer server, the LoRA manager, the proposer).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from worker.engine.component import EngineComponent
from worker.engine.components import kv_transfer, lora, routed_experts, sampling_mask, structured_output
from worker.engine.config import EngineConfig
from worker.engine.disagg import encoder_disaggregation
from worker.engine.disagg.kv_transfer import KvTransfer
from worker.engine.multimodal import images
from worker.engine.parallel import follower
from worker.engine.rl import control
from worker.engine.spec_decode import component as spec_decode


class EngineFeatures:
    """The features of one engine, and the handles the worker's commands reach them by
    (``engine.rl``, ``engine.lora``, ... : set on ``Engine``)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.tp_leader: Any = None
        self.lora_manager: Any = None
        self.spec: Any = None  # the proposer (n-gram or draft model)
        self.kv_transfer: Optional[KvTransfer] = None  # the transfer server KV and encoder transfer share
        self.rl: Any = None
        self.kv: Any = None
        self.ec: Any = None
        self.lora: Any = None
        self.spec_decode: Any = None
        self.structured_output: Any = None
        self._runner: Any = None
        self._ctx: Any = None
        # What the core reads once the components exist (component.EngineWiring).
        self.step: Optional[Callable[[], list]] = None
        self.overlap_blocker: Optional[str] = None

    # 1. before the model is built
    def start(self, ctx) -> None:
        config = self.config
        routed_experts.check_config(config, ctx.model_config)
        self.tp_leader = follower.maybe_start(config, ctx)

    # 2. the runner's hooks, before its KV cache is sized
    def install(self, ctx, runner) -> None:
        config = self.config
        self._ctx, self._runner = ctx, runner
        if self.tp_leader is not None:
            runner.set_parallel(self.tp_leader)
        routed_experts.install(config, ctx, runner)
        images.install(config, ctx, runner)
        self.lora_manager = lora.install(config, ctx, runner)
        self.spec = spec_decode.install(config, ctx, runner)

    # 3. the components, in hook order
    def components(self, ctx, runner) -> list[EngineComponent]:
        config = self.config
        self.kv_transfer = KvTransfer(config.kv_transfer_address, config.kv_transfer_timeout, ctx.kv_cache)
        self.rl = control.maybe_create(config, ctx, runner)  # always on: weight versions, updates, sleep / wake
        self.ec = encoder_disaggregation.maybe_create(config, ctx, runner, self.kv_transfer)
        self.kv = kv_transfer.maybe_create(config, ctx, self.kv_transfer)
        self.lora = lora.maybe_create(config, ctx, self.lora_manager)
        self.spec_decode = spec_decode.maybe_create(config, ctx, self.spec)
        self.structured_output = structured_output.maybe_create(config, ctx)
        built = [
            self.rl,
            routed_experts.maybe_create(config, ctx, runner),
            sampling_mask.maybe_create(config, ctx),
            # KV transfer's refusal of LoRA requests comes before LoRA's (check order).
            self.ec, self.kv, self.lora,
            self.spec_decode,  # after LoRA: drafts fill the batch in its final order (on_scheduled)
            self.structured_output,  # its draft filter cuts speculative decoding's drafts (no order needed)
            follower.TensorParallelRanks(self.tp_leader) if self.tp_leader is not None else None,  # closes last
        ]
        self.step = self.ec.encode_step if self.ec.encoder_only else None
        self.overlap_blocker = self._overlap_blocker()
        return [c for c in built if c is not None]

    def _overlap_blocker(self) -> Optional[str]:
        """Why this engine's steps cannot overlap at all (async scheduling off), or None."""
        if self.ec.encoder_only:
            return "an encoder-only worker runs no language-model step"
        if self.spec is not None:
            return "speculative decoding proposes each step's drafts from the last token, on the host"
        return None

    def parse_images(self, req) -> Any:
        """The request's images checked against the model (BadRequest), None without any."""
        cache = self._runner.encoder_cache
        return images.check_mm_items(req, self._ctx.model_config, cache.max_image_patches if cache is not None else None)
