"""The runner's persistent batch (runner/persistent_batch.py): rows kept across steps
equal the layout rebuilt from the sequences' block lists, whatever the sequence of
joins, growth, preemptions, forks, finishes and skipped steps."""
from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.support.engine_helpers import make_engine, random_prompts, request
from worker.engine.attention.metadata import StepLayout
from worker.engine.runner.persistent_batch import PersistentBatch

BS = 4


class Seq:
    """What the batch reads of a sequence: its block list (grown in place, replaced otherwise)."""

    def __init__(self, blocks):
        self.block_ids = blocks


def rebuilt(seqs, width=None):
    w = width or max(1, max(len(s.block_ids) for s in seqs))
    table = np.zeros((len(seqs), w), dtype=np.int32)
    for i, s in enumerate(seqs):
        table[i, :len(s.block_ids)] = s.block_ids
    return table


def test_rows_added_grown_moved_and_released():
    batch = PersistentBatch(2, 3)
    a, b, c = Seq([1, 2]), Seq([3]), Seq([4, 5, 6])
    rows = batch.sync([a, b])
    assert rows.tolist() == [0, 1] and batch.num_rows == 2
    a.block_ids.append(7)  # a decode crossed into a new block: only that block is written
    rows = batch.sync([b, a])  # the step's order changed: same rows, gathered in step order
    assert rows.tolist() == [1, 0]
    assert batch.table(rows).tolist() == [[3, 0, 0], [1, 2, 7]]
    rows = batch.sync([a, c])  # b left (finished or preempted): its row is reused for c
    assert rows.tolist() == [0, 1] and batch.num_rows == 2
    assert batch.blocks_of(c) == [4, 5, 6] and b not in batch.row_of
    rows = batch.sync([a, b, c])  # past the initial rows: the batch grows
    assert sorted(rows.tolist()) == [0, 1, 2]
    assert batch.table(rows).tolist() == [[1, 2, 7], [3, 0, 0], [4, 5, 6]]
    c.block_ids = [8]  # preempted and rescheduled: a new list, rewritten whole (shorter)
    a.block_ids.extend([9, 10])  # wider than the initial width: the table widens
    rows = batch.sync([c, a])
    assert batch.table(rows).tolist() == [[8, 0, 0, 0, 0], [1, 2, 7, 9, 10]]
    batch.release(a)
    assert batch.num_rows == 1 and a not in batch.row_of


def test_table_width_pads_for_graph_buffers():
    batch = PersistentBatch(4, 2)
    s = Seq([5])
    rows = batch.sync([s])
    assert batch.table(rows, 6).tolist() == [[5, 0, 0, 0, 0, 0]]


ops = st.lists(st.tuples(st.sampled_from(["join", "grow", "preempt", "fork", "finish", "step"]),
                         st.integers(0, 1 << 30)), min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, max_rows=st.integers(1, 6))
def test_equals_rebuilt_layout_over_random_histories(ops, max_rows):
    batch = PersistentBatch(max_rows, 2)
    live: list[Seq] = []
    next_block = [1]

    def fresh(n):
        ids = list(range(next_block[0], next_block[0] + n))
        next_block[0] += n
        return ids

    for op, r in ops:
        rng = random.Random(r)
        if op == "join" or not live:
            live.append(Seq(fresh(rng.randrange(0, 4))))
        elif op == "grow":  # decode or chunk crossing into new blocks: appended in place
            s = rng.choice(live)
            s.block_ids.extend(fresh(rng.randrange(1, 3)))
        elif op == "preempt":  # blocks freed, the list replaced; recompute may land on a prefix hit
            s = rng.choice(live)
            keep = s.block_ids[:rng.randrange(0, len(s.block_ids) + 1)] if rng.random() < 0.5 else []
            s.block_ids = keep + fresh(rng.randrange(0, 3))
        elif op == "fork":  # a sibling choice copies the shared prefix into its own list
            s = rng.choice(live)
            live.append(Seq(list(s.block_ids[:rng.randrange(0, len(s.block_ids) + 1)])))
        elif op == "finish":
            live.remove(rng.choice(live))
        # Every op is followed by a step over a random subset, in random order (a running
        # sequence may sit a step out: pending its last token, out of budget).
        step = [s for s in live if rng.random() < 0.8] or live[:1]
        rng.shuffle(step)
        rows = batch.sync(step)
        if not step:  # the last one finished: every row is free again
            assert batch.num_rows == 0
            continue
        assert len(set(rows.tolist())) == len(step)
        assert batch.num_rows == len(step)  # rows of sequences the step does not run are released
        np.testing.assert_array_equal(batch.table(rows), rebuilt(step))
        # ... and the step's whole layout equals the one built from the lists.
        q = np.array([rng.randrange(1, 3) for _ in step], dtype=np.int64)
        cap = np.array([len(s.block_ids) * BS for s in step], dtype=np.int64)
        q = np.minimum(q, cap)
        if (q < 1).any():
            continue  # a sequence without blocks computes nothing
        c = np.array([rng.randrange(0, int(m - n) + 1) for m, n in zip(cap, q)], dtype=np.int64)
        got = StepLayout.build(q, c, batch.table(rows), BS, check=False)
        want = StepLayout.build(q, c, [s.block_ids for s in step], BS)
        for field in ("query_lens", "context_lens", "block_tables", "positions", "slot_mapping"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_steps_lay_out_as_rebuilt_from_the_lists(llama_dir, async_scheduling):
    """Through the real engine -- prefix caching, chunked prefill, preemption under KV
    pressure, n > 1 forks, requests joining and finishing, async placeholders -- every
    step's layout from the persistent batch equals the one built from the sequences'
    block lists at that moment, and the batch holds exactly the step's sequences."""
    engine = make_engine(llama_dir, num_kv_blocks=14, block_size=8, max_model_len=96, max_num_batched_tokens=12,
                         async_scheduling=async_scheduling)
    runner = engine.runner
    layout = runner._layout
    checked = []

    def checking_layout(scheduled, table_width=None):
        want = StepLayout.build([s.num_new_tokens for s in scheduled], [s.seq.num_computed_tokens for s in scheduled],
                                [list(s.seq.block_ids) for s in scheduled], runner.block_size)
        got, holes, hole_seqs = layout(scheduled, table_width)
        for field in ("query_lens", "context_lens", "block_tables", "positions", "slot_mapping"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
        assert runner.batch.num_rows == len(scheduled)
        checked.append(len(scheduled))
        return got, holes, hole_seqs

    runner._layout = checking_layout
    prompts = random_prompts(9, 1, 20, seed=12)
    shared = random_prompts(1, 40, 41, seed=11)[0]
    reqs = [request(str(i), shared[:8 * (i % 4 + 1)] + p, max_tokens=6 + i % 4, ignore_eos=True, n=1 + i % 2,
                    temperature=0.7 * (i % 2), seed=i) for i, p in enumerate(prompts)]
    pending = list(reqs)
    for _ in range(5000):
        if pending:
            engine.add_request(pending.pop(0))
        elif not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    assert engine.scheduler.num_preemptions > 0, "the case is meant to preempt"
    assert len(checked) > 20 and max(checked) > 1
    engine.close()
