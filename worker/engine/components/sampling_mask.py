"""Sampling-mask capture (``--return-sampling-mask``): per output token, the token ids
that survived the sampling filters; each delta carries those of its tokens."""
from __future__ import annotations

from worker.engine.component import EngineComponent


class SamplingMaskCapture(EngineComponent):
    name = "sampling_mask"
    needs_sampler_masks = True

    def __init__(self):
        self.pending: dict[int, list[list[int]]] = {}  # seq_id -> masks the next delta carries

    def on_sampled(self, outs, first_rows, result) -> None:
        masks = result.masks
        if masks is None:
            return
        for out, r in zip(outs, first_rows):
            seq = out.seq
            # Tokens a stop string cut (always the last ones appended) lose their masks too.
            dropped = seq.detokenizer.dropped_token_count if seq.detokenizer is not None else 0
            pending = self.pending.get(seq.seq_id)
            if pending is None:
                pending = self.pending[seq.seq_id] = []
            pending.extend(masks[r:r + len(out.new_token_ids) + dropped])
            if dropped:
                del pending[-dropped:]

    def fill_deltas(self, outs, deltas) -> None:
        if self.pending:  # None (the default) without masks
            for out, delta in zip(outs, deltas):
                self._fill_delta(out, delta)

    def _fill_delta(self, out, delta) -> None:
        if out.seq is not None:
            delta.sampling_mask = self.pending.pop(out.seq.seq_id, None)


def maybe_create(config, ctx) -> "SamplingMaskCapture | None":
    return SamplingMaskCapture() if config.return_sampling_mask else None
