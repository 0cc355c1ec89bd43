"""What an engine component may do to the engine, and read of it (issue 41).

Components used to receive the whole ``EngineCore`` and reached into its scheduler,
runner and block manager as they pleased.  ``CoreContext`` is the narrow face the core
hands them instead (``components.base.EngineContext`` is its protocol): queue or
withdraw a sequence, fail or forget a request, read the running and waiting sequences,
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

    def kv_cache(self) -> Optional["torch.Tensor"]:
        """The paged KV cache (None while sleep has released it)."""
        return self._core.runner.kv_cache

    # --- requests and sequences --------------------------------------------------------------
    def running(self) -> list:
        return self._core.scheduler.running

    def waiting(self) -> list:
        return self._core.scheduler.waiting()

    def is_live(self, request_id: str) -> bool:
        """The request is still in the engine (not finished, aborted or failed)."""
        return request_id in self._core.requests

    def schedule(self, seq: Any) -> None:
        """Queue a sequence the component held (``admit`` returned WAIT) for scheduling."""
        self._core.scheduler.add(seq)

    def withdraw(self, seq: Any) -> bool:
        """Take a waiting sequence back out of the queue, keeping its blocks."""
        return self._core.scheduler.withdraw(seq)

    def fail_request(self, request: Any, status: int, message: str, param: str) -> None:
        self._core.fail_request(request, status, message, param)

    def fail_admitted_request(self, request: Any, status: int, message: str, param: str) -> None:
        self._core.fail_admitted_request(request, status, message, param)

    def forget_request(self, request: Any) -> None:
        self._core.forget_request(request)
