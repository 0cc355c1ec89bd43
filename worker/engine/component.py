"""The engine component interface (issues 31, 41): a leaf the core and the features share.

A feature that is not the core loop (schedule -> forward -> sample -> append) is an
``EngineComponent``: ``EngineCore`` holds a list of them and calls their hooks, in
order, at fixed points of a request's life and of a step -- in the spirit of vLLM
v1's KV connector (scheduler-side and worker-side hooks).  Every hook has a no-op
default; ``Hooks`` collects, once, only the components that *override* a hook, so
a step pays nothing for a feature that is off or does not care about that point.

Per-request state belongs to the component (a dict keyed by request id or by
sequence id inside it), not to ``Request`` / ``EngineSequence``.  Components are built
by worker/engine/build.py (each feature module's ``maybe_create``) and get the core's
``EngineContext``, never the core.

Hook order in a request's life::

    check(req, mm)                validate; raise a ClientError (400/404/429...) to refuse
    admit(request, seq)           after the request is registered: register state, start
                                  async work; ``ctx.close_gate(request, name)`` when the
                                  request must not run before that work is done
    can_overlap(request)          once, after admit: False when the request's steps need the
                                  previous step's outputs on the host before they are planned
                                  (adapter or encoder inputs): its steps then run
                                  synchronously (async scheduling, core/inflight.py)
    overlaps_step(scheduled)      a step about to be planned while another is in flight: False
                                  when planning it changes state the step in flight reads
                                  (LoRA: an adapter loaded into a slot it uses): that step
                                  finishes first
    needs_outputs_first(seqs)     each launched step: True when process_logits for these
                                  choices reads state the previous step's outputs advance
                                  (a grammar): the forward overlaps, the masks wait for them
    tick()                        housekeeping: every step, and while the worker idles
    before_schedule()             every model step, before the scheduler runs
    wait_idle()                   nothing can be scheduled: wait briefly for your own async
                                  work (True: you had some, the step ends)
    on_stalled()                  requests wait but none can start and nothing runs: True
                                  when the component holds blocks that will come back
    on_scheduled(scheduled)       the step's batch, before the forward
    process_logits(seqs, specs, logits)  the sampling rows' logits, right before the sampler:
                                  modify them in place (grammar masks); seqs[i] owns
                                  1 + len(specs[i]) consecutive rows, row j the distribution
                                  after its drafts specs[i][:j] (speculative verification)
    on_sampled(outs, rows, res)   the step's outputs, with each output's first sampler row
    on_finished(seq)              a choice finished (stop, length or abort), blocks still held
    forget(request)               the request is gone (finished, aborted or failed)
    fill_deltas(outs, deltas)     the step's outputs become wire CompletionDeltas (engine.py)
    fill_load(load)               the worker's load report
    on_kv_cache_released()        sleep released the KV cache / start and wake-up allocated it
    on_kv_cache_allocated()
    on_model_replaced(model)      wake-up reloaded the weights into a new model (None: released)
    close()                       the engine shuts down

Readiness gates (core/gates.py) instead of an order between components: a request
whose KV blocks are pulled (``kv_pull``), whose encodings are pulled (``encoder_pull``)
or whose grammar compiles (``grammar``) has that gate closed by the component that
does the work, in ``admit``; the component opens it (``ctx.open_gate``) from ``tick`` /
``wait_idle`` when the work is done, and the core queues the request for the scheduler
once *every* gate is open -- several components may wait on one request at once, none
knows of the others.  Work that can never finish (a failed transfer, a grammar that
does not compile) fails the request instead (``ctx.fail_request``: its choices are
aborted, its blocks freed, its other gates dropped); opening a gate of a request that is
gone changes nothing.  Limits that depend on the running batch rather than on the
request (LoRA's adapter slots) are the scheduler's ``limits``, not gates.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from common.protocol import CompletionDelta, GenerateRequest, WorkerLoad
    from worker.engine.records import EngineSequence, Request, SequenceOutput
    from worker.engine.sample.sampler import SamplerOutput
    from worker.engine.step_plan import ScheduledSeq


class EngineContext(Protocol):
    """What a component may do to the engine and read of it; the core hands its
    implementation (core/context.py: CoreContext) to the components it builds, never
    itself.  Live values: each read asks the core."""

    config: Any  # EngineConfig
    device: Any  # torch.device
    model_config: Any  # ModelConfig
    tokenizer: Any  # None when serving tokens only
    max_model_len: int
    block_manager: Any  # KV blocks a P/D leg reserves, holds and frees; the prefix cache's reset
    model_info: Any  # common.protocol.ModelInfo: what the worker announces (LoRA keeps its adapters there)

    def kv_cache(self) -> "Optional[torch.Tensor]": ...

    def add_admission_limit(self, limit: Any) -> None: ...

    def set_draft_source(self, source: Any) -> None: ...

    def add_draft_filter(self, keep: Any) -> None: ...

    def running(self) -> "list[EngineSequence]": ...

    def waiting(self) -> "list[EngineSequence]": ...

    def is_live(self, request_id: str) -> bool: ...

    def close_gate(self, request: "Request", name: str) -> None: ...

    def open_gate(self, request: "Request", name: str) -> None: ...

    def fail_request(self, request: "Request", status: int, message: str, param: str) -> None: ...

    def forget_request(self, request: "Request") -> None: ...

    # the engine-wide commands of RL control (rl/control.py), between two steps
    def drain(self) -> None: ...

    def preempt_all(self) -> None: ...

    def release_kv_cache(self) -> None: ...

    def allocate_kv_cache(self) -> None: ...

    def replace_model(self, model: Any) -> None: ...


class EngineWiring(Protocol):
    """What ``EngineCore`` asks of the features it runs with while it is built; it imports
    none of them (worker/engine/build.py's ``EngineFeatures`` is the implementation,
    ``Engine`` hands it over).  Without one the core runs the bare loop."""

    def start(self, ctx: EngineContext) -> None:
        """Before the model is built: configuration checks, tensor parallelism's followers."""

    def install(self, ctx: EngineContext, runner: Any) -> None:
        """The runner exists, its KV cache is not sized yet: the features' runner hooks."""

    def components(self, ctx: EngineContext, runner: Any) -> "list[EngineComponent]":
        """Scheduler, block manager and model info exist: the components, in hook order."""

    def parse_images(self, req: "GenerateRequest") -> Any:
        """The request's images checked against the model (MultiModalState, None: none)."""

    # after components(): an engine that runs another step than the model's (encoder-only)
    # and why async scheduling cannot run
    step: "Optional[Callable[[], list[SequenceOutput]]]"
    overlap_blocker: Optional[str]


