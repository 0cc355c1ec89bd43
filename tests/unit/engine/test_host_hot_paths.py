"""The cheap paths of a step's host work (issue 41): each must decide exactly what the
general path decides -- block allocation, prefix-cache publication, sampling metadata,
the greedy pick -- only without the per-sequence bookkeeping when nothing changed."""
from __future__ import annotations

import itertools

import pytest
import torch

from common.protocol import GenerateRequest, SamplingParams
from worker.engine.core.block_manager import BlockManager
from worker.engine.records import EngineSequence, Request
from worker.engine.core.scheduler import Scheduler
from worker.engine.sample.sampler import argmax_rows
from worker.engine.sample.sampling_metadata import MetadataCache, SamplingRow

BS = 4
_ids = itertools.count()


def _seq(n_prompt: int, prompt_base: int = 1) -> EngineSequence:
    req = GenerateRequest(request_id=f"h{next(_ids)}", prompt_token_ids=list(range(prompt_base, prompt_base + n_prompt)),
                          params=SamplingParams())
    request = Request(req, arrival_seq=next(_ids), max_tokens=100, eos_token_ids=[], now=0.0)
    return EngineSequence(request, 0, list(req.prompt_token_ids))


def _step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    sched.update_after_step(out.scheduled)
    for s in out.scheduled:
        if s.seq.num_computed_tokens == s.seq.num_tokens:
            s.seq.append_token(token)
    return out


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_decode_allocates_a_block_exactly_when_it_crosses_one(prefix_caching, monkeypatch):
    bm = BlockManager(32, BS, enable_prefix_caching=prefix_caching)
    sched = Scheduler(bm, max_num_seqs=4, token_budget=64, max_model_len=256)
    seq = _seq(5)
    sched.add(seq)
    _step(sched)  # prefill: 5 tokens in 2 blocks, the first token sampled
    calls = []
    real = bm.allocate_slots
    monkeypatch.setattr(bm, "allocate_slots", lambda s, n, cached=(): calls.append(s.num_computed_tokens) or real(s, n, cached))
    for _ in range(8):
        _step(sched)
    # Tokens 6..13 computed: only the decodes of positions 8 and 12 start a new block.
    assert calls == [8, 12]
    assert len(seq.block_ids) == 4 and bm.num_free_blocks == 28


def test_blocks_are_published_as_they_complete():
    """update_after_step publishes each block the step completed, as the full path does
    (two sequences with the same tokens: the second finds the first's blocks)."""
    bm = BlockManager(32, BS, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, token_budget=64, max_model_len=256)
    a = _seq(6, prompt_base=10)
    sched.add(a)
    for _ in range(6):  # 6 prompt + 5 decoded tokens computed: blocks 0 and 1 full
        _step(sched, token=9)
    assert a.num_computed_tokens == 11 and a.num_registered_blocks == 2
    b = _seq(6, prompt_base=10)
    b.token_ids += [9] * 6  # the same 12 tokens
    assert bm.find_cached_prefix(b) == a.block_ids[:2]


def _row(**params) -> SamplingRow:
    params.setdefault("temperature", 0.0)
    return SamplingRow(params=SamplingParams(**params), prompt_token_ids=[1, 2], output_token_ids=[])


def test_metadata_is_reused_while_the_same_rows_sample():
    cache = MetadataCache()
    rows = [_row(), _row(temperature=0.8, top_k=5, seed=3), _row(logprobs=2)]
    first = cache.build(rows, 64, "cpu")
    assert cache.build(list(rows), 64, "cpu") is first  # same row objects, same order
    assert cache.build(rows[::-1], 64, "cpu") is not first  # another order: rebuilt
    again = cache.build(rows, 64, "cpu")
    assert again is not first and cache.build(rows, 64, "cpu") is again
    assert cache.build(rows[:2], 64, "cpu") is not again  # a row left


@pytest.mark.parametrize("history", [dict(repetition_penalty=1.2), dict(min_tokens=3), dict(presence_penalty=0.5)])
def test_metadata_of_rows_reading_their_history_is_rebuilt_every_step(history):
    cache = MetadataCache()
    row = _row(**history)
    row.stop_ids_for_min_tokens = [2]
    rows = [_row(), row]
    first = cache.build(rows, 64, "cpu")
    row.output_token_ids.append(5)
    assert cache.build(rows, 64, "cpu") is not first


def test_argmax_rows_matches_torch_first_maximum():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 1000, generator=gen)
    x[3, 10] = x[3, 900] = 50.0  # a tie: the first
    x[5] = float("-inf")  # all masked: index 0, as torch
    x[7, 4] = float("nan")  # NaN counts as the maximum in both
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(x).dtype == torch.long
    view = x[:, ::2]  # a strided view
    assert torch.equal(argmax_rows(view), view.argmax(dim=-1))
    half = x.to(torch.bfloat16)  # other dtypes keep torch's argmax
    assert torch.equal(argmax_rows(half), half.argmax(dim=-1))
