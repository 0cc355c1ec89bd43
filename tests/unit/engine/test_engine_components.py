"""The engine's component interface (worker/engine/component.py) and the worker's
protocol (worker/engine/api.py)."""
from __future__ import annotations

from tests.support.engine_helpers import make_engine
from worker.engine.api import EngineAPI, LoRAControlAPI, RLControlAPI
from worker.engine.component import HOOKS, EngineComponent, Hooks
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


def test_components_get_the_narrow_context_not_the_core(llama_dir):
    """Issue 41: the components hold the core's EngineContext, never the core itself
    (RL control included: drain, preemption, the KV cache's release and the model's
    replacement are named entries of the context; it holds the runner it writes)."""
    from worker.engine.component import EngineContext
    from worker.engine.core.engine_core import EngineCore

    engine = make_engine(llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    holders = {type(c).__name__: [k for k, v in vars(c).items() if isinstance(v, EngineCore)]
               for c in engine.components}
    assert not {name for name, keys in holders.items() if keys}, holders
    ctx = engine.context
    for name in ("config", "device", "model_config", "tokenizer", "max_model_len", "block_manager", "kv_cache",
                 "running", "waiting", "is_live", "close_gate", "open_gate", "fail_request", "forget_request",
                 "model_info", "add_admission_limit", "drain", "preempt_all", "release_kv_cache",
                 "allocate_kv_cache", "replace_model"):
        assert hasattr(ctx, name) and name in EngineContext.__dict__ | EngineContext.__annotations__, name
    assert ctx.max_model_len == engine.max_model_len and ctx.kv_cache() is engine.runner.kv_cache
    assert {c.ctx for c in engine.components if hasattr(c, "ctx")} == {ctx}
    assert not ctx.is_live("nope") and ctx.running() == [] and ctx.waiting() == []


def test_the_bare_core_runs_without_any_feature(llama_dir):
    """EngineCore without the builder (worker/engine/build.py) is the loop alone: no
    component, no hook; it serves plain requests and refuses what needs a feature."""
    import pytest

    from common.errors import NotFound
    from common.protocol import GenerateRequest
    from tests.support.engine_helpers import request
    from worker.engine import EngineConfig
    from worker.engine.core.engine_core import EngineCore

    core = EngineCore(EngineConfig(model=str(llama_dir), max_model_len=256, num_threads=1, dtype="float32"))
    assert core.components == [] and all(getattr(core.hooks, h) == [] for h in HOOKS)
    assert core.model_info.lora_adapters is None and core.model is core.runner.model
    with pytest.raises(NotFound, match="does not exist"):
        core.add_request(GenerateRequest(request_id="lora", prompt_token_ids=[1, 2],
                                         params=request("x", [1], max_tokens=2).params, lora_name="nope"))
    core.add_request(request("a", [5, 6, 7], max_tokens=3, ignore_eos=True))
    got = []
    while core.has_unfinished():
        got += [t for out in core.step() for t in out.new_token_ids]
    assert len(got) == 3
    core.close()
