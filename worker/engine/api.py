"""What the worker (worker/server.py, worker/control.py) may call on its engine.

An explicit ``typing.Protocol`` instead of ``getattr`` probing: ``Engine`` implements it,
and so does every stand-in (tests/support/fake_worker.py).  Feature commands are reached through
the component that owns them: ``engine.rl`` (weights, versions, sleep / wake: rl/control.py)
and ``engine.lora`` (adapters: components/lora.py; None when LoRA is off)."""
from __future__ import annotations

from typing import Any, Iterable, Optional, Protocol

from common.protocol import CompletionDelta, GenerateRequest, KvEvents, ModelInfo, WorkerLoad


class RLControlAPI(Protocol):
    """``engine.rl``: the RL control plane's engine side."""

    weight_version: str
    disk_lineage: Optional[list[str]]  # checkpoint folders the weights came from (None: over the wire)
    device: Any  # torch.device the weights live on

    @property
    def is_asleep(self) -> bool: ...

    @property
    def weights(self) -> Any: ...  # ModelWeights (loading/weights.py): refuses TP>1 / released weights

    def set_weight_version(self, version: str) -> None: ...

    def reset_prefix_cache(self) -> bool: ...

    def require_single_rank(self, what: str) -> None: ...

    def sleep(self, level: int) -> None: ...

    def wake_up(self, tags: Optional[Iterable[str]] = None) -> bool: ...

    def read_checkpoint(self, path: str) -> dict: ...

    def write_weights(self, tensors: dict, *, from_disk: Optional[str] = None, more_to_come: bool = False) -> None: ...

    def end_weight_writes(self) -> None: ...

    def zero_weights(self) -> None: ...

    def weight_checksums(self, prefix: str) -> dict[str, str]: ...


class LoRAControlAPI(Protocol):
    """``engine.lora``: runtime adapter registration."""

    def load(self, name: str, path: str, inplace: bool = False) -> None: ...

    def unload(self, name: str) -> None: ...


class EngineAPI(Protocol):
    model_info: ModelInfo
    config: Any  # EngineConfig (the worker reads tensor_parallel_size)
    rl: RLControlAPI
    lora: Optional[LoRAControlAPI]

    # requests and steps (one thread)
    def add_request(self, req: GenerateRequest) -> None: ...

    def abort(self, request_id: str) -> list[CompletionDelta]: ...

    def step(self) -> list[CompletionDelta]: ...

    def has_unfinished(self) -> bool: ...

    def tick(self) -> None:
        """Housekeeping while no step runs (released KV transfers, finished pulls)."""

    def take_request_errors(self) -> list[tuple[str, int, str, str]]:
        """Requests failed outside a step's outputs: (request id, HTTP status, message, param)."""

    # reports
    def load(self) -> WorkerLoad: ...

    def snapshot_kv_events(self) -> Optional[KvEvents]: ...

    def drain_kv_events(self) -> Optional[KvEvents]: ...

    def transfer_address(self) -> Optional[str]: ...

    def close(self) -> None: ...
