"""The engine one worker process runs: ``EngineCore`` stepping with the features its
configuration asks for (worker/engine/build.py wires them), its outputs packed into the
wire's CompletionDeltas.  The worker loop calls ``add_request`` / ``abort`` / ``step``
from one thread."""
from __future__ import annotations

from typing import Iterable, Optional

from common.protocol import CompletionDelta, GenerateRequest
from common.transfer_peers import format_address
from worker.engine.build import EngineFeatures
from worker.engine.config import EngineConfig
from worker.engine.core.engine_core import EngineCore
from worker.engine.records import SequenceOutput
from worker.engine.wire_output import merge_delta, to_delta


class Engine(EngineCore):
    def __init__(self, config: EngineConfig):
        features = EngineFeatures(config)
        super().__init__(config, features)
        # The features the worker's commands (worker/control.py) and the tests reach by name.
        self.rl = features.rl
        self.lora = features.lora
        self.lora_manager = features.lora_manager
        self.kv = features.kv
        self.kv_transfer = features.kv_transfer
        self.ec = features.ec
        self.spec = features.spec
        self.spec_decode = features.spec_decode
        self.structured_output = features.structured_output
        self.tp_leader = features.tp_leader  # tensor parallelism's rank 0 (None at size 1)

    def transfer_address(self) -> Optional[str]:
        """"host:port" of the transfer server (READY announces it), None when not bound."""
        server = self.kv_transfer.bound()
        return format_address(server.host, server.port) if server is not None else None

    def step(self) -> list[CompletionDelta]:
        return self._deltas(super().step())

    def abort(self, request_id: str) -> list[CompletionDelta]:
        return self._deltas(super().abort(request_id))

    def _deltas(self, outs: list[SequenceOutput]) -> list[CompletionDelta]:
        deltas = [to_delta(out) for out in outs]
        for hook in self.hooks.fill_deltas:  # the components' fields (routed experts, masks, ...)
            hook(outs, deltas)
        return deltas

    def generate(self, requests: Iterable[GenerateRequest]) -> dict[str, list[CompletionDelta]]:
        """Run the given requests to completion; one merged delta per choice."""
        ids = []
        for req in requests:
            self.add_request(req)
            ids.append(req.request_id)
        merged: dict[tuple[str, int], CompletionDelta] = {}
        wanted = set(ids)
        while any(rid in self.requests for rid in wanted):
            for delta in self.step():
                key = (delta.request_id, delta.index)
                merged[key] = merge_delta(merged.get(key), delta)
        return {rid: [merged[k] for k in sorted(k for k in merged if k[0] == rid)] for rid in ids}
