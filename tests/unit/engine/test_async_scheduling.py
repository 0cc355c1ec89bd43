"""Async scheduling (issue 41): the engine plans step N+1 while step N runs, with the
token N samples still in flight.  Whatever the feature, the outputs are those of the
synchronous step: same tokens, logprobs (bitwise on CPU), texts, finish reasons,
prompt logprobs.  Requests whose sampling reads the tokens generated so far
(penalties, min_tokens, bad words, grammars) overlap their forwards and wait for the
token in flight before sampling; adapter requests overlap unless their adapters cannot
load beside the step in flight's; steps of a request that cannot be planned ahead
(images, KV transfer) run synchronously, the others keep overlapping."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.support.engine_helpers import make_engine, random_prompts, request, run_to_completion
from common.protocol import StructuredOutputs
from tests.support.model_factory import EOS_ID

pytestmark = pytest.mark.timeout(300)


def _outputs(engine, reqs, *, staggered: bool = False):
    """Every delta's content per (request, choice), merged in order."""
    got: dict = {}
    pending = list(reqs)
    if not staggered:
        for r in pending:
            engine.add_request(r)
        pending = []
    for _ in range(20_000):
        if pending:
            engine.add_request(pending.pop(0))
        elif not engine.has_unfinished():
            break
        for d in engine.step():
            entry = got.setdefault((d.request_id, d.index), {"tokens": [], "logprobs": [], "text": "",
                                                               "finish": None, "stop": None, "prompt": None,
                                                               "routed_experts": None})
            entry["tokens"] += d.token_ids
            if d.logprobs is not None:
                lp = d.logprobs
                entry["logprobs"] += list(zip(lp.token_ids, lp.logprobs, lp.ranks,
                                              [tuple(x) for x in lp.top_ids], [tuple(x) for x in lp.top_logprobs]))
            entry["text"] += d.text or ""
            if d.prompt_logprobs is not None:
                entry["prompt"] = (d.prompt_logprobs.token_ids, d.prompt_logprobs.logprobs)
            if d.routed_experts is not None:  # .npy bytes of every position the model ran
                entry["routed_experts"] = d.routed_experts
            if d.finish_reason is not None:
                entry["finish"], entry["stop"] = d.finish_reason, d.stop_reason
    else:
        raise AssertionError("engine did not finish")
    return got


def _both(model_dir, make_reqs, staggered=False, **overrides):
    results, counts = {}, {}
    for mode in (False, True):
        engine = make_engine(model_dir, async_scheduling=mode, **overrides)
        results[mode] = _outputs(engine, make_reqs(), staggered=staggered)
        counts[mode] = dict(engine.step_counts)
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks, "every block comes back"
        assert not any(s.num_pending for r in engine.requests.values() for s in r.sequences)
        engine.close()
    assert results[True] == results[False]
    assert counts[False].get("overlapped", 0) == 0
    return results[True], counts[True]


def _greedy(n=6, lo=5, hi=40, seed=0, **params):
    prompts = random_prompts(n, lo, hi, seed=seed)
    params.setdefault("ignore_eos", True)
    return lambda: [request(f"r{i}", p, max_tokens=4 + 3 * i, **params) for i, p in enumerate(prompts)]


