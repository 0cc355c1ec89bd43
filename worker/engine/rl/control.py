"""The engine's side of the RL control plane: its weight version, writing new
weights, the prefix cache reset, and sleep/wake of the KV cache and the weights.

Transport (how new tensors arrive) and pause semantics live in the worker
(worker/control.py); everything here runs between two engine steps on the
engine thread, so no forward step ever sees a half-written update.
"""
from __future__ import annotations

import gc
import logging
from typing import Iterable, Optional

import torch

from common.errors import BadRequest
from common.protocol import DEFAULT_WEIGHT_VERSION
from worker.engine.component import EngineComponent
from worker.engine.loading.weights import ModelWeights, checkpoint_tensors

log = logging.getLogger(__name__)

SLEEP_TAGS = ("weights", "kv_cache")
# Checkpoint tensors an update from disk may carry that the model does not hold (derived buffers,
# a tied head's copy): skipped, like the loader does.
_IGNORABLE = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached", "lm_head.weight")


class VersionSpans:
    """The weight versions of one choice's output tokens: (version, first output index
    sampled with it), one entry per change."""

    __slots__ = ("starts",)

    def __init__(self):
        self.starts: list[tuple[str, int]] = []

    def track(self, version: str, first_index: int) -> None:
        """Tokens from ``first_index`` on were sampled with ``version``."""
        starts = self.starts
        if not starts or starts[-1][0] != version:
            starts.append((version, first_index))

    def spans(self, num_output_tokens: int) -> list[tuple[str, int, int]]:
        """Contiguous half-open spans over the output tokens (vLLM's WeightVersionSpan);
        ``num_output_tokens``: after any stop-string trimming."""
        n = num_output_tokens
        starts = [(v, s) for v, s in self.starts if s < n]
        ends = [s for _, s in starts[1:]] + [n]
        return [(v, s, e) for (v, s), e in zip(starts, ends)]


