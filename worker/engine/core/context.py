"""What an engine component may do to the engine, and read of it (issue 41).

Components used to receive the whole ``EngineCore`` and reached into its scheduler,
runner and block manager as they pleased.  ``CoreContext`` is the narrow face the core
hands them instead (``component.EngineContext`` is its protocol): close and
open a request's readiness gates, fail or forget a request, read the running and waiting sequences,
the KV cache and the engine's fixed facts.  A component that needs something else of
the core needs a new, named entry here -- not a reach into the core's members.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # pragma: no cover
    import torch


class CoreContext:
    def __init__(self, core: Any):
        self._core = core  # the EngineCore that built it (not imported: the core imports this module)

    # --- fixed facts ---------------------------------------------------------------------
    @property
    def config(self) -> Any:
        return self._core.config

    @property
    def device(self) -> "torch.device":
        return self._core.device

    @property
    def model_config(self) -> Any:
        return self._core.model_config

    @property
    def tokenizer(self) -> Any:
        return self._core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._core.max_model_len

    @property
    def block_manager(self) -> Any:
        """KV blocks: a P/D leg reserves, holds and frees them; sizes are read from it."""
        return self._core.block_manager

    @property
    def model_info(self) -> Any:
        """What the worker announces (LoRA keeps its adapter list there up to date)."""
        return self._core.model_info

    def kv_cache(self) -> Optional["torch.Tensor"]:
        """The paged KV cache (None while sleep has released it)."""
        return self._core.runner.kv_cache

    def set_draft_source(self, source: Any) -> None:
        """Where the scheduler gets the drafts a decode verifies: ``source(seq)`` -> token
        ids (speculative decoding's proposer; one source per engine)."""
        if self._core.scheduler.draft_source is not None:
            raise RuntimeError("a draft source is set already")
        self._core.scheduler.draft_source = source

    def add_draft_filter(self, keep: Any) -> None:
        """``keep(seq, drafts)`` -> the drafts to verify (a prefix): structured outputs
        cuts drafts its grammar rejects, before a verify row is spent on them."""
        self._core.scheduler.draft_filters.append(keep)

    def set_chunk_limit(self, limit: Any) -> None:
        """``limit(seq, start, num_new)`` -> how much of a prompt chunk may run (core/scheduler.py
        ``chunk_limit``: images of bidirectional-attention models kept whole)."""
        self._core.scheduler.chunk_limit = limit

    def add_admission_limit(self, limit: Any) -> None:
        """A limit on which waiting sequences a step admits (core/scheduler.py
        ``AdmissionLimit``: LoRA's adapter slots)."""
        self._core.scheduler.limits.append(limit)

    # --- requests and sequences --------------------------------------------------------------
    def running(self) -> list:
        return self._core.scheduler.running

    def waiting(self) -> list:
        return self._core.scheduler.waiting()

    def is_live(self, request_id: str) -> bool:
        """The request is still in the engine (not finished, aborted or failed)."""
        return request_id in self._core.requests

    def close_gate(self, request: Any, name: str) -> None:
        """The request waits for ``name`` (``kv_pull``, ``encoder_pull``, ``grammar``...)
        before its first step; closed in ``admit`` (core/gates.py)."""
        self._core.close_gate(request, name)

    def open_gate(self, request: Any, name: str) -> None:
        """``name`` is done; the request is scheduled once its last gate opens.  For a
        request that is gone, nothing."""
        self._core.open_gate(request, name)

    def fail_request(self, request: Any, status: int, message: str, param: str) -> None:
        """Fail a request outside a step's outputs (a gate that can never open: a failed
        pull, a grammar that does not compile): its choices are aborted and its blocks
        freed; the error is its answer.  For a request that is gone, nothing."""
        self._core.fail_request(request, status, message, param)

    def forget_request(self, request: Any) -> None:
        self._core.forget_request(request)

    # --- engine-wide commands (RL control: weight updates, sleep / wake) -------------------
    def drain(self) -> None:
        """Finish the step in flight now (async scheduling): before weights change or the
        cache is released; its outputs go out with the next step."""
        self._core.drain()

    def preempt_all(self) -> None:
        """Every running choice back to waiting, its blocks freed (recomputed later)."""
        self._core.scheduler.preempt_all()

    def release_kv_cache(self) -> None:
        """Sleep: release the KV cache and what lives beside it (a draft model's)."""
        self._core.release_kv_cache()

    def allocate_kv_cache(self) -> None:
        """Wake-up: allocate the KV cache (and what lives beside it) again."""
        self._core.allocate_kv_cache()

    def replace_model(self, model: Any) -> None:
        """The runner's model is now ``model`` (None: sleep released the weights)."""
        self._core.replace_model(model)
