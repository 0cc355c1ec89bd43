"""Block pool: ref counts, prefix-cache hits, salts, LRU eviction, forks."""
from __future__ import annotations

from common.protocol import GenerateRequest, SamplingParams
from worker.engine.block_manager import BlockManager
from worker.engine.request import Request, EngineSequence

BS = 4


def make_seq(tokens, *, salt=None, prompt_logprobs=None, rid="r"):
    req = GenerateRequest(request_id=rid, prompt_token_ids=list(tokens),
                          params=SamplingParams(prompt_logprobs=prompt_logprobs), cache_salt=salt)
    return EngineSequence(Request(req, arrival_seq=0, max_tokens=8, eos_token_ids=[], now=0.0), 0, list(tokens))


def run_prefill(bm: BlockManager, seq: EngineSequence) -> list[int]:
    """Admit a sequence the way the scheduler does and mark its prompt computed."""
    cached = bm.find_cached_prefix(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - len(cached) * BS, cached)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_computed_blocks(seq)
    return cached


def test_allocate_and_free_restore_the_pool():
    bm = BlockManager(8, BS)
    seq = make_seq(range(10))
    assert bm.allocate_slots(seq, 10)
    assert len(seq.block_ids) == 3 and bm.num_free_blocks == 5
    assert all(bm.ref_count(b) == 1 for b in seq.block_ids)
    # Growing by one token inside the last block takes no new block.
    seq.num_computed_tokens = 10
    assert bm.allocate_slots(seq, 1) and len(seq.block_ids) == 3
    assert bm.allocate_slots(seq, 3) and len(seq.block_ids) == 4
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_ids == []


def test_allocation_is_all_or_nothing():
    bm = BlockManager(2, BS)
    seq = make_seq(range(12))
    assert not bm.can_allocate(seq, 12)
    assert not bm.allocate_slots(seq, 12)
    assert seq.block_ids == [] and bm.num_free_blocks == 2


def test_prefix_hit_keeps_last_token_recomputed():
    bm = BlockManager(16, BS)
    a = make_seq(range(12), rid="a")
    assert run_prefill(bm, a) == []
    # Same 12 tokens: only 2 full blocks may be reused (the last token is recomputed).
    b = make_seq(range(12), rid="b")
    hits = run_prefill(bm, b)
    assert hits == a.block_ids[:2]
    assert bm.ref_count(a.block_ids[0]) == 2
    # A prompt diverging in its second block shares only the first one.
    c = make_seq([0, 1, 2, 3, 9, 9, 9, 9, 9], rid="c")
    assert run_prefill(bm, c) == a.block_ids[:1]


def test_cached_blocks_survive_free_and_are_revived():
    bm = BlockManager(4, BS)
    a = make_seq(range(9))
    run_prefill(bm, a)
    first_two = a.block_ids[:2]
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = make_seq(range(9))
    assert bm.find_cached_prefix(b) == first_two
    assert run_prefill(bm, b) == first_two
    assert bm.num_free_blocks == 1


def test_lru_eviction_prefers_uncached_then_oldest():
    bm = BlockManager(4, BS)
    a = make_seq(range(8), rid="a")  # two full blocks, both registered
    run_prefill(bm, a)
    bm.free(a)
    # A fresh request needing all 4 blocks evicts a's cached content.
    z = make_seq(range(100, 116), rid="z")
    assert run_prefill(bm, z) == []
    assert bm.find_cached_prefix(make_seq(range(8))) == []


def test_cache_salt_isolates_sharing():
    bm = BlockManager(16, BS)
    run_prefill(bm, make_seq(range(12), salt="alice"))
    assert bm.find_cached_prefix(make_seq(range(12), salt="bob")) == []
    assert bm.find_cached_prefix(make_seq(range(12))) == []
    assert len(bm.find_cached_prefix(make_seq(range(12), salt="alice"))) == 2