class RLControl(EngineComponent):
    """An engine component (always on): the weight version each output token was sampled
    with (its hooks: ``on_sampled`` tracks, ``fill_deltas`` reports the spans), and the
    control commands the worker reaches as ``engine.rl`` (worker/control.py)."""

    name = "rl"

    def __init__(self, ctx, runner):
        self.ctx = ctx  # EngineContext: drain, preempt_all, the prefix cache, the KV cache's release
        self.runner = runner  # the model it writes, reloads and releases; its encoder cache
        self.config = ctx.config
        self.device = ctx.device
        self.weight_version = DEFAULT_WEIGHT_VERSION
        self.version_spans: dict[int, VersionSpans] = {}  # seq_id -> the versions of its output tokens
        self._weights: Optional[ModelWeights] = None
        self.asleep: set[str] = set()  # subset of SLEEP_TAGS that is released
        self.sleep_level = -1  # the last sleep's level until fully awake (vllm:engine_sleep_state)
        # Checkpoint folders whose weights the model holds now, in order: the model's own, then
        # every update from disk since.  None once weights came over the wire (not reproducible).
        self.disk_lineage: Optional[list[str]] = [self.config.model]

    # --- hooks: weight versions of the output tokens ------------------------------------
    def holds_steps(self) -> bool:
        return bool(self.asleep)  # the KV cache or the weights are released until wake_up

    def on_sampled(self, outs, first_rows, result) -> None:
        """Versions change between steps only: one check per choice and step."""
        version = self.weight_version
        spans = self.version_spans
        for out in outs:
            seq = out.seq
            tracked = spans.get(seq.seq_id)
            if tracked is None:
                tracked = spans[seq.seq_id] = VersionSpans()
            # the step's first token of this choice (stop-string trimming only cuts the last ones)
            tracked.track(version, len(seq.output_ids) - len(out.new_token_ids))

    def fill_deltas(self, outs, deltas) -> None:
        for out, delta in zip(outs, deltas):
            seq = out.seq
            if seq is None:  # a choice aborted before it was forked
                delta.weight_versions = []
            elif seq.finish_reason is not None:  # its final delta: the spans, forgotten here
                tracked = self.version_spans.pop(seq.seq_id, None)
                delta.weight_versions = tracked.spans(len(seq.output_ids)) if tracked is not None else []

    def fill_load(self, load) -> None:
        load.sleep_level = self.sleep_level
        if "kv_cache" in self.asleep:  # released: no blocks to offer
            load.free_kv_blocks = load.total_kv_blocks = 0

    # --- commands ---------------------------------------------------------------------
    def require_single_rank(self, what: str) -> None:
        if self.config.tensor_parallel_size > 1:
            raise BadRequest(f"{what} is not supported on a worker with tensor_parallel_size > 1 yet", None)

    @property
    def weights(self) -> ModelWeights:
        self.require_single_rank("updating or reading weights")
        self.ctx.drain()  # async scheduling: no step in flight reads weights being written
        if "weights" in self.asleep:
            raise BadRequest("the weights are released (sleep level 2): POST /wake_up first", None)
        if self._weights is None:
            self._weights = ModelWeights(self.runner.model)
        return self._weights

    def set_weight_version(self, version: str) -> None:
        if not isinstance(version, str) or not version:
            raise BadRequest("the weight version must be a non-empty string", "weight_version")
        self.ctx.drain()  # tokens sampled before the label changes carry the old one
        self.weight_version = version

    # --- weights -------------------------------------------------------------------
    def write_weights(self, tensors: dict[str, torch.Tensor], *, from_disk: Optional[str] = None,
                      more_to_come: bool = False) -> None:
        """Copy (already checked) tensors into the model and drop what the old weights
        cached.  ``more_to_come``: part of an open update (CPU layers stay unpacked
        until ``end_weight_writes``, so each is packed once)."""
        self.weights.write(tensors, keep_dense=more_to_come)
        if from_disk is not None and self.weights.spec.keys() <= tensors.keys():
            self.disk_lineage = [from_disk]  # a whole checkpoint: reproducible from it alone
        elif from_disk is not None and self.disk_lineage is not None:
            self.disk_lineage.append(from_disk)
        elif from_disk is None:
            self.disk_lineage = None
        self.invalidate_cached_kv()

    def end_weight_writes(self) -> None:
        if self._weights is not None:
            self._weights.pack()

    def read_checkpoint(self, path: str) -> dict[str, torch.Tensor]:
        """Every tensor of the safetensors checkpoint at ``path`` that the model holds,
        checked against the model's names, shapes and dtypes before anything is written."""
        spec = self.weights.spec
        try:
            tensors = {}
            for name, tensor in checkpoint_tensors(path):
                name = self.weights.canonical(name)
                if name not in spec and name.endswith(_IGNORABLE):
                    continue
                tensors[name] = tensor
        except (OSError, ValueError) as exc:
            raise BadRequest(f"cannot read the checkpoint at {path!r}: {exc}", "update_info") from None
        if not tensors:
            raise BadRequest(f"the checkpoint at {path!r} holds no tensor of this model", "update_info")
        self.weights.check((n, str(t.dtype), list(t.shape)) for n, t in tensors.items())
        return tensors

    def invalidate_cached_kv(self) -> None:
        """No K/V computed with the old weights is used again: running sequences are
        preempted (their prompt and output so far are recomputed with the new weights,
        so every later token is exactly what the new weights sample for that prefix)
        and the prefix cache is forgotten."""
        self.ctx.drain()
        self.ctx.preempt_all()
        self.ctx.block_manager.reset_prefix_cache()
        if self.runner.encoder_cache is not None:  # sleep level 2 / zeroing may touch the vision tower too
            self.runner.encoder_cache.clear()

    def reset_prefix_cache(self) -> bool:
        """Forget cached blocks; running sequences keep theirs (same weights: still valid)."""
        self.ctx.drain()
        self.ctx.block_manager.reset_prefix_cache()
        return True

    def weight_checksums(self, prefix: str) -> dict[str, str]:
        return self.weights.checksums(prefix)

    def zero_weights(self) -> None:
        self.weights.zero()
        self.disk_lineage = None
        self.invalidate_cached_kv()

    # --- sleep / wake --------------------------------------------------------------
    def sleep(self, level: int) -> None:
        """Level 1: release the KV cache; level 2: the weights as well.  Running
        sequences are preempted first (recomputed after wake-up)."""
        self.require_single_rank("sleep mode")
        self.sleep_level = level  # vLLM's record_sleep_state(1, level), level 0 included
        if level < 1:
            return
        self.ctx.drain()
        self.ctx.preempt_all()
        self.ctx.block_manager.reset_prefix_cache()
        if "kv_cache" not in self.asleep:
            self.ctx.release_kv_cache()  # a draft model's cache goes with the target's
            self.asleep.add("kv_cache")
        if level >= 2 and "weights" not in self.asleep:
            self._weights = None
            self.ctx.replace_model(None)
            if self.runner.encoder_cache is not None:  # it encodes with the model: let the weights go
                self.runner.encoder_cache.clear()
                self.runner.encoder_cache.model = None
            self.asleep.add("weights")
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        log.info("asleep (level %d): released %s", level, ", ".join(sorted(self.asleep)))

    def wake_up(self, tags: Optional[Iterable[str]] = None) -> bool:
        """Restore the released parts named by ``tags`` (all when None); True when fully awake.

        Released weights are reloaded from the checkpoints they came from.  When the
        last update came over the wire it cannot be reloaded: the weights fall back to
        the disk lineage and the version label to ``default``, so the broker sees the
        rank as stale and does not serve from it until it gets the weights again."""
        self.ctx.drain()
        wanted = set(SLEEP_TAGS if tags is None else tags)
        unknown = wanted - set(SLEEP_TAGS) - {"scheduling"}
        if unknown:
            raise BadRequest(f"unknown wake_up tag(s) {sorted(unknown)}: expected weights, kv_cache", "tags")
        if "weights" in wanted and "weights" in self.asleep:
            self._reload_weights()
        if "kv_cache" in wanted and "kv_cache" in self.asleep:
            self.ctx.allocate_kv_cache()
            self.asleep.discard("kv_cache")
        if not self.asleep and self.device.type == "cuda":
            self.runner.capture_cuda_graphs()  # graphs hold weight and KV addresses
        if not self.asleep:
            self.sleep_level = -1  # vLLM's record_sleep_state(0, 0) once fully awake
        return not self.asleep

    def _reload_weights(self) -> None:
        from worker.engine.loading.model_setup import build_model

        lineage = self.disk_lineage
        if lineage is None:
            log.warning("weights of version %r came over the wire and were released: reloading %s; "
                        "push the weights again", self.weight_version, self.config.model)
            self.weight_version = DEFAULT_WEIGHT_VERSION
            lineage = []
        # The model's own checkpoint first, then every update from disk on top (the lineage
        # may start at a whole checkpoint other than the model's).
        model, _, _ = build_model(self.config, self.ctx.model_config, self.device)
        model.use_attention_backend(self.runner.backend)
        self.ctx.replace_model(model)  # LoRA's slots go into it (on_model_replaced)
        if self.runner.encoder_cache is not None:
            self.runner.encoder_cache.model = model
        self.asleep.discard("weights")
        self.disk_lineage = [self.config.model]
        for path in lineage:
            if path != self.config.model:
                self.write_weights(self.read_checkpoint(path), from_disk=path)

    @property
    def is_asleep(self) -> bool:
        return bool(self.asleep)


def maybe_create(config, ctx, runner) -> RLControl:
    """Always on: weight versions, weight updates, prefix-cache reset, sleep / wake."""
    return RLControl(ctx, runner)
