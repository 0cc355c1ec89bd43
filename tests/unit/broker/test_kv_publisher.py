"""The broker's KV-event publisher for outside routers (broker/kv_publisher.py): vLLM's
ZeroMQ wire format, one cell-wide view over its workers, same-user ipc:// by default."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest
import zmq

from broker.kv_publisher import CellKvPublisher
from common.protocol import KvBlockTokens, KvEvents
from tests.support.procs import free_endpoint

BS = 4


def _block(key: bytes, parent, tokens) -> KvBlockTokens:
    return KvBlockTokens(key, parent, np.asarray(tokens, dtype="<i4").tobytes())


@pytest.fixture
def pub_sub():
    ctx = zmq.Context.instance()
    pub = CellKvPublisher(ctx, free_endpoint(), allow_tcp=True)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    # PUB drops what it sends before the subscription arrives: probe until one gets through.
    probe = 0
    while not sub.poll(50):
        pub.on_events(b"probe", KvEvents(stored=[b"p%d" % probe], tokens=[_block(b"p%d" % probe, None, [0] * BS)]),
                      BS, 64)
        probe += 1
    while sub.poll(50):
        sub.recv_multipart()
    pub.on_worker_gone(b"probe")
    assert sub.poll(2000)
    sub.recv_multipart()  # the probes' BlockRemoved
    yield pub, sub
    sub.close(0)
    pub.close()


def _next(sub) -> tuple[int, list[dict]]:
    assert sub.poll(5000), "nothing published"
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"" and len(seq) == 8
    batch = msgspec.msgpack.decode(payload)
    # vLLM's EventBatch: [ts, events, data_parallel_rank] (msgspec writes the None rank too)
    assert isinstance(batch, list) and len(batch) == 3 and isinstance(batch[0], float) and batch[2] is None
    return int.from_bytes(seq, "big", signed=True), batch[1]


def test_wire_format_and_cell_wide_reference_counts(pub_sub):
    pub, sub = pub_sub
    k0, k1 = b"k0------", b"k1------"
    blocks = [_block(k0, None, [1, 2, 3, 4]), _block(k1, k0, [5, 6, 7, 8])]
    pub.on_events(b"w0", KvEvents(stored=[k0, k1], tokens=blocks), BS, 64)
    seq0, events = _next(sub)
    assert events == [
        {"type": "BlockStored", "block_hashes": [k0], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
         "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockStored", "block_hashes": [k1], "parent_block_hash": k0, "token_ids": [5, 6, 7, 8],
         "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None}]
    # A second worker of the cell caching the same blocks: the cell already announced them.
    pub.on_events(b"w1", KvEvents(stored=[k0, k1], tokens=blocks), BS, 64)
    # w0 evicts k1: w1 still holds it, so nothing goes out; w1 evicting it too removes it.
    pub.on_events(b"w0", KvEvents(removed=[k1]), BS, 64)
    pub.on_events(b"w1", KvEvents(removed=[k1]), BS, 64)
    seq1, events = _next(sub)
    assert seq1 == seq0 + 1  # no batch for the changes that did not change the cell's view
    assert events == [{"type": "BlockRemoved", "block_hashes": [k1], "medium": "GPU"}]
    # A worker's reset (cleared) or death drops its keys; the last holder's departure removes.
    pub.on_events(b"w0", KvEvents(cleared=True), BS, 64)
    pub.on_worker_gone(b"w1")
    assert _next(sub)[1] == [{"type": "BlockRemoved", "block_hashes": [k0], "medium": "GPU"}]


def test_keys_without_tokens_are_counted_but_never_announced(pub_sub):
    pub, sub = pub_sub
    salted = b"salted--"
    pub.on_events(b"w0", KvEvents(stored=[salted]), BS, 64)  # e.g. a salted chain: no tokens sent
    pub.on_events(b"w0", KvEvents(removed=[salted]), BS, 64)
    k = b"plain---"
    pub.on_events(b"w0", KvEvents(stored=[k], tokens=[_block(k, None, [9, 9, 9, 9])]), BS, 64)
    assert [e["block_hashes"] for e in _next(sub)[1]] == [[k]]  # the salted key never appeared


def test_capacity_bounds_each_worker(pub_sub):
    pub, sub = pub_sub
    keys = [b"c%07d" % i for i in range(5)]
    pub.on_events(b"w0", KvEvents(stored=keys, tokens=[_block(k, None, [i] * BS) for i, k in enumerate(keys)]), BS, 3)
    assert [e["block_hashes"][0] for e in _next(sub)[1]] == keys[:3]
    assert pub.dropped_keys == 2


def test_refuses_tcp_unless_told_and_beyond_loopback_unless_told_again(tmp_path):
    ctx = zmq.Context.instance()
    with pytest.raises(ValueError, match="--kv-events-allow-tcp"):  # every local user could read the prefixes
        CellKvPublisher(ctx, "tcp://127.0.0.1:0")
    with pytest.raises(ValueError, match="beyond loopback"):
        CellKvPublisher(ctx, "tcp://0.0.0.0:0", allow_tcp=True)
    with pytest.raises(ValueError, match="ipc://PATH or tcp://"):
        CellKvPublisher(ctx, "inproc://x")
    pub = CellKvPublisher(ctx, "tcp://0.0.0.0:0", allow_remote=True)
    assert pub.endpoint.startswith("tcp://0.0.0.0:")
    pub.close()


def test_ipc_only_in_a_folder_private_to_this_user(tmp_path):
    ctx = zmq.Context.instance()
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    shared.chmod(0o1777)  # like /tmp: another user could connect to a socket made there
    with pytest.raises(ValueError, match="not private"):
        CellKvPublisher(ctx, f"ipc://{shared}/kv.sock")
    assert not (shared / "kv.sock").exists()
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    pub = CellKvPublisher(ctx, f"ipc://{private}/kv.sock")
    assert pub.endpoint == f"ipc://{private}/kv.sock"
    pub.close()


def test_a_late_subscriber_gets_the_cells_blocks_again(pub_sub):
    """A router that subscribes after blocks were announced (started late, restarted) gets
    them re-announced: the XPUB hears the subscription; the broker's loop pumps a batch per
    turn.  Blocks removed meanwhile are not sent; the early subscriber sees harmless repeats."""
    pub, sub = pub_sub
    k0, k1, k2 = b"late-k0-", b"late-k1-", b"late-k2-"
    pub.on_events(b"w0", KvEvents(stored=[k0, k1, k2], tokens=[
        _block(k0, None, [1, 2, 3, 4]), _block(k1, k0, [5, 6, 7, 8]), _block(k2, k1, [9, 10, 11, 12])]), BS, 64)
    pub.on_events(b"w0", KvEvents(removed=[k2]), BS, 64)
    _next(sub), _next(sub)
    while pub.sock.poll(0):  # the early subscriber's own subscription (its re-announcement was empty)
        pub.on_subscriptions()
    pub._replay, pub._replay_at = [], 0
    late = zmq.Context.instance().socket(zmq.SUB)
    late.setsockopt(zmq.LINGER, 0)
    late.setsockopt(zmq.SUBSCRIBE, b"")
    late.connect(pub.endpoint)
    try:
        assert pub.sock.poll(5000), "the late subscription never reached the publisher"
        pub.on_subscriptions()
        assert pub.replaying and pub.snapshots >= 1
        while pub.replaying:
            pub.pump()
        for s in (late, sub):
            _, events = _next(s)
            assert [(e["block_hashes"], e["parent_block_hash"], e["token_ids"]) for e in events] == [
                ([k0], None, [1, 2, 3, 4]), ([k1], k0, [5, 6, 7, 8])]
    finally:
        late.close(0)


def test_reannouncement_goes_a_batch_at_a_time_and_skips_removed_keys(pub_sub):
    from broker.kv_publisher import MAX_EVENTS_PER_BATCH

    pub, sub = pub_sub
    keys = [b"m%07d" % i for i in range(MAX_EVENTS_PER_BATCH + 10)]
    pub.on_events(b"w0", KvEvents(stored=keys, tokens=[_block(k, None, [i % 300] * BS) for i, k in enumerate(keys)]),
                  BS, 1 << 20)
    _next(sub), _next(sub)  # announced live: two batches
    pub._replay, pub._replay_at = list(pub._announced), 0  # as on_subscriptions() starts it
    pub.pump()
    assert pub.replaying and len(_next(sub)[1]) == MAX_EVENTS_PER_BATCH  # one batch per loop turn
    pub.on_events(b"w0", KvEvents(removed=keys[-5:]), BS, 1 << 20)  # evicted meanwhile: its BlockRemoved goes out
    assert _next(sub)[1] == [{"type": "BlockRemoved", "block_hashes": keys[-5:], "medium": "GPU"}]
    pub.pump()
    assert not pub.replaying
    assert [e["block_hashes"][0] for e in _next(sub)[1]] == keys[MAX_EVENTS_PER_BATCH:-5]