def test_prompt_logprob_requests_do_not_read_the_cache():
    bm = BlockManager(16, BS)
    run_prefill(bm, make_seq(range(12)))
    assert bm.find_cached_prefix(make_seq(range(12), prompt_logprobs=1)) == []


def test_prefix_caching_disabled():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    run_prefill(bm, make_seq(range(12)))
    assert bm.find_cached_prefix(make_seq(range(12))) == []


def test_fork_shares_full_prompt_blocks():
    bm = BlockManager(16, BS)
    parent = make_seq(range(10))
    run_prefill(bm, parent)
    child = EngineSequence(parent.request, 1, list(range(10)))
    bm.fork(parent, child)
    assert child.block_ids == parent.block_ids[:2]
    assert child.num_computed_tokens == 8
    assert [bm.ref_count(b) for b in parent.block_ids] == [2, 2, 1]
    # The child recomputes its partial block into a block of its own.
    assert bm.allocate_slots(child, 2)
    assert child.block_ids[2] != parent.block_ids[2]
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 16


def test_millions_of_blocks_initialise_fast():
    """A small model on a large GPU gets millions of blocks: the pool is flat arrays."""
    import time

    start = time.perf_counter()
    bm = BlockManager(4_000_000, 16)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.5, f"{elapsed:.2f} s"
    seq = make_seq(range(40))
    assert bm.allocate_slots(seq, 40) and seq.block_ids == [0, 1, 2]
    bm.free(seq)
    assert bm.num_free_blocks == 4_000_000


def test_block_hash_is_sha256_over_parent_tokens_and_keys():
    from worker.engine.block_manager import hash_block

    a = hash_block(None, [1, 2, 3, 4])
    assert isinstance(a, bytes) and len(a) == 32
    assert a == hash_block(None, (1, 2, 3, 4))  # stable: no per-process salt (Python's hash() has one for str)
    assert a != hash_block(None, [1, 2, 3, 5]) and a != hash_block(a, [1, 2, 3, 4])
    assert hash_block(None, [1, 2], "alice") != hash_block(None, [1, 2], "bob") != hash_block(None, [1, 2])
    assert hash_block(None, [1, 2], None, "lora-a") != hash_block(None, [1, 2])
    # Length-prefixed keys: a salt cannot impersonate salt + adapter.
    assert hash_block(None, [1], "ab", None) != hash_block(None, [1], "a", "b")


def test_hash_is_identical_across_processes():
    import subprocess
    import sys

    import os
    from pathlib import Path

    code = "from worker.engine.block_manager import hash_block; print(hash_block(None, [7, 8], 'salt').hex())"
    root = Path(__file__).resolve().parents[1]
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root,
                           env=dict(os.environ, PYTHONHASHSEED=str(seed))).stdout.strip() for seed in (1, 2)}
    assert len(outs) == 1 and len(outs.pop()) == 64


def test_eviction_takes_uncached_blocks_first_then_least_recently_freed():
    bm = BlockManager(6, 4)
    a, b = make_seq(range(8)), make_seq(range(100, 108))
    for s in (a, b):
        bm.allocate_slots(s, 8)
        s.num_computed_tokens = 8
        bm.register_computed_blocks(s)
    scratch = make_seq(range(200, 204))
    bm.allocate_slots(scratch, 4)
    bm.free(a)  # cached, freed first
    bm.free(b)  # cached, freed second
    bm.free(scratch)  # uncached: reused first
    taker = make_seq(range(300, 312))
    assert bm.allocate_slots(taker, 12)
    # scratch's freed block, the never-used block 5, then a's tail (least recently freed, tails first)
    assert taker.block_ids == [4, 5, 1]
    assert bm.find_cached_prefix(make_seq(list(range(8)) + [9])) == [0]  # a's first block is still cached
    assert bm.find_cached_prefix(make_seq(list(range(100, 108)) + [9])) == [2, 3]
