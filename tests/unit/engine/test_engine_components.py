"""The engine's component interface (worker/engine/components/base.py) and the worker's
protocol (worker/engine/api.py)."""
from __future__ import annotations

from tests.support.engine_helpers import make_engine
from worker.engine.api import EngineAPI, LoRAControlAPI, RLControlAPI
from worker.engine.components.base import HOOKS, EngineComponent, Hooks
from worker.engine.components.routed_experts import RoutedExpertsCapture
from worker.engine.components.sampling_mask import SamplingMaskCapture


def _members(protocol) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")} | set(protocol.__annotations__)


def test_hooks_hold_only_the_components_that_implement_them():
    class Counter(EngineComponent):
        def on_finished(self, seq):
            pass

    plain, counter, mask = EngineComponent(), Counter(), SamplingMaskCapture()
    hooks = Hooks([plain, counter, mask])
    assert hooks.on_finished == [counter.on_finished]
    assert hooks.on_sampled == [mask.on_sampled] and hooks.fill_deltas == [mask.fill_deltas]
    assert all(getattr(hooks, h) == [] for h in HOOKS if h not in ("on_finished", "on_sampled", "fill_deltas"))


def test_a_plain_engine_calls_few_hooks(llama_dir):
    engine = make_engine(llama_dir)
    assert not engine.hooks.on_scheduled and engine.hooks.check  # the transfer checks stay on
    assert engine.lora is None and not any(isinstance(c, RoutedExpertsCapture) for c in engine.components)
    # structured outputs are always served (as vLLM): their hooks return at once without a grammar
    assert [c.name for c in engine.components] == ["rl", "encoder_disaggregation", "kv_transfer", "structured_output"]


def test_the_engine_and_the_fake_worker_implement_the_worker_protocol(llama_dir):
    from tests.support.fake_worker import FakeEngine

    engine, fake = make_engine(llama_dir, enable_lora=True), FakeEngine()
    for obj in (engine, fake):
        missing = [n for n in _members(EngineAPI) if not hasattr(obj, n)]
        assert not missing, (type(obj).__name__, missing)
    assert not [n for n in _members(RLControlAPI) if not hasattr(engine.rl, n)]
    assert not [n for n in _members(LoRAControlAPI) if not hasattr(engine.lora, n)]