HOOKS = ("check", "admit", "can_overlap", "overlaps_step", "needs_outputs_first", "holds_steps", "tick", "before_schedule", "wait_idle", "on_stalled",
         "on_scheduled", "process_logits", "on_sampled",
         "on_finished", "forget", "fill_deltas", "fill_load", "on_kv_cache_released",
         "on_kv_cache_allocated", "on_model_replaced", "close")


class EngineComponent:
    """Base class: every hook is a no-op; override the ones the feature needs."""

    name = "component"
    needs_sampler_masks = False  # the sampler returns each row's surviving token ids (on_sampled's result.masks)

    def check(self, req: "GenerateRequest", mm: Any) -> None:
        """Refuse a request (raise a ClientError) before anything is registered; ``mm``:
        its MultiModalState (multimodal/images.py) or None."""

    def admit(self, request: "Request", seq: "EngineSequence") -> None:
        """The request is registered (``seq``: its choice 0): keep what the feature needs
        of it, start its async work and close the gate that work opens
        (``ctx.close_gate``).  Raising undoes the admission (every component's
        ``forget`` runs)."""

    def can_overlap(self, request: "Request") -> bool:
        """Whether the request's steps may be planned while its previous step is still in
        flight (async scheduling): the plan then cannot know the token that step samples.
        False when this feature needs that token on the host first -- the request's steps
        run synchronously, the others keep overlapping."""
        return True

    def overlaps_step(self, scheduled: list) -> bool:
        """Async scheduling, a step in flight: whether this batch (after ``on_scheduled``)
        can be planned while that step runs.  False when planning it would change state
        the step in flight reads -- the core then finishes that step first (this step runs
        synchronously)."""
        return True

    def needs_outputs_first(self, seqs: list) -> bool:
        """Async scheduling: whether this step's ``process_logits`` for ``seqs`` (its
        sampling choices) reads state that the previous step's outputs advance on the host
        (``on_sampled``): the step's forward still overlaps, its logits processors wait
        until the host processed those outputs."""
        return False

    def holds_steps(self) -> bool:
        """True while the engine must not step at all (sleep released its KV cache or
        weights): requests wait, nothing runs, not even housekeeping."""
        return False

    def tick(self) -> None:
        """Housekeeping: every step, and while the worker idles (no model step then)."""

    def before_schedule(self) -> None:
        """Every model step, before the scheduler runs."""

    def wait_idle(self) -> bool:
        """Nothing is scheduled: wait a little for the component's own async work (a pull);
        True when it had some (the later components are not asked)."""
        return False

    def on_stalled(self) -> bool:
        """Requests wait, none can start, nothing runs: True when this component holds
        KV blocks that come back (it may wait a little for them); False: not its doing."""
        return False

    def on_scheduled(self, scheduled: "list[ScheduledSeq]") -> None:
        """The step's batch, before the forward (may reorder it)."""

    def process_logits(self, seqs: "list[EngineSequence]", specs: "list[tuple]", logits: "torch.Tensor") -> None:
        """The step's sampling logits, before the sampler (and its logprobs) reads them:
        modify them in place.  ``seqs[i]`` owns ``1 + len(specs[i])`` consecutive rows
        (in order); its row ``j`` is the distribution after its drafts ``specs[i][:j]``."""

    def on_sampled(self, outs: "list[SequenceOutput]", first_rows: "list[int]", result: "SamplerOutput") -> None:
        """The step's outputs; ``first_rows[i]``: the sampler row of ``outs[i]``'s first token."""

    def on_finished(self, seq: "EngineSequence") -> None:
        """A choice finished or was aborted; its KV blocks are not freed yet."""

    def forget(self, request: "Request") -> None:
        """The request is gone from the engine: drop what is kept for it."""

    def fill_deltas(self, outs: "list[SequenceOutput]", deltas: "list[CompletionDelta]") -> None:
        """Add this feature's fields to the wire deltas of outputs (``deltas[i]`` packs
        ``outs[i]``); return at once when the component has nothing to add."""

    def fill_load(self, load: "WorkerLoad") -> None:
        """Add this feature's fields to the load report."""

    def on_kv_cache_released(self) -> None:
        """Sleep released the KV cache: release what lives beside it (a draft model's cache)."""

    def on_kv_cache_allocated(self) -> None:
        """The KV cache was allocated: when the engine starts, and at wake-up."""

    def on_model_replaced(self, model: Any) -> None:
        """Wake-up reloaded the weights into a new model object (None: sleep released
        it): re-attach what lives in the model (LoRA's slots)."""

    def close(self) -> None:
        """The engine shuts down."""


