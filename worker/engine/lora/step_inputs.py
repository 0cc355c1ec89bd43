"""LoRA serving's input contributor for the model runner (``runner.hooks``): each
step's LoRABatch (token -> adapter slot) from the scheduled sequences' adapters, the
static batch decode CUDA graphs are captured with, and the lm_head rows of logits."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from worker.engine.lora.batch import LoRABatch
from worker.engine.runner.hooks import StepExtras


class LoRAStepInputs:
    def __init__(self, manager: Any):
        self.manager = manager  # LoRAManager

    def contribute(self, scheduled: Sequence[Any], layout: Any, extras: StepExtras) -> None:
        batch = self.manager.step_batch([s.seq.request.lora_key for s in scheduled], layout.query_lens)
        extras.lora = batch
        if batch is not None and batch.targets_any(("lm_head",)):
            extras.logits_inputs = lambda rows: batch.rows(np.asarray(rows))

    # --- decode CUDA graphs (GraphInputs) --------------------------------------------
    def static_inputs(self, batch_size: int, device: Any) -> LoRABatch:
        return LoRABatch.static(batch_size, self.manager.max_loras, device)

    def fill_static(self, static: LoRABatch, extras: StepExtras) -> None:
        static.fill(extras.lora.token_slots)
