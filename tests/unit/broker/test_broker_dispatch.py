"""Dispatch policy units: least-loaded with rotation, and sticky sessions."""
from __future__ import annotations

from collections import Counter

from broker.dispatch import LeastLoaded, sticky_worker
from broker.workers import Worker
from common.protocol import ModelInfo, WorkerLoad


def _worker(rank: int, running=0, waiting=0, sent=0, received=0) -> Worker:
    return Worker(identity=b"w%d" % rank, rank=rank, model=ModelInfo("m", 10, 10, 4),
                  load=WorkerLoad(running=running, waiting=waiting, num_received=received), sent=sent)


def test_score_weighs_waiting_and_unreported():
    assert _worker(0, running=2, waiting=1).score() == 6
    assert _worker(0, running=1, sent=5, received=2).score() == 4  # 3 still on the wire
    assert _worker(0, sent=1, received=3).score() == 0  # never negative


def test_least_loaded_prefers_lowest_score():
    workers = [_worker(0, running=3), _worker(1, waiting=1), _worker(2, running=1)]
    assert LeastLoaded().pick(workers).rank == 2


def test_ties_rotate():
    workers = [_worker(r) for r in range(3)]
    policy = LeastLoaded()
    picks = [policy.pick(workers).rank for _ in range(6)]
    assert Counter(picks) == {0: 2, 1: 2, 2: 2}
    assert LeastLoaded().pick([]) is None


def test_sticky_is_stable_and_moves_only_departed_sessions():
    workers = [_worker(r) for r in range(4)]
    sessions = [f"session-{i}" for i in range(200)]
    before = {s: sticky_worker(s, workers).rank for s in sessions}
    assert before == {s: sticky_worker(s, list(reversed(workers))).rank for s in sessions}
    assert len(set(before.values())) == 4  # spreads
    survivors = [w for w in workers if w.rank != 2]
    after = {s: sticky_worker(s, survivors).rank for s in sessions}
    moved = {s for s in sessions if before[s] != after[s]}
    assert moved == {s for s in sessions if before[s] == 2}


def test_lora_requests_prefer_workers_with_the_adapter_resident():
    workers = [_worker(0), _worker(1, running=2), _worker(2, running=1)]
    for w in workers:
        w.load.max_num_seqs = 8
    workers[1].load.resident_loras = ["a"]
    workers[2].load.resident_loras = ["a", "b"]
    policy = LeastLoaded()
    assert policy.pick(workers, "a").rank == 2  # least loaded among the holders, not the idle rank 0
    assert policy.pick(workers, "b").rank == 2
    assert policy.pick(workers, "c").rank == 0  # nobody holds it: least loaded loads it
    workers[2].load.running = workers[2].load.max_num_seqs = 4  # saturated holder: load elsewhere
    workers[1].load.running = workers[1].load.max_num_seqs = 2
    assert policy.pick(workers, "a").rank == 0


# ---------------------------------------------------------------- cache-aware routing
def _keys(*blocks: int) -> list[bytes]:
    return [b"%08d" % b for b in blocks]


def test_prefix_index_matches_leading_blocks_and_follows_events():
    from broker.prefix_index import PrefixIndex
    from common.protocol import KvEvents

    index = PrefixIndex(capacity=4)
    index.apply(KvEvents(stored=_keys(1, 2, 3)))
    assert index.match(_keys(1, 2, 3, 4)) == 3 and index.match(_keys(1, 9, 3)) == 1  # a chain stops at the first miss
    index.apply(KvEvents(removed=_keys(2)))
    assert index.match(_keys(1, 2, 3)) == 1
    index.apply(KvEvents(stored=_keys(5, 6, 7, 8)))
    assert len(index) == 4 and index.match(_keys(1)) == 0  # bounded: the oldest key went first
    index.apply(KvEvents(cleared=True, stored=_keys(9)))
    assert len(index) == 1 and index.match(_keys(9)) == 1
    index.expect(_keys(9, 10, 11), now=0.0)  # dispatched, not yet computed
    assert index.match(_keys(9, 10, 11), now=1.0) == 3
    assert index.match(_keys(9, 10, 11), now=1e6) == 1  # never confirmed: expired
    index.expire(now=1e6)
    assert index.match(_keys(9, 10), now=0.0) == 1


def test_cache_aware_prefers_longest_prefix_within_the_load_guard():
    from broker.dispatch import CacheAware
    from common.protocol import KvEvents

    workers = [_worker(r) for r in range(3)]
    workers[1].prefix_index.apply(KvEvents(stored=_keys(1, 2)))
    workers[2].prefix_index.apply(KvEvents(stored=_keys(1, 2, 3)))
    policy = CacheAware(balance_rel=1.5, balance_abs=2)
    assert policy.pick(workers, prefix_hashes=_keys(1, 2, 3, 4)).rank == 2
    assert policy.pick(workers, prefix_hashes=_keys(7)).rank in (0, 1, 2)  # no match: least-loaded
    # The holder is loaded beyond the guard (score 8 > 0 * 1.5 + 2): its cache no longer wins.
    workers[2].load = WorkerLoad(running=8)
    assert policy.pick(workers, prefix_hashes=_keys(1, 2, 3, 4)).rank == 1
    workers[1].load = WorkerLoad(running=8)
    assert policy.pick(workers, prefix_hashes=_keys(1, 2, 3, 4)).rank == 0
    assert policy.prefix_routed == 2


def test_cache_aware_spreads_a_hot_prefix_instead_of_piling_it_on_one_worker():
    from broker.dispatch import CacheAware
    from common.protocol import KvEvents

    workers = [_worker(r) for r in range(2)]
    workers[0].prefix_index.apply(KvEvents(stored=_keys(1)))
    policy = CacheAware(balance_rel=1.5, balance_abs=2)
    picks = Counter()
    for _ in range(40):
        w = policy.pick(workers, prefix_hashes=_keys(1))
        picks[w.rank] += 1
        w.load = WorkerLoad(running=w.load.running + 1)  # each request stays running
        w.prefix_index.apply(KvEvents(stored=_keys(1)))
    assert max(picks.values()) / min(picks.values()) <= 1.5, picks


def test_registry_remembers_the_transfer_servers_of_workers_that_left():
    """A decode request naming the transfer server of a prefill worker that has just died
    is a race, not a bad request: the registry remembers departed peers (bounded) so the
    broker answers 503, and forgets one once a worker serves from that address again."""
    from broker.workers import MAX_DEPARTED_PEERS, WorkerRegistry

    registry = WorkerRegistry(expiry=60.0)
    prefill = _worker(0)
    prefill.transfer_peer = ("127.0.0.1", 5555)
    registry.add(prefill)
    assert not registry.departed(("127.0.0.1", 5555))
    registry.remove(prefill)
    assert registry.departed(("127.0.0.1", 5555))
    assert not registry.departed(("127.0.0.1", 5556))  # never a member: still the 400 path
    again = _worker(1)
    again.transfer_peer = ("127.0.0.1", 5555)
    registry.add(again)
    assert not registry.departed(("127.0.0.1", 5555))
    for port in range(MAX_DEPARTED_PEERS + 10):
        gone = _worker(2)
        gone.transfer_peer = ("127.0.0.1", 10000 + port)
        registry.add(gone)
        registry.remove(gone)
    assert not registry.departed(("127.0.0.1", 10000))  # the oldest fell out of the bound
    assert registry.departed(("127.0.0.1", 10000 + MAX_DEPARTED_PEERS + 9))