class Hooks:
    """Per hook, the bound methods of the components that override it (in order)."""

    def __init__(self, components: "list[EngineComponent]"):
        for hook in HOOKS:
            base = getattr(EngineComponent, hook)
            setattr(self, hook, [getattr(c, hook) for c in components if getattr(type(c), hook) is not base])

    # typed views (the attributes are set above)
    check: list[Callable[..., Any]]
    admit: list[Callable[..., None]]
    can_overlap: list[Callable[..., bool]]
    overlaps_step: list[Callable[..., bool]]
    needs_outputs_first: list[Callable[..., bool]]
    holds_steps: list[Callable[[], bool]]
    tick: list[Callable[[], None]]
    before_schedule: list[Callable[[], None]]
    wait_idle: list[Callable[[], bool]]
    on_stalled: list[Callable[[], bool]]
    on_scheduled: list[Callable[..., None]]
    process_logits: list[Callable[..., None]]
    on_sampled: list[Callable[..., None]]
    on_finished: list[Callable[..., None]]
    forget: list[Callable[..., None]]
    fill_deltas: list[Callable[..., None]]
    fill_load: list[Callable[..., None]]
    on_kv_cache_released: list[Callable[[], None]]
    on_kv_cache_allocated: list[Callable[[], None]]
    on_model_replaced: list[Callable[..., None]]
    close: list[Callable[[], None]]