CASES = {
    # name: (model fixture, requests, engine overrides, staggered arrivals)
    "greedy_chunked": ("llama_dir", _greedy(), dict(max_num_batched_tokens=16), False),
    "greedy_staggered": ("llama_dir", _greedy(8, seed=3), {}, True),
    "seeded_sampling_and_forks": ("llama_dir", lambda: [
        request(f"s{i}", p, max_tokens=9, ignore_eos=True, temperature=0.9, top_p=0.9, top_k=20, seed=7 + i,
                n=1 + i % 3)
        for i, p in enumerate(random_prompts(5, 8, 30, seed=4))], {}, True),
    "logprobs_and_prompt_logprobs": ("llama_dir", lambda: [
        request(f"l{i}", p, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
        for i, p in enumerate(random_prompts(4, 5, 25, seed=5))], dict(max_num_batched_tokens=16), False),
    "eos_and_stop_ids": ("qwen2_dir", lambda: [
        request("e", [5, 9, 33, 71, 2, 8], logit_bias={EOS_ID: 100.0}),
        request("x", [5, 9, 33, 71, 2, 8, 11], max_tokens=12),
        *[request(f"t{i}", p, max_tokens=10, stop_token_ids=[p[0], 17, 42, 99]) for i, p in
          enumerate(random_prompts(5, 4, 20, seed=6))]], {}, False),
    "preemption_prefix_cache_pressure": ("llama_dir", lambda: [
        request(str(i), random_prompts(1, 40, 41, seed=11)[0][:8 * (i % 4 + 1)] + t, max_tokens=6 + i % 3,
                ignore_eos=True, n=1 + i % 2, temperature=0.7 * (i % 2), seed=i)
        for i, t in enumerate(random_prompts(8, 1, 20, seed=12))],
        dict(num_kv_blocks=12, block_size=8, max_model_len=96, max_num_batched_tokens=12), True),
    "context_length_limit": ("llama_dir", lambda: [
        request(f"c{i}", p, max_tokens=100, ignore_eos=True) for i, p in enumerate(random_prompts(3, 50, 60))],
        dict(max_model_len=64), False),
    "text_and_stop_strings": ("llama_dir", lambda: [
        request(f"t{i}", [72, 101, 108, 108, 111, i + 3], max_tokens=16, ignore_eos=True, output_text=True,
                stop=["ab", "e", "zz"], allowed_token_ids=list(range(97, 123)), temperature=1.0, seed=i)
        for i in range(4)], {}, False),
    # Reading the tokens generated so far (their metadata waits for the token in flight), mixed with plain ones.
    "penalties_min_tokens_bad_words_beside_plain": ("qwen2_dir", lambda: [
        request("p", [5, 9, 33, 71], max_tokens=8, repetition_penalty=1.3, frequency_penalty=0.5),
        request("m", [5, 9, 33, 71, 2], logit_bias={EOS_ID: 100.0}, min_tokens=3),
        request("b", [5, 9, 33, 71, 2, 3], max_tokens=8, ignore_eos=True, bad_words=["ab", "c"]),
        *[request(f"g{i}", p, max_tokens=8, ignore_eos=True) for i, p in
          enumerate(random_prompts(4, 4, 20, seed=8))]], {}, True),
    # Routed-experts capture: each finished choice's rows read while the next step runs.
    "routed_experts_moe": ("qwen3_moe_dir", lambda: [
        request(f"r{i}", p, max_tokens=5 + 2 * i, ignore_eos=True, n=1 + i % 2, temperature=0.8 * (i % 2), seed=i,
                routed_experts_prompt_start=i % 3)
        for i, p in enumerate(random_prompts(5, 6, 30, seed=14))],
        dict(enable_return_routed_experts=True, max_num_batched_tokens=24), True),
    "structured_outputs_beside_plain": ("llama_dir", lambda: [
        request("so-digits", [1, 2, 3], max_tokens=12, structured_outputs=StructuredOutputs(regex="[0-9]{6}x")),
        request("so-choice", [4, 5], max_tokens=12, structured_outputs=StructuredOutputs(choice=["alpha", "beta"])),
        *[request(f"g{i}", p, max_tokens=10, ignore_eos=True) for i, p in
          enumerate(random_prompts(4, 4, 20, seed=13))]], {}, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_async_scheduling_gives_the_synchronous_outputs(case, request_fixture):
    fixture, make_reqs, overrides, staggered = CASES[case]
    model_dir = request_fixture(fixture)
    out, counts = _both(model_dir, make_reqs, staggered=staggered, **overrides)
    assert all(e["finish"] is not None for e in out.values())
    if overrides.get("enable_return_routed_experts"):  # captured, and equal to the synchronous step's
        assert all(e["routed_experts"] for e in out.values())
    assert counts.get("overlapped", 0) > 0, f"no step overlapped: {counts}"


@pytest.fixture
def request_fixture(request):
    return request.getfixturevalue


@pytest.fixture
def qwen3_moe_dir(tiny_model):
    return tiny_model("qwen3_moe")


@pytest.mark.parametrize("params", [dict(presence_penalty=1.0, frequency_penalty=0.7, repetition_penalty=1.4),
                                    dict(min_tokens=5, logit_bias={EOS_ID: 100.0}),
                                    dict(bad_words=["ab", "c"], output_text=True, temperature=1.0, seed=4)])
def test_requests_reading_their_history_overlap(qwen2_dir, params):
    """Penalties, min_tokens' stop masks and bad words read the tokens generated so far:
    their forwards overlap the previous step and their sampling metadata waits for its
    token -- the sampler always saw every earlier token (spied), the outputs equal the
    synchronous step's."""
    from worker.engine.sample.sampling_metadata import SamplingMetadata

    outs, seen = {}, {}
    original = SamplingMetadata.build

    def spy(rows, vocab_size, device):
        for r in rows:
            seen.setdefault(mode, []).append(len(r.output_token_ids))
        return original(rows, vocab_size, device)

    for mode in (False, True):
        engine = make_engine(qwen2_dir, async_scheduling=mode)
        SamplingMetadata.build = staticmethod(spy)
        try:
            got = engine.generate([request("h", [5, 9, 33, 71, 2], max_tokens=10, **params)])["h"]
        finally:
            SamplingMetadata.build = original
        outs[mode] = ([t for d in got for t in d.token_ids], got[-1].finish_reason)
        if mode:  # every step overlapped
            assert engine.step_counts.get("overlapped", 0) >= 5 and not engine.step_counts.get("synchronous"), \
                engine.step_counts
        engine.close()
    assert outs[True] == outs[False]
    n = len(outs[True][0])
    # each sampled token's metadata was built over exactly the tokens before it
    assert seen[True][:n] == seen[False][:n] == list(range(n))


def test_abort_while_a_step_is_in_flight(llama_dir):
    """An aborted choice's token in flight is dropped; what reached the client is a
    prefix of the full output, the abort is its last delta, every block comes back."""
    prompt = random_prompts(1, 10, 11, seed=5)[0]
    full = make_engine(llama_dir, async_scheduling=False).generate(
        [request("a", prompt, max_tokens=30, ignore_eos=True)])["a"][0].token_ids
    engine = make_engine(llama_dir, async_scheduling=True)
    engine.add_request(request("a", prompt, max_tokens=30, ignore_eos=True))
    deltas = []
    while sum(len(d.token_ids) for d in deltas) < 5:
        deltas += engine.step()
    assert engine._inflight is not None  # the next step is running
    deltas += engine.abort("a")
    deltas += engine.step()  # the step in flight finishes: its token is dropped
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == full[:len(tokens)] and deltas[-1].finish_reason == "abort"
    assert [d for d in deltas if d.finish_reason] == [deltas[-1]]
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_weight_changes_wait_for_the_step_in_flight(llama_dir):
    """RL control drains the step in flight before it touches the weights or the cache;
    the drained outputs still reach the client with the next step."""
    prompt = random_prompts(1, 10, 11, seed=9)[0]
    engine = make_engine(llama_dir, async_scheduling=True)
    engine.add_request(request("w", prompt, max_tokens=12, ignore_eos=True))
    deltas = []
    while not deltas:
        deltas += engine.step()
    assert engine._inflight is not None
    engine.rl.reset_prefix_cache()
    assert engine._inflight is None and engine.has_unfinished()
    rest = run_to_completion(engine)
    tokens = [t for d in deltas for t in d.token_ids] + [t for d in rest[("w", 0)] for t in d.token_ids]
    full = make_engine(llama_dir, async_scheduling=False).generate(
        [request("w", prompt, max_tokens=12, ignore_eos=True)])["w"][0].token_ids
    assert tokens == full


def test_no_async_scheduling_flag_pins_the_synchronous_step(llama_dir):
    engine = make_engine(llama_dir, async_scheduling=False)
    engine.generate([request("s", [3, 4, 5], max_tokens=5, ignore_eos=True)])
    assert engine.step_counts["synchronous"] >= 5 and not engine.executor.threaded


def test_cpu_default_is_the_synchronous_step_and_the_flag_turns_it_on(llama_dir):
    """As vLLM's CPU platform: no flag, no overlap on CPU; --async-scheduling overlaps."""
    assert not make_engine(llama_dir).executor.threaded
    on = make_engine(llama_dir, async_scheduling=True)
    on.generate([request("s", [3, 4, 5], max_tokens=5, ignore_eos=True)])
    assert on.executor.threaded and on.step_counts["overlapped"] >= 4


@pytest.mark.cuda
def test_cuda_graph_steps_fill_placeholders_on_the_device(llama_dir):
    """On a GPU the token in flight is written into the captured graph's static input
    buffer (``_DecodeGraph.run``'s fill) and into eager steps' inputs: same outputs as
    the synchronous step, CUDA graphs on."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    out, counts = _both(llama_dir, _greedy(8, seed=2), device="cuda", dtype="bfloat16")
    assert counts["overlapped"] > 0
    out2, counts2 = _both(llama_dir, CASES["seeded_sampling_and_forks"][1], device="cuda", staggered=True)
    assert counts2["overlapped"] > 0


def test_lora_requests_overlap_and_never_reload_a_slot_in_flight(llama_dir, tmp_path, monkeypatch):
    """Adapter requests overlap: adapters load into device slots while the next batch is
    planned, never into a slot the step in flight reads (spied at every slot write); when
    the batch's adapters cannot fit beside the in-flight step's, that step finishes first.
    Three adapters rotating through two slots beside base requests: outputs as without
    async scheduling, every step overlapped (the scheduler plans no step past a choice's
    length, so a finishing adapter's slot is free by the time another needs it)."""
    pytest.importorskip("peft")
    from tests.support.lora_factory import ATTENTION, build_adapter
    from worker.engine.lora.manager import LoRAManager

    adapters = {n: str(build_adapter(llama_dir, tmp_path / n, ATTENTION, rank=4, alpha=8, seed=3 + i))
                for i, n in enumerate("abc")}
    prompts = random_prompts(9, 5, 30, seed=14)

    def reqs():
        out = []
        for i, p in enumerate(prompts):
            r = request(f"r{i}", p, max_tokens=6 + i, ignore_eos=True)
            if i % 3:
                r.lora_name = "abc"[i % 3 - 1 + (i // 3) % 2]
            out.append(r)
        return out

    engines, writes = [], []
    original = LoRAManager._slot

    def spy(self, key, in_use):
        slot = self._slot_of.get(key)
        if slot is None:  # a load: the slot it takes must not be one the step in flight reads
            engine = next(e for e in engines if e.lora_manager is self)
            prev = engine._inflight
            lora = prev.run_plan.extras.lora if prev is not None and prev.run_plan.extras is not None else None
            busy = set(lora.token_slots.tolist()) if lora is not None else set()
            got = original(self, key, in_use)
            writes.append((got, busy))
            assert got not in busy, (got, busy)
            return got
        return original(self, key, in_use)

    monkeypatch.setattr(LoRAManager, "_slot", spy)
    import tests.support.engine_helpers as helpers

    made = helpers.make_engine

    def tracked(*args, **kwargs):
        engines.append(made(*args, **kwargs))
        return engines[-1]

    monkeypatch.setattr(sys.modules[__name__], "make_engine", tracked)
    _, counts = _both(llama_dir, reqs, staggered=True, enable_lora=True, max_loras=2, max_lora_rank=8,
                      lora_modules=adapters)
    assert counts["overlapped"] > 10, counts
    assert len(writes) >= 4  # adapters were (re)loaded, some while a step with adapters was in flight
    assert any(busy for _, busy in writes)


def test_adapters_that_cannot_load_beside_the_step_in_flight_wait_for_it(llama_dir, tmp_path):
    """Two slots held by the step in flight's adapters: a batch needing a third adapter
    cannot be planned beside it (``overlaps_step`` is False: that step finishes first,
    then any slot not in the batch is free to take)."""
    pytest.importorskip("peft")
    from tests.support.lora_factory import ATTENTION, build_adapter

    adapters = {n: str(build_adapter(llama_dir, tmp_path / n, ATTENTION, rank=4, alpha=8, seed=9))
                for n in "abc"}
    engine = make_engine(llama_dir, async_scheduling=True, enable_lora=True, max_loras=2, max_lora_rank=8,
                         lora_modules=adapters)
    manager = engine.lora_manager
    key = {n: manager.keys[n] for n in "abc"}
    manager.step_batch([key["a"], key["b"]], np.ones(2, dtype=np.int64))  # a and b resident
    assert manager.loadable_beside(frozenset({key["c"]}), frozenset())  # nothing in flight: evict one
    assert manager.loadable_beside(frozenset({key["a"], key["c"]}), frozenset({key["a"]}))  # b goes
    assert not manager.loadable_beside(frozenset({key["b"], key["c"]}), frozenset({key["a"], key["b"]}))
    manager.busy = frozenset({key["a"]})
    manager.step_batch([key["c"]], np.ones(1, dtype=np.int64))  # evicts b, never the busy a
    assert set(manager._slot_of) == {key["a"], key["c"]}


def test_structured_outputs_overlap_and_match_the_synchronous_step(llama_dir):
    """Grammar-constrained requests alone: their forwards overlap the previous step (the
    masks wait for its outputs, as vLLM computes the bitmask while the step runs), and
    every token is what the synchronous step gives -- the grammar always saw the token in
    flight before masking the next row."""
    def reqs():
        return [request("so-digits", [1, 2, 3], max_tokens=16, structured_outputs=StructuredOutputs(regex="[0-9]{8}x")),
                request("so-choice", [4, 5], max_tokens=12, structured_outputs=StructuredOutputs(choice=["alpha", "beta"])),
                request("so-json", [6, 7, 8], max_tokens=24, structured_outputs=StructuredOutputs(
                    json='{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}')),
                request("so-sampled", [9], max_tokens=14, temperature=1.0, seed=3,
                        structured_outputs=StructuredOutputs(regex="[a-c]{5}[0-9]{5}"))]

    outs = {}
    for mode in (False, True):
        engine = make_engine(llama_dir, async_scheduling=mode, max_num_batched_tokens=64)
        so = engine.structured_output
        masked: dict[str, list[int]] = {}  # per choice: its output length at each mask
        original = so.process_logits

        def spy(seqs, specs, logits):
            for seq in seqs:
                masked.setdefault(seq.request.request_id, []).append(len(seq.output_ids))
            return original(seqs, specs, logits)

        so.process_logits = spy
        engine.hooks.process_logits[engine.hooks.process_logits.index(original)] = spy
        got = engine.generate(reqs())
        # the grammar masks the row of output token i only once tokens 0..i-1 reached the
        # host (a last row planned past a stop may follow: its sample is dropped)
        for rid, ds in got.items():
            n = sum(len(d.token_ids) for d in ds)
            assert masked[rid][:n] == list(range(n)), (rid, masked[rid])
        outs[mode] = {rid: [t for d in ds for t in d.token_ids] for rid, ds in got.items()}
        if mode:
            assert engine.step_counts.get("overlapped", 0) >= 8, engine.step_counts
        engine.close()
    assert outs[True] == outs[False]


def test_an_adapter_stopping_early_makes_the_next_batch_wait_for_its_slot(llama_dir, tmp_path):
    """Adapter a stops on EOS (not a length the scheduler can foresee), so the step in
    flight still holds a's and b's slots when c's first batch is planned: that batch
    waits for the step in flight (a synchronous step), then loads c -- outputs as
    without async scheduling."""
    pytest.importorskip("peft")
    from tests.support.lora_factory import ATTENTION, build_adapter

    adapters = {n: str(build_adapter(llama_dir, tmp_path / n, ATTENTION, rank=4, alpha=8, seed=21))
                for n in "abc"}

    def reqs():
        out = [request("a", [5, 9, 33, 71], max_tokens=20, min_tokens=3, logit_bias={EOS_ID: 100.0}),
               request("b", [6, 10, 34], max_tokens=14, ignore_eos=True),
               request("c", [7, 11, 35, 72, 90], max_tokens=6, ignore_eos=True)]
        for r, n in zip(out, "abc"):
            r.lora_name = n
        return out

    out, counts = _both(llama_dir, reqs, staggered=True, enable_lora=True, max_loras=2, max_lora_rank=8,
                        lora_modules=adapters)
    assert out[("a", 0)]["finish"] == "stop" and len(out[("a", 0)]["tokens"]) == 4
    assert counts.get("synchronous", 0) > 0 and counts["overlapped"] > 5, counts
