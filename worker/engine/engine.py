"""The engine one worker process runs: ``EngineCore`` stepping, with its outputs packed
into the wire's CompletionDeltas.  The worker loop calls ``add_request`` / ``abort`` /
``step`` from one thread."""
from __future__ import annotations

from typing import Iterable

from common.protocol import CompletionDelta, GenerateRequest
from worker.engine.core.engine_core import EngineCore
from worker.engine.records import SequenceOutput
from worker.engine.wire_output import merge_delta, to_delta


class Engine(EngineCore):
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
