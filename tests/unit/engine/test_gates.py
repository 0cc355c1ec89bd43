"""Readiness gates (worker/engine/core/gates.py): a request runs once every gate a
component closed for it is open; a gate that never opens fails that request alone."""
from __future__ import annotations

import pytest

from tests.support.engine_helpers import hf_greedy, make_engine, request
from worker.engine.component import EngineComponent, Hooks
from worker.engine.core.gates import Gates


class Gating(EngineComponent):
    """Closes the named gates of the requests it is told about, at admission (as a pull
    or a compile does); the test opens them."""

    name = "gating"

    def __init__(self, ctx, gates: dict[str, tuple[str, ...]]):
        self.ctx = ctx
        self.gates = gates  # request id -> gate names
        self.requests: dict = {}

    def admit(self, request, seq):
        for name in self.gates.get(request.request_id, ()):
            self.ctx.close_gate(request, name)
        self.requests[request.request_id] = request


def _engine(llama_dir, gates, **kw):
    engine = make_engine(llama_dir, **kw)
    gating = Gating(engine.context, gates)
    engine.components.insert(0, gating)
    engine.hooks = Hooks(engine.components)
    return engine, gating


def _steps(engine, n, got):
    for _ in range(n):
        for d in engine.step():
            got.setdefault(d.request_id, []).extend(d.token_ids)


def test_gate_bookkeeping():
    gates = Gates()
    gates.close("r", "a")
    gates.close("r", "b")
    assert "r" in gates and gates.closed("r") == {"a", "b"} and len(gates) == 1
    assert not gates.open("r", "a") and not gates.open("r", "a")  # opened twice: no change
    assert not gates.open("r", "never-closed")
    assert gates.open("r", "b") and "r" not in gates and gates.closed("r") == frozenset()
    gates.close("s", "a")
    gates.drop("s")
    assert not gates.open("s", "a") and not len(gates)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_with_two_gates_runs_only_after_both_open(llama_dir, async_scheduling):
    engine, gating = _engine(llama_dir, {"gated": ("a", "b")}, async_scheduling=async_scheduling)
    prompt = [5, 6, 7, 8, 9]
    engine.add_request(request("gated", prompt, max_tokens=6, ignore_eos=True))
    engine.add_request(request("plain", [3, 4], max_tokens=8, ignore_eos=True))
    got: dict = {}
    gated = gating.requests["gated"]
    _steps(engine, 3, got)
    assert "gated" not in got and got["plain"]  # the other request runs meanwhile
    assert engine.gates.closed("gated") == {"a", "b"} and not engine.scheduler.waiting()
    engine.context.open_gate(gated, "a")
    _steps(engine, 3, got)
    assert "gated" not in got and engine.gates.closed("gated") == {"b"}
    assert gated.sequences[0].num_computed_tokens == 0 and not gated.sequences[0].block_ids
    engine.context.open_gate(gated, "b")
    assert "gated" not in engine.gates and engine.scheduler.waiting() == [gated.sequences[0]]
    while engine.has_unfinished():
        _steps(engine, 1, got)
    assert got["gated"] == hf_greedy(llama_dir, prompt, 6)[0]  # ran whole, from its first token
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_gate_that_never_opens_fails_that_request_alone(llama_dir):
    engine, gating = _engine(llama_dir, {"doomed": ("pull",)})
    bm = engine.block_manager
    engine.add_request(request("doomed", [5, 6, 7, 8, 9], max_tokens=6, ignore_eos=True))
    engine.add_request(request("plain", [3, 4], max_tokens=8, ignore_eos=True))
    got: dict = {}
    _steps(engine, 2, got)
    engine.context.fail_request(gating.requests["doomed"], 503, "the pull failed", "kv_transfer_params")
    assert "doomed" not in engine.requests and "doomed" not in engine.gates
    assert engine.take_request_errors() == [("doomed", 503, "the pull failed", "kv_transfer_params")]
    while engine.has_unfinished():
        _steps(engine, 1, got)
    assert "doomed" not in got and got["plain"] == hf_greedy(llama_dir, [3, 4], 8)[0]
    assert bm.num_free_blocks == bm.num_blocks and not engine.scheduler.has_unfinished()


def test_failing_a_request_that_already_runs_frees_its_blocks(llama_dir):
    """A failure found after the gates opened (a grammar's dead end) aborts the running
    choices: their blocks come back, the other requests go on."""
    engine, gating = _engine(llama_dir, {})
    bm = engine.block_manager
    engine.add_request(request("fails", list(range(3, 40)), max_tokens=20, ignore_eos=True))
    engine.add_request(request("plain", [3, 4], max_tokens=8, ignore_eos=True))
    got: dict = {}
    _steps(engine, 2, got)
    seq = gating.requests["fails"].sequences[0]
    assert seq.block_ids and seq in engine.scheduler.running
    engine.context.fail_request(gating.requests["fails"], 400, "dead end", "structured_outputs")
    assert seq not in engine.scheduler.running and not seq.block_ids
    assert [e[0] for e in engine.take_request_errors()] == ["fails"]
    engine.context.fail_request(gating.requests["fails"], 400, "again", "structured_outputs")  # gone: nothing
    assert engine.take_request_errors() == []
    while engine.has_unfinished():
        _steps(engine, 1, got)
    assert got["plain"] == hf_greedy(llama_dir, [3, 4], 8)[0]
    assert bm.num_free_blocks == bm.num_blocks


def test_a_gate_opened_after_the_abort_changes_nothing(llama_dir):
    engine, gating = _engine(llama_dir, {"r": ("pull",)})
    engine.add_request(request("r", [5, 6, 7], max_tokens=4, ignore_eos=True))
    old = gating.requests["r"]
    engine.abort("r")
    assert "r" not in engine.requests and "r" not in engine.gates
    engine.context.open_gate(old, "pull")  # the pull finished after the abort
    assert not engine.scheduler.has_unfinished() and not engine.has_unfinished()
    # A new request under the same id waits at its own gate: the old request's opening is no
    # business of it.
    engine.add_request(request("r", [5, 6, 7], max_tokens=4, ignore_eos=True))
    new = gating.requests["r"]
    engine.context.open_gate(old, "pull")
    assert engine.gates.closed("r") == {"pull"} and not engine.scheduler.waiting()
    engine.context.open_gate(new, "pull")
    got: dict = {}
    while engine.has_unfinished():
        _steps(engine, 1, got)
    assert got["r"] == hf_greedy(llama_dir, [5, 6, 7], 4)[0]


def test_gates_are_closed_at_admission_only(llama_dir):
    engine, gating = _engine(llama_dir, {})
    engine.add_request(request("r", [5, 6, 7], max_tokens=4, ignore_eos=True))
    with pytest.raises(RuntimeError, match="at admission"):
        engine.context.close_gate(gating.requests["r"], "late")


def test_a_gate_closed_and_opened_inside_admission_queues_the_request_once(llama_dir):
    """Work that is done at once (a grammar in the cache, encodings cached) may open its
    gate before admission ends: the request is queued once, by the core."""
    engine = make_engine(llama_dir)

    class Instant(EngineComponent):
        def admit(self, request, seq):
            engine.context.close_gate(request, "instant")
            engine.context.open_gate(request, "instant")

    engine.components.insert(0, Instant())
    engine.hooks = Hooks(engine.components)
    engine.add_request(request("r", [5, 6, 7], max_tokens=4, ignore_eos=True))
    assert len(engine.scheduler.waiting()) == 1 and "r" not in engine.gates
