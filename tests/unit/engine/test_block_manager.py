"""Block pool: ref counts, prefix-cache hits, salts, LRU eviction, forks."""
from __future__ import annotations

import pytest

from common.prefix_hash import routing_key
from common.protocol import GenerateRequest, KvEvents, SamplingParams
from worker.engine.core.block_manager import BlockManager
from worker.engine.records import Request, EngineSequence

BS = 4
PINNED_FIRST_BLOCK_HASH = "f172d3222a649038e091da9180916a0533b89eccaa005c45bf9131a3d25380ae"  # hash_block(None, [7, 8], 'salt')


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
    from worker.engine.core.block_manager import hash_block

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

    code = "from worker.engine.core.block_manager import hash_block; print(hash_block(None, [7, 8], 'salt').hex())"
    root = Path(__file__).resolve().parents[3]
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


# ----------------------------------------------------------------------------- same behaviour as the object pool
class ReferencePool:
    """The pool as it was before the flat arrays (one free OrderedDict, uncached blocks
    moved to its front), with the same sha256 keys: the behaviour to keep."""

    def __init__(self, num_blocks, block_size):
        from collections import OrderedDict

        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.hash = [None] * num_blocks
        self.free_q = OrderedDict.fromkeys(range(num_blocks))
        self.cached = {}

    def find_cached_prefix(self, seq, bm):
        bm._update_hashes(seq)  # the keys themselves are tested separately
        if seq.num_computed_tokens or seq.request.wants_prompt_scores:
            return []
        hits = []
        for h in seq.block_hashes[:(seq.num_tokens - 1) // self.block_size]:
            if h not in self.cached:
                break
            hits.append(self.cached[h])
        return hits

    def allocate_slots(self, seq, num_new, cached=()):
        total = seq.num_computed_tokens + len(cached) * self.block_size + num_new
        fresh = max(-(-total // self.block_size) - len(seq.block_ids) - len(cached), 0)
        if fresh + sum(1 for b in cached if self.ref[b] == 0) > len(self.free_q):
            return False
        for b in cached:
            if self.ref[b] == 0:
                del self.free_q[b]
            self.ref[b] += 1
        seq.block_ids.extend(cached)
        seq.num_computed_tokens += len(cached) * self.block_size
        for _ in range(fresh):
            b, _ = self.free_q.popitem(last=False)
            if self.hash[b] is not None:
                if self.cached.get(self.hash[b]) == b:
                    del self.cached[self.hash[b]]
                self.hash[b] = None
            self.ref[b] = 1
            seq.block_ids.append(b)
        return True

    def fork(self, parent, child):
        num_full = min(parent.num_prompt_tokens, parent.num_computed_tokens) // self.block_size
        for b in parent.block_ids[:num_full]:
            self.ref[b] += 1
        child.block_ids = list(parent.block_ids[:num_full])
        child.block_hashes = list(parent.block_hashes[:num_full])
        child.num_computed_tokens = num_full * self.block_size

    def register(self, seq, bm):
        bm._update_hashes(seq)
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for i in range(seq.num_registered_blocks, num_full):
            b, h = seq.block_ids[i], seq.block_hashes[i]
            if self.hash[b] is None and h not in self.cached:
                self.hash[b] = h
                self.cached[h] = b
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def free(self, seq):
        for b in reversed(seq.block_ids):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free_q[b] = None
                if self.hash[b] is None:
                    self.free_q.move_to_end(b, last=False)
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0


def _clone(seq):
    twin = EngineSequence(seq.request, seq.index, list(seq.token_ids))
    return twin


def test_matches_the_reference_pool_under_random_traffic():
    """Admissions with prefix hits, chunked prefill, decode growth, forks, preemption-style
    frees and eviction under pressure: every block id handed out, every hit, ref count and
    free count equals the object pool's."""
    import random

    for seed in range(12):
        rng = random.Random(seed)
        num_blocks = rng.choice([5, 9, 17, 40])
        bm, ref = BlockManager(num_blocks, BS), ReferencePool(num_blocks, BS)
        live = []  # (seq under bm, its twin under the reference)
        prefixes = [[rng.randrange(6) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
        for step in range(400):
            op = rng.random()
            if op < 0.35 or not live:  # admit a request sharing a prefix, perhaps salted
                tokens = rng.choice(prefixes) + [rng.randrange(6) for _ in range(rng.randrange(0, 9))]
                seq = make_seq(tokens, salt=rng.choice([None, None, "alice"]), rid=f"{seed}-{step}",
                               prompt_logprobs=rng.choice([None] * 5 + [1]))
                twin = _clone(seq)
                hits = bm.find_cached_prefix(seq)
                assert hits == ref.find_cached_prefix(twin, bm)
                num_new = rng.randrange(1, seq.num_tokens - len(hits) * BS + 1)  # chunked prefill
                ok = bm.allocate_slots(seq, num_new, hits)
                assert ok == ref.allocate_slots(twin, num_new, hits)
                if ok:
                    for s in (seq, twin):
                        s.num_computed_tokens += num_new
                    bm.register_computed_blocks(seq)
                    ref.register(twin, bm)
                    live.append((seq, twin))
            elif op < 0.7:  # the next prefill chunk or a decode token
                seq, twin = rng.choice(live)
                if seq.num_computed_tokens == seq.num_tokens:
                    tok = rng.randrange(6)
                    seq.token_ids.append(tok)
                    twin.token_ids.append(tok)
                num_new = seq.num_tokens - seq.num_computed_tokens
                ok = bm.allocate_slots(seq, num_new)
                assert ok == ref.allocate_slots(twin, num_new)
                if ok:
                    for s in (seq, twin):
                        s.num_computed_tokens += num_new
                    bm.register_computed_blocks(seq)
                    ref.register(twin, bm)
            elif op < 0.78:  # a sibling choice
                seq, twin = rng.choice(live)
                child, child_twin = EngineSequence(seq.request, 1, list(seq.token_ids)), _clone(seq)
                bm.fork(seq, child)
                ref.fork(twin, child_twin)
                live.append((child, child_twin))
            else:  # finished or preempted
                seq, twin = live.pop(rng.randrange(len(live)))
                bm.free(seq)
                ref.free(twin)
            for seq, twin in live:
                assert seq.block_ids == twin.block_ids, (seed, step)
                assert seq.num_computed_tokens == twin.num_computed_tokens
            assert bm.num_free_blocks == len(ref.free_q), (seed, step)
            assert [bm.ref_count(b) for b in range(num_blocks)] == ref.ref
        for seq, twin in live:
            bm.free(seq)
            ref.free(twin)
        assert bm.num_free_blocks == num_blocks
        # The whole free order, uncached then least recently freed cached, is the reference's.
        order = [int(b) for b in bm._uncached[:bm._num_uncached][::-1]] + list(bm._free_cached)
        assert order == list(ref.free_q), seed


def test_free_block_list_is_an_lru_queue():
    from worker.engine.core.block_manager import _LRUList

    q = _LRUList(10)
    for b in (3, 7, 1, 9):
        q.append(b)
    q.remove(7)
    assert list(q) == [3, 1, 9] and len(q) == 3
    assert q.pop_oldest() == 3
    q.append(3)
    q.remove(9)
    assert list(q) == [1, 3]
    assert [q.pop_oldest(), q.pop_oldest()] == [1, 3] and len(q) == 0
    with pytest.raises(IndexError):
        q.pop_oldest()


def test_operations_on_a_huge_pool_cost_the_blocks_they_touch():
    """Allocation, registration, eviction and free stay O(blocks touched) with 4M blocks."""
    import time

    bm = BlockManager(4_000_000, 16)
    start = time.perf_counter()
    for i in range(2000):
        seq = make_seq(range(i * 64, i * 64 + 64), rid=str(i))
        assert bm.allocate_slots(seq, 64)
        seq.num_computed_tokens = 64
        bm.register_computed_blocks(seq)
        bm.free(seq)
    elapsed = time.perf_counter() - start
    assert elapsed < 3.0, f"{elapsed:.2f} s for 2000 requests"  # ~0.1 s; an O(pool) step would take minutes
    assert bm.num_free_blocks == 4_000_000


def test_a_fully_cached_pool_holds_no_python_object_per_free_block():
    """Free cached blocks live in the int32 link arrays: beyond each block's hash and its
    map entry, freeing a cached block allocates nothing."""
    import gc
    import tracemalloc

    bm = BlockManager(50_000, BS)
    seqs = []
    for i in range(20):
        seq = make_seq(range(i * 4000, i * 4000 + 4000), rid=str(i))
        run_prefill(bm, seq)
        seqs.append(seq)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for seq in seqs:
            bm.free(seq)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert bm.num_free_blocks == 50_000 and len(bm._free_cached) == 20 * 1000
    assert grown < 20 * 1000 * 8, f"{grown} bytes for 20000 freed cached blocks"  # an OrderedDict: ~100 B each


def test_adapter_name_on_the_request_isolates_sharing():
    bm = BlockManager(16, BS)
    a = make_seq(range(12))
    a.request.lora_key = "adapter-a"  # read when the request carries one (no LoRA serving yet)
    run_prefill(bm, a)
    assert bm.find_cached_prefix(make_seq(range(12))) == []
    b = make_seq(range(12))
    b.request.lora_key = "adapter-b"
    assert bm.find_cached_prefix(b) == []
    c = make_seq(range(12))
    c.request.lora_key = "adapter-a"
    assert bm.find_cached_prefix(c) == a.block_ids[:2]


def test_block_hash_serialisation_is_pinned():
    """sha256(parent digest | int64-LE token ids | length-prefixed salt | adapter): the
    documented layout and a hard-coded digest, so a change of format is deliberate."""
    import hashlib
    import struct

    from worker.engine.core.block_manager import hash_block

    root = hashlib.sha256(b"tokserve-kv-root").digest()
    expect = hashlib.sha256(root + struct.pack("<2q", 7, 8) + b"\x01" + struct.pack("<Q", 4) + b"salt"
                            + b"\x00").digest()
    first = hash_block(None, [7, 8], "salt")
    assert first == expect
    second = hash_block(first, [9, 10], None, "lora")
    assert second == hashlib.sha256(first + struct.pack("<2q", 9, 10) + b"\x00" + b"\x01"
                                    + struct.pack("<Q", 4) + b"lora").digest()
    assert first.hex() == PINNED_FIRST_BLOCK_HASH
    # Token ids beyond 32 bits keep their full width (no truncation collisions).
    assert hash_block(None, [2**32 + 1]) != hash_block(None, [1])


# ----------------------------------------------------------------------------- KV events
def _keys(seq):
    return [routing_key(h) for h in seq.block_hashes]


def test_kv_events_on_store_evict_and_reset():
    bm = BlockManager(4, BS)
    assert bm.drain_kv_events() is None
    a = make_seq(range(9), rid="a")  # 2 full blocks + 1 token
    run_prefill(bm, a)
    ev = bm.drain_kv_events()
    assert ev.stored == _keys(a) and len(ev.stored) == 2 and ev.removed == [] and not ev.cleared
    assert bm.drain_kv_events() is None  # drained
    # A hit publishes nothing new; freeing keeps the blocks cached (no event).
    b = make_seq(range(9), rid="b")
    assert run_prefill(bm, b) == a.block_ids[:2]
    assert bm.drain_kv_events() is None
    bm.free(a)
    bm.free(b)
    assert bm.drain_kv_events() is None
    # Four fresh blocks: the uncached ones first, then both cached blocks are evicted.
    c = make_seq(range(100, 116), rid="c")
    assert bm.allocate_slots(c, 16)
    ev = bm.drain_kv_events()
    assert sorted(ev.removed) == sorted(_keys(a)) and ev.stored == [] and not ev.cleared
    c.num_computed_tokens = 16
    bm.register_computed_blocks(c)
    stored_c = bm.drain_kv_events().stored
    assert stored_c == _keys(c) and len(stored_c) == 4
    assert bm.snapshot_kv_events() == KvEvents(stored=stored_c, cleared=True)
    # Reset: cleared, and the changes not drained yet are dropped.
    bm.free(c)
    d = make_seq(range(200, 205), rid="d")
    run_prefill(bm, d)  # evicts c's first block (removed) and stores d's block
    bm.reset_prefix_cache()
    assert bm.drain_kv_events() == KvEvents(cleared=True)
    assert bm.drain_kv_events() is None
    assert bm.snapshot_kv_events() == KvEvents(cleared=True)
    # Blocks reset while cached (free or held) are not reported removed when reused later.
    bm.free(d)
    e = make_seq(range(300, 316), rid="e")
    assert bm.allocate_slots(e, 16)
    assert bm.drain_kv_events() is None


def test_kv_events_stored_and_removed_are_netted_per_key():
    """Between two drains a key that was stored then evicted is reported removed only,
    and one evicted then stored again is reported stored only: the two lists never
    share a key, so the broker may apply them in either order."""
    bm = BlockManager(2, BS)
    a = make_seq(range(5), rid="a")
    run_prefill(bm, a)
    bm.free(a)
    b = make_seq(range(50, 58), rid="b")  # evicts a's cached block
    assert bm.allocate_slots(b, 8)
    ev = bm.drain_kv_events()
    assert ev.stored == [] and ev.removed == _keys(a)
    bm.free(b)
    a2 = make_seq(range(5), rid="a2")
    run_prefill(bm, a2)
    bm.free(a2)
    c = make_seq(range(70, 78), rid="c")
    assert bm.allocate_slots(c, 8)  # stored and evicted in the same window
    bm.free(c)
    run_prefill(bm, make_seq(range(5), rid="a3"))  # ... and stored again
    ev = bm.drain_kv_events()
    assert ev.stored == _keys(a) and ev.removed == []


def test_kv_events_skip_adapter_blocks():
    bm = BlockManager(8, BS)
    a = make_seq(range(9), rid="a")
    a.request.lora_key = "adapter-a"
    run_prefill(bm, a)
    assert len(bm._cached) == 2 and bm.drain_kv_events() is None
    assert bm.snapshot_kv_events() == KvEvents(cleared=True)
    base = make_seq(range(9), rid="base")  # the same tokens on the base model: other hashes, published
    run_prefill(bm, base)
    assert bm.drain_kv_events().stored == _keys(base)
    bm.free(a)
    bm.free(base)
    # Evicting every cached block reports only the base model's as removed.
    c = make_seq(range(100, 132), rid="c")
    assert bm.allocate_slots(c, 32)
    assert sorted(bm.drain_kv_events().removed) == sorted(_keys(base))


@pytest.mark.parametrize("salt", [None, "tenant-7"])
def test_kv_event_keys_equal_the_gateways_prompt_hashes(salt):
    """What a gateway computes for a prompt (prompt_routing_hashes) is exactly what the
    worker publishes once it has served that prompt: salted chains included."""
    from common.prefix_hash import prompt_routing_hashes

    bm = BlockManager(32, BS)
    prompt = [(i * 37) % 101 for i in range(5 * BS + 3)]  # 5 full blocks + 3 tokens
    seq = make_seq(prompt, salt=salt)
    run_prefill(bm, seq)
    ev = bm.drain_kv_events()
    expect = prompt_routing_hashes(prompt, BS, salt)
    assert len(expect) == 5 and ev.stored == expect
    assert bm.snapshot_kv_events().stored == expect
    if salt is not None:
        assert set(expect).isdisjoint(prompt_routing_hashes(prompt, BS))


def test_kv_events_are_bounded_by_a_snapshot():
    bm = BlockManager(3, BS)
    assert bm._kv_limit == 12
    for i in range(20):  # 20 distinct blocks stored and evicted, nothing drained
        seq = make_seq(range(i * 10, i * 10 + 5), rid=str(i))
        run_prefill(bm, seq)
        bm.free(seq)
    assert len(bm._kv_pending) <= bm._kv_limit and bm._kv_overflow
    ev = bm.drain_kv_events()  # the collapse: the whole current state
    snapshot = ev.stored
    assert ev.cleared and ev.removed == []
    assert sorted(ev.stored) == sorted(routing_key(h) for h in bm._cached)
    assert len(ev.stored) == len(bm._cached) == 2  # each request: 1 cached block + 1 partial one
    assert bm.drain_kv_events() is None  # back to deltas
    seq = make_seq(range(1000, 1005), rid="after")
    run_prefill(bm, seq)
    ev = bm.drain_kv_events()
    assert not ev.cleared and ev.stored == _keys(seq) and ev.removed and set(ev.removed) <= set(snapshot)


def test_kv_events_disabled_with_prefix_caching_off():
    bm = BlockManager(4, BS, enable_prefix_caching=False)
    seq = make_seq(range(9))
    run_prefill(bm, seq)
    bm.free(seq)
    bm.reset_prefix_cache()
    assert bm.drain_kv_events() is None
    assert bm.snapshot_kv_events() == KvEvents(cleared=True)


def test_kv_events_replayed_equal_the_cache_under_random_traffic():
    """A broker applying every drained report (cleared, then removed, then stored, as
    broker/prefix_index.py does, or stored first: the lists are disjoint) holds exactly
    the base-model keys the pool caches, through admissions, decode growth, forks, frees,
    evictions, adapter requests, resets and overflow collapses."""
    import random

    def published(bm):
        return {routing_key(h) for h, b in bm._cached.items() if bm._published[b]}

    overflows = 0
    for seed in range(8):
        rng = random.Random(seed)
        num_blocks = rng.choice([5, 9, 17])
        bm = BlockManager(num_blocks, BS)
        # Even seeds: rare drains and many distinct blocks, so pending changes overflow.
        drain_rate, vocab, resets = (0.3, 6, 0.03) if seed % 2 else (0.01, 1000, 0.0)
        view, view2 = set(), set()
        live = []
        prefixes = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
        for step in range(300):
            op = rng.random()
            if op < 0.35 or not live:
                tokens = rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randrange(0, 9))]
                seq = make_seq(tokens, salt=rng.choice([None, None, "alice"]), rid=f"{seed}-{step}")
                seq.request.lora_key = rng.choice([None, None, None, "lora-1"])
                hits = bm.find_cached_prefix(seq)
                num_new = rng.randrange(1, seq.num_tokens - len(hits) * BS + 1)
                if bm.allocate_slots(seq, num_new, hits):
                    seq.num_computed_tokens += num_new
                    bm.register_computed_blocks(seq)
                    live.append(seq)
            elif op < 0.7:
                seq = rng.choice(live)
                if seq.num_computed_tokens == seq.num_tokens:
                    seq.token_ids.append(rng.randrange(vocab))
                num_new = seq.num_tokens - seq.num_computed_tokens
                if bm.allocate_slots(seq, num_new):
                    seq.num_computed_tokens += num_new
                    bm.register_computed_blocks(seq)
            elif op < 0.76:
                seq = rng.choice(live)
                child = EngineSequence(seq.request, 1, list(seq.token_ids))
                bm.fork(seq, child)
                live.append(child)
            elif op < 0.76 + resets:
                bm.reset_prefix_cache()
            else:
                bm.free(live.pop(rng.randrange(len(live))))
            if rng.random() < drain_rate:  # the worker reports after some steps, not all
                overflows += bm._kv_overflow
                ev = bm.drain_kv_events()
                if ev is not None:
                    assert not set(ev.stored) & set(ev.removed)
                    if ev.cleared:
                        view.clear()
                        view2.clear()
                    view.difference_update(ev.removed)  # removed first (the broker's order)
                    view.update(ev.stored)
                    view2.update(ev.stored)  # stored first: the same result
                    view2.difference_update(ev.removed)
                    assert view == view2 == published(bm), (seed, step)
        ev = bm.drain_kv_events()
        if ev is not None:
            if ev.cleared:
                view.clear()
            view.difference_update(ev.removed)
            view.update(ev.stored)
        assert view == published(bm) == set(bm.snapshot_kv_events().stored)
    assert overflows  # the collapse into a snapshot was exercised


def test_kv_events_carry_tokens_an_outside_router_can_match():
    """Stored keys come with their parent key and token ids (for vllm-router's kv_aware,
    via the broker's publisher), except for salted chains: a token-only router cannot
    compute their keys."""
    import numpy as np

    bm = BlockManager(16, BS)
    a = make_seq(range(9), rid="a")
    run_prefill(bm, a)
    ev = bm.drain_kv_events()
    keys = _keys(a)
    assert [(t.key, t.parent, np.frombuffer(t.token_ids, dtype="<i4").tolist()) for t in ev.tokens] == \
        [(keys[0], None, [0, 1, 2, 3]), (keys[1], keys[0], [4, 5, 6, 7])]
    salted = make_seq(range(50, 59), salt="tenant", rid="s")
    run_prefill(bm, salted)
    ev = bm.drain_kv_events()
    assert ev.stored == _keys(salted) and ev.tokens == []
    # A key stored then evicted before the drain goes out removed, without tokens.
    bm2 = BlockManager(2, BS)
    b = make_seq(range(4), rid="b")
    run_prefill(bm2, b)
    bm2.free(b)
    c = make_seq(range(100, 108), rid="c")
    assert bm2.allocate_slots(c, 8)
    ev = bm2.drain_kv_events()
    assert ev.removed == _keys(b) and ev.tokens == []
