"""How features plug into the model runner without the runner knowing them.

The runner lays a step out and runs it; a feature contributes through one of these
small interfaces, installed with ``ModelRunner.install``:

* ``InputContributor``: adds per-step model inputs (LoRA slot indices, image
  embeddings and M-RoPE positions) into a ``StepExtras``; one contributor may also
  give decode CUDA graphs static inputs of its own (a second graph set for steps
  that carry them).
* ``KVCacheHook``: follows the KV cache's life (routing capture keeps a per-slot
  store beside it).
* ``MemoryProfileHook``: adds a peak and a reserve to the KV-cache sizing (the
  vision tower, the encoder cache).
* ``ParallelHook``: the tensor-parallel package's handle on a rank's runner (rank 0
  mirrors model calls to its followers); ``LocalRun`` when there is none.

Hooks run once per step at most, never per token.  This module imports nothing of
ours beyond the attention metadata types, so features and the runner can both
depend on it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

import numpy as np


@dataclass
class StepExtras:
    """What input contributors add to one step's forward (the model's extra arguments)."""

    lora: Any = None  # the model's adapter argument (a LoRABatch); decode graphs may take it
    positions: Optional[np.ndarray] = None  # replaces the layout's positions ([3, T] M-RoPE)
    model_kwargs: dict = field(default_factory=dict)  # further model keywords (mm_embeds)
    eager: bool = False  # the step cannot replay a decode graph
    logits_inputs: Optional[Callable[[Sequence[int]], Any]] = None  # the adapter argument of logits rows


@runtime_checkable
class InputContributor(Protocol):
    def contribute(self, scheduled: Sequence[Any], layout: Any, extras: StepExtras) -> None:
        """Add this step's inputs (``layout``'s host arrays may be adjusted in place)."""


class GraphInputs(Protocol):
    """An input contributor whose inputs decode CUDA graphs take as static buffers."""

    def static_inputs(self, batch_size: int, device: Any) -> Any:
        """The static adapter argument a graph is captured with."""

    def fill_static(self, static: Any, extras: StepExtras) -> None:
        """Load a step's inputs into a graph's static argument before the replay."""


@runtime_checkable
class KVCacheHook(Protocol):
    def on_kv_allocated(self, runner: Any, num_blocks: int) -> None:
        """The cache was allocated with ``num_blocks`` blocks (the scratch block included)."""

    def on_kv_released(self, runner: Any) -> None:
        """The cache memory was given back (sleep)."""


@runtime_checkable
class MemoryProfileHook(Protocol):
    def profile_peak(self) -> int:
        """CUDA: the peak of work a step runs apart from the LM forward (it does not add to it)."""

    def profile_reserve(self) -> int:
        """Bytes held besides the KV cache while serving."""


class ParallelHook(Protocol):
    """Installed by the parallel package on a tensor-parallel rank."""

    lockstep: bool  # collectives wait on the other ranks: nothing runs on one rank alone
    # before_step sends the step's host arrays to other ranks: the input ids a step in
    # flight samples are filled into them on the host first (async scheduling).
    broadcasts_inputs: bool

    def decide_num_blocks(self, decide: Callable[[], int]) -> int: ...

    def before_alloc(self, num_blocks: int, max_model_len: int) -> None: ...

    def before_step(self, layout: Any) -> None: ...

    def before_logits(self, rows: Sequence[int]) -> None: ...

    def capture_cuda_graphs(self, runner: Any, capture: Callable[[], None]) -> None: ...


class LocalRun:
    """No tensor parallelism: every runner call is this process's own."""

    lockstep = False
    broadcasts_inputs = False

    def decide_num_blocks(self, decide: Callable[[], int]) -> int:
        return decide()

    def before_alloc(self, num_blocks: int, max_model_len: int) -> None:
        pass

    def before_step(self, layout: Any) -> None:
        pass

    def before_logits(self, rows: Sequence[int]) -> None:
        pass

    def capture_cuda_graphs(self, runner: Any, capture: Callable[[], None]) -> None:
        capture()


LOCAL = LocalRun()
