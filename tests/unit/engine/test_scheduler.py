"""Scheduler policy without a model: budgets, chunking, seats, preemption, priority."""
from __future__ import annotations

import itertools

from common.protocol import GenerateRequest, SamplingParams
from worker.engine.core.block_manager import BlockManager
from worker.engine.records import Request, EngineSequence
from worker.engine.core.scheduler import Scheduler

BS = 4
_arrival = itertools.count()


def make_seq(n_prompt, *, priority=0, rid=None):
    rid = rid or f"r{next(_arrival)}"
    req = GenerateRequest(request_id=rid, prompt_token_ids=list(range(1, n_prompt + 1)),
                          params=SamplingParams(), priority=priority)
    request = Request(req, arrival_seq=next(_arrival), max_tokens=100, eos_token_ids=[], now=0.0)
    return EngineSequence(request, 0, list(req.prompt_token_ids))


def make_sched(num_blocks=64, budget=32, max_seqs=8, chunked=True):
    bm = BlockManager(num_blocks, BS, enable_prefix_caching=False)
    return Scheduler(bm, max_num_seqs=max_seqs, token_budget=budget, max_model_len=256,
                     enable_chunked_prefill=chunked)


def run_step(sched):
    """Schedule, pretend the model ran, and append a token to every sequence that finished its tokens."""
    out = sched.schedule()
    sched.update_after_step(out.scheduled)
    for s in out.scheduled:
        if s.seq.num_computed_tokens == s.seq.num_tokens:
            s.seq.append_token(7)
    return out


def test_chunked_prefill_respects_token_budget_and_mixes_decode():
    sched = make_sched(budget=10)
    a, b = make_seq(6), make_seq(25)
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 6), (b, 4)]
    out = run_step(sched)  # a decodes (1 token), b gets the next chunk of 9
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 9)]
    assert out.num_tokens == 10
    run_step(sched)  # 1 + 9
    out = run_step(sched)  # 1 + the last 3 prompt tokens: b samples its first token
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 3)]
    assert b.num_computed_tokens == 25 and b.num_output_tokens == 1
    out = run_step(sched)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 1)]


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    sched = make_sched(budget=10, chunked=False)
    a, b = make_seq(6), make_seq(8)
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    assert [s.seq for s in out.scheduled] == [a]  # b (8) does not fit in the 4 left
    out = run_step(sched)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 8)]


def test_max_num_seqs_limits_running():
    sched = make_sched(max_seqs=2)
    seqs = [make_seq(3) for _ in range(4)]
    for s in seqs:
        sched.add(s)
    run_step(sched)
    assert sched.num_running == 2 and sched.num_waiting == 2
    sched.remove(seqs[0])
    run_step(sched)
    assert sched.num_running == 2 and seqs[2] in sched.running


def test_preemption_when_blocks_run_out_recomputes_later():
    sched = make_sched(num_blocks=4, budget=64)
    a, b = make_seq(8), make_seq(7)  # 2 blocks each: the pool is full after prefill
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert sched.bm.num_free_blocks == 0
    out = run_step(sched)  # a needs a third block: b (latest arrival) is preempted
    assert out.preempted == [b]
    assert b.num_computed_tokens == 0 and b.block_ids == [] and b.num_tokens == 8
    assert [s.seq for s in out.scheduled] == [a]
    sched.remove(a)
    out = run_step(sched)  # b comes back and recomputes its prompt + generated token
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(b, 8)]
    assert sched.num_preemptions == 1


def test_waiting_queue_is_ordered_by_priority_then_arrival():
    sched = make_sched(max_seqs=1)
    low, high, mid = make_seq(3, priority=5), make_seq(3, priority=-1), make_seq(3, priority=2)
    for s in (low, high, mid):
        sched.add(s)
    order = []
    for _ in range(3):
        out = run_step(sched)
        order.append(out.scheduled[0].seq)
        sched.remove(out.scheduled[0].seq)
    assert order == [high, mid, low]


def test_better_priority_arrival_preempts_running():
    sched = make_sched(max_seqs=1)
    low = make_seq(3, priority=5)
    sched.add(low)
    run_step(sched)
    high = make_seq(3, priority=0)
    sched.add(high)
    out = run_step(sched)
    assert [s.seq for s in out.scheduled] == [high]
    assert low in [item[3] for item in sched._waiting] and low.num_computed_tokens == 0
    # Equal priority never preempts.
    same = make_seq(3, priority=0)
    sched.add(same)
    out = run_step(sched)
    assert [s.seq for s in out.scheduled] == [high]
