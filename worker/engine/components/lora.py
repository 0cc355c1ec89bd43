"""LoRA adapters as an engine component (``--enable-lora``).

The model side (adapter slots, the batched LoRA matmuls) is ``lora/manager.py``'s
``LoRAManager``, shared with the model runner.  This component is the engine side:
it resolves a request's ``lora_name`` at admission and pins the adapter's host copy
while the request lives, keeps each adapter's rows of a step contiguous, reports the
adapters in the load, and owns the load/unload commands."""
from __future__ import annotations

from common.errors import BadRequest, NotFound
from worker.engine.component import EngineComponent


def _adapter_key(s) -> str:
    return s.seq.request.lora_key or ""


class AdapterSlots:
    """The scheduler's admission limit: at most ``max_loras`` distinct adapters run at
    once (every step's fit the device slots); a request whose adapter has no slot waits."""

    def __init__(self, max_loras: int):
        self.max_loras = max_loras

    def begin(self, running) -> set:
        return {s.request.lora_key for s in running} - {None}

    def admits(self, adapters: set, seq) -> bool:
        key = seq.request.lora_key
        if key is not None and key not in adapters:
            if len(adapters) >= self.max_loras:
                return False
            adapters.add(key)
        return True


class LoRAComponent(EngineComponent):
    name = "lora"

    def __init__(self, manager, ctx):
        self.manager = manager
        self.ctx = ctx  # EngineContext: running / waiting sequences, model_info, the scheduler's limits
        self.model_info = ctx.model_info  # its lora_adapters follow load / unload
        self.model_info.lora_adapters = self.adapters()
        self.pinned: dict[str, str] = {}  # request id -> the adapter registration it pinned
        # The adapters of this step's batch and of the one before (async scheduling: maybe in flight).
        self._names: frozenset = frozenset()
        self._prev_names: frozenset = frozenset()
        ctx.add_admission_limit(AdapterSlots(manager.max_loras))

    # --- commands (worker/control.py) ------------------------------------------------
    def load(self, name: str, path: str, inplace: bool = False) -> None:
        """Register (read and validate) a PEFT adapter; LoRAError (400) when refused."""
        if name == self.model_info.name:
            raise BadRequest(f"The lora adapter '{name}' conflicts with a served base model.",
                             type="InvalidUserInput")
        self.manager.register(name, path, inplace)
        self.model_info.lora_adapters = self.adapters()

    def unload(self, name: str) -> None:
        """New requests can no longer name it; running ones finish with it."""
        self.manager.unregister(name)
        self.model_info.lora_adapters = self.adapters()

    def adapters(self) -> dict[str, str]:
        return dict(self.manager.paths)

    # --- hooks -------------------------------------------------------------------------
    def check(self, req, mm) -> None:
        if req.lora_name is not None and req.lora_name not in self.manager.keys:
            raise NotFound(f"The model `{req.lora_name}` does not exist.", "model")

    def admit(self, request, seq) -> None:
        name = request.req.lora_name
        if name is not None:  # a refusal here leaves nothing to undo
            key = self.manager.keys[name]
            self.manager.acquire(key)
            request.lora_key = key
            self.pinned[request.request_id] = key

    def on_scheduled(self, scheduled) -> None:
        # Each adapter's rows contiguous: the CPU path multiplies views instead of
        # gathering and scattering rows (stable: priority order within an adapter).
        scheduled.sort(key=_adapter_key)
        names = frozenset(s.seq.request.lora_key for s in scheduled) - {None}
        self._prev_names, self._names = self._names, names
        self.manager.busy = frozenset()  # nothing in flight to spare unless overlaps_step says so

    def overlaps_step(self, scheduled) -> bool:
        # Adapters are loaded into device slots while the batch is planned: with a step in
        # flight, only into slots that step does not read (the previous batch's adapters
        # stay resident); when they cannot all fit beside those, that step finishes first.
        if not self._names or self.manager.loadable_beside(self._names, self._prev_names):
            self.manager.busy = self._prev_names
            return True
        return False

    def on_model_replaced(self, model) -> None:
        if model is not None:  # wake-up reloaded the weights: the adapter slots go into the new model
            self.manager.attach(model)

    def forget(self, request) -> None:
        key = self.pinned.pop(request.request_id, None)
        if key is not None:
            self.manager.release(key)

    def fill_load(self, load) -> None:
        running = sorted({s.request.lora_key for s in self.ctx.running()} - {None})
        waiting = sorted({s.request.lora_key for s in self.ctx.waiting()} - {None})
        load.resident_loras, load.max_loras = self.manager.resident, self.manager.max_loras
        load.running_loras, load.waiting_loras = self.manager.names(running), self.manager.names(waiting)


def install(config, ctx, runner):
    """Model side (--enable-lora): the adapter slots in the model and the step's adapter
    inputs (a runner hook); None when LoRA is off."""
    if not config.enable_lora:
        return None
    from worker.engine.lora.manager import LoRAManager
    from worker.engine.lora.step_inputs import LoRAStepInputs

    device = ctx.device
    manager = LoRAManager(runner.model, max_loras=config.max_loras, max_rank=config.max_lora_rank,
                          max_cpu_loras=config.max_cpu_loras, device=device, dtype=config.torch_dtype,
                          use_triton=device.type == "cuda" or runner.backend.name == "triton")
    for name, path in (config.lora_modules or {}).items():
        manager.register(name, path)
    runner.install(LoRAStepInputs(manager))
    return manager


def maybe_create(config, ctx, manager) -> "LoRAComponent | None":
    """The engine side: adapters by name, pins, slots, load / unload."""
    return LoRAComponent(manager, ctx) if manager is not None else None
