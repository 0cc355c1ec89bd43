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
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_ids)
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
    assert bm.blocks[a.block_ids[0]].ref_count == 2
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
    assert [bm.blocks[b].ref_count for b in parent.block_ids] == [2, 2, 1]
    # The child recomputes its partial block into a block of its own.
    assert bm.allocate_slots(child, 2)
    assert child.block_ids[2] != parent.block_ids[2]
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 16
