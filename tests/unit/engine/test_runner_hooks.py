"""The model runner's feature hooks (worker/engine/runner/hooks.py): what the engine
installs for each feature, and that the runner calls each kind of hook where the
feature used to be a branch."""
from __future__ import annotations

from tests.support.engine_helpers import make_engine, random_prompts, request, run_to_completion, tokens_of
from worker.engine.runner.hooks import LOCAL, LocalRun, StepExtras


def _greedy(engine, prompts, n=6):
    for i, p in enumerate(prompts):
        engine.add_request(request(str(i), p, max_tokens=n, ignore_eos=True))
    out = run_to_completion(engine)
    return [tokens_of(out[(str(i), 0)]) for i in range(len(prompts))]


def test_a_plain_engine_installs_nothing(llama_dir):
    runner = make_engine(llama_dir).runner
    assert runner.hooks == [] and runner.parallel is LOCAL


def test_features_install_their_hooks(tiny_model):
    from worker.engine.components.routing_capture import RoutingCapture

    moe = make_engine(tiny_model("qwen3_moe"), enable_return_routed_experts=True).runner
    assert [type(h) for h in moe.hooks] == [RoutingCapture] and moe.routing_store is not None
    moe.release_kv_cache()
    assert moe.routing_store is None
    moe.allocate_kv_cache(8)
    assert moe.routing_store.shape[0] == 8 * moe.block_size


def test_lora_serving_installs_its_step_inputs(llama_dir):
    from worker.engine.lora.step_inputs import LoRAStepInputs

    runner = make_engine(llama_dir, enable_lora=True).runner
    assert [type(h) for h in runner.hooks] == [LoRAStepInputs] and runner._graph_inputs is runner.hooks[0]


class _Recording(LocalRun):
    def __init__(self):
        self.calls = []

    def before_step(self, layout):
        self.calls.append(("step", layout.num_tokens))

    def before_logits(self, rows):
        self.calls.append(("logits", len(rows)))

    def before_alloc(self, num_blocks, max_model_len):
        self.calls.append(("alloc", num_blocks))


def test_the_parallel_hook_sees_every_step_logits_and_allocation(llama_dir):
    engine = make_engine(llama_dir)
    hook = _Recording()
    engine.runner.set_parallel(hook)
    _greedy(engine, random_prompts(2, 3, 20, seed=3), n=3)
    steps = [c for c in hook.calls if c[0] == "step"]
    assert steps and all(a[0] == "step" for a, b in zip(hook.calls, hook.calls[1:]) if b[0] == "logits")
    engine.runner.allocate_kv_cache(4)
    assert hook.calls[-1] == ("alloc", 4)


class _Eager:
    """Marks every step eager, adding nothing else: outputs must not change."""

    def __init__(self):
        self.steps = 0

    def contribute(self, scheduled, layout, extras: StepExtras) -> None:
        self.steps += 1
        extras.eager = True


def test_an_input_contributor_runs_each_step_and_eager_steps_match(llama_dir):
    prompts = random_prompts(3, 3, 30, seed=5)
    expected = _greedy(make_engine(llama_dir), prompts)
    engine = make_engine(llama_dir)
    eager = _Eager()
    engine.runner.install(eager)
    assert engine.runner.hooks == [eager]
    assert _greedy(engine, prompts) == expected
    assert eager.steps > 0
