"""Units of the RL control plane: tensor frames, the packed broadcast plan, init_info
checks, weight spans, the prefix-cache reset, HF-named weight access (both CPU
linears, Qwen3's per-head norms) and the broker's pause / stale hold-out with fake
workers."""
from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from common import tensor_frames
from common.client import Client, RequestError
from common.dist_weight_transfer import DistInitInfo, bucket_plan, weight_checksums
from common.errors import BadRequest
from common.protocol import GenerateRequest, SamplingParams
from tests.support.engine_helpers import make_engine, request
from tests.support.procs import ProcGroup, cluster_info, wait_for, wait_for_workers
from worker.engine.core.block_manager import BlockManager
from worker.engine.rl.control import VersionSpans
from worker.engine.records import EngineSequence, Request


# ------------------------------------------------------------------ tensor frames
def test_buckets_round_trip_with_tensors_cut_into_frames(monkeypatch):
    monkeypatch.setattr(tensor_frames, "FRAME_BYTES", 100)
    named = [("a", torch.arange(60, dtype=torch.float32).view(6, 10)),  # 240 bytes: 3 frames
             ("b", torch.randn(5, dtype=torch.bfloat16)),
             ("c", torch.empty(0, 4)),
             ("d", torch.randn(3, 3, dtype=torch.float16).t())]  # not contiguous
    got = []
    for info, frames in tensor_frames.buckets(named, bucket_bytes=250):
        entries = [(n, getattr(torch, d), tuple(s)) for n, d, s in zip(info["names"], info["dtype_names"],
                                                                        info["shapes"])]
        got.extend(tensor_frames.decode_frames(entries, [bytes(f) for f in frames]))
    assert [n for n, _ in got] == ["a", "b", "c", "d"]
    for (_, want), (_, have) in zip(named, got):
        assert have.dtype == want.dtype and torch.equal(have, want)


def test_decode_frames_refuses_a_short_payload():
    entries = [("w", torch.float32, (4,))]
    with pytest.raises(ValueError, match="needs 16"):
        tensor_frames.decode_frames(entries, [b"\0" * 12])
    with pytest.raises(ValueError, match="frame"):
        tensor_frames.decode_frames(entries, [])


def test_packed_plan_closes_a_buffer_once_it_exceeds_the_size():
    assert bucket_plan([10, 10, 10], packed=False, buffer_bytes=1) == [[0], [1], [2]]
    # vLLM's packed layout: the crossing tensor joins the buffer it overflows.
    assert bucket_plan([10, 10, 10, 5], packed=True, buffer_bytes=15) == [[0, 1], [2, 3]]
    assert bucket_plan([40, 1], packed=True, buffer_bytes=15) == [[0], [1]]


@pytest.mark.parametrize("info, needle", [
    ({"master_port": 1, "world_size": 2}, "lacks 'master_address'"),
    ({"master_address": "h", "master_port": "x", "world_size": 2}, "master_port must be an integer"),
    ({"master_address": "h", "master_port": 5, "world_size": 1}, "world_size >= 2"),
    ({"master_address": "h", "master_port": 5, "world_size": 2, "backend": "mpi"}, "backend"),
    ({"master_address": "h", "master_port": 5, "world_size": 2, "bogus": 1}, "unknown init_info"),
    ({"nccl_unique_id_b64": "AAAA", "world_size": 2}, "not supported"),
])
def test_init_info_is_checked(info, needle):
    with pytest.raises(ValueError, match=needle):
        DistInitInfo.from_dict(info)


# ----------------------------------------------------------------- engine pieces
def _seq(tokens):
    req = GenerateRequest(request_id="r", prompt_token_ids=[1, 2], params=SamplingParams())
    return EngineSequence(Request(req, arrival_seq=0, max_tokens=10, eos_token_ids=[], now=0.0), 0, [1, 2])


def test_weight_version_spans_follow_the_version_of_each_token():
    seq, spans = _seq([1, 2]), VersionSpans()  # what the RL component tracks per choice
    for version in ("default", "default", "v1", "v1", "v1", "v2"):
        seq.append_token(7)
        spans.track(version, len(seq.output_ids) - 1)
    assert spans.spans(len(seq.output_ids)) == [("default", 0, 2), ("v1", 2, 5), ("v2", 5, 6)]
    del seq.output_ids[-1]  # a stop string trimmed the last token
    assert spans.spans(len(seq.output_ids)) == [("default", 0, 2), ("v1", 2, 5)]
    assert VersionSpans().spans(len(_seq([1]).output_ids)) == []


def test_reset_prefix_cache_forgets_cached_blocks_only():
    bm = BlockManager(8, 4)
    seq = _seq([])
    seq.token_ids = list(range(12))
    assert bm.allocate_slots(seq, 12)
    seq.num_computed_tokens = 12
    bm.register_computed_blocks(seq)
    bm.free(seq)
    probe = _seq([])
    probe.token_ids = list(range(12)) + [99]
    assert len(bm.find_cached_prefix(probe)) == 3
    free = bm.num_free_blocks
    assert bm.reset_prefix_cache() == 3
    assert bm.num_free_blocks == free
    probe2 = _seq([])
    probe2.token_ids = list(range(12)) + [99]
    assert bm.find_cached_prefix(probe2) == []


@pytest.mark.parametrize("kind, linear", [("llama", "onednn"), ("llama", "torch"), ("qwen3", "torch")])
def test_model_weights_by_checkpoint_name(tiny_model_root, kind, linear):
    from tests.support.model_factory import tiny_model_dir

    a, b = tiny_model_dir(kind, tiny_model_root, 0), tiny_model_dir(kind, tiny_model_root, 1)
    engine = make_engine(a, cpu_linear=linear)
    sd_a, sd_b = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert engine.rl.weight_checksums("") == weight_checksums(sd_a.items())
    with pytest.raises(BadRequest, match="has shape"):
        engine.rl.weights.check([("model.norm.weight", "float32", [1])])
    with pytest.raises(BadRequest, match="unknown weight"):
        engine.rl.weights.check([("model.layers.99.mlp.up_proj.weight", "float32", [1])])
    # Streamed in two halves with the CPU layers left unpacked in between, as an update does.
    names = sorted(sd_b)
    engine.rl.write_weights({n: sd_b[n] for n in names[::2]}, more_to_come=True)
    engine.rl.write_weights({n: sd_b[n] for n in names[1::2]}, more_to_come=True)
    engine.rl.end_weight_writes()
    assert engine.rl.weight_checksums("") == weight_checksums(sd_b.items())
    fresh = make_engine(b, cpu_linear=linear)
    reqs = lambda: [request("x", [5, 6, 7, 8], max_tokens=8, ignore_eos=True)]  # noqa: E731
    assert engine.generate(reqs())["x"][0].token_ids == fresh.generate(reqs())["x"][0].token_ids


# ---------------------------------------------------------- broker, fake workers
@pytest.fixture(scope="module")
def fake_pool(tmp_path_factory):
    with ProcGroup(tmp_path_factory.mktemp("rl-fake")) as procs:
        broker = procs.broker("--max-pending", "3")
        for rank in (0, 1):
            procs.fake_worker(broker, rank, "--step-delay", "0.01")
        wait_for_workers(broker.frontend, 2)
        with Client(broker.frontend) as client:
            yield procs, broker, client


def _gen(client, rid, rank=None):
    req = GenerateRequest(request_id=rid, prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=3),
                          data_parallel_rank=rank)
    return [t for d in client.generate(req) for t in d.token_ids]


def test_paused_broker_queues_up_to_its_bound(fake_pool):
    """pause(keep): new requests wait in the broker (vLLM 0.33 refuses them only after abort / wait)."""
    procs, broker, client = fake_pool
    client.pause("keep")
    assert client.is_paused() and cluster_info(broker.frontend).paused
    results, errors = {}, {}

    def run(i):
        try:
            results[i] = _gen(client, f"p{i}")
        except RequestError as exc:
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    wait_for(lambda: errors, 10, "the request past the queue bound to be refused")
    assert list(errors.values())[0].status == 503 and "overloaded" in list(errors.values())[0].message
    assert not results  # queued, not served
    client.resume()
    for t in threads:
        t.join(10)
    assert len(results) == 3 and all(len(r) == 3 for r in results.values())


def test_pause_wait_refuses_new_requests_and_keeps_the_queued_ones(fake_pool):
    """vLLM 0.33: after pause(wait) a new request is refused (retryable 503); those queued
    before it (here by an earlier pause(keep)) stay queued and run on resume."""
    procs, broker, client = fake_pool
    client.pause("keep")
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _gen(client, f"q{i}"))) for i in range(2)]
    for t in threads:
        t.start()
    wait_for(lambda: cluster_info(broker.frontend).pending == 2, 10, "two requests to queue")
    client.pause("wait")
    with pytest.raises(RequestError) as err:
        _gen(client, "refused")
    assert (err.value.status, err.value.type, err.value.message) == (
        503, "ServiceUnavailableError", "Generation is paused. Please retry after it resumes.")
    assert cluster_info(broker.frontend).pending == 2 and not results
    client.resume()
    for t in threads:
        t.join(10)
    assert len(results) == 2 and all(len(r) == 3 for r in results.values())
    assert len(_gen(client, "after-resume")) == 3


def test_restarted_worker_gets_the_pool_version_replayed(fake_pool):
    procs, broker, client = fake_pool
    client.control("update_weight_version", {"new_version": "v9"})
    assert [r["weight_version"] for r in client.weight_info()["ranks"]] == ["v9", "v9"]
    victim = next(p for p in procs.procs if p.name == "fake-worker1" and p.alive())
    victim.kill9()
    wait_for_workers(broker.frontend, 1, timeout=20)
    procs.fake_worker(broker, 1, "--step-delay", "0.01")  # boots with "default"
    wait_for(lambda: [(r["weight_version"], r["stale"]) for r in client.weight_info()["ranks"]] ==
             [("v9", False), ("v9", False)], 20, "rank 1 brought to v9")
    assert _gen(client, "after-replay", rank=1)[0] == 1000  # served by rank 1


def test_control_errors_name_the_rank(fake_pool):
    _, _, client = fake_pool
    with pytest.raises(RequestError) as err:
        client.control("no_such_command")
    assert err.value.status == 400 and "rank 0: unknown control command" in err.value.message
    with pytest.raises(RequestError) as err:
        client.control("is_sleeping", rank=7)
    assert err.value.status == 400 and "no live worker has rank 7" in err.value.message


def test_level2_wake_reloads_a_whole_checkpoint_update(tiny_model_root):
    from tests.support.model_factory import tiny_model_dir

    a, b = tiny_model_dir("llama", tiny_model_root, 0), tiny_model_dir("llama", tiny_model_root, 1)
    engine, fresh_b = make_engine(a), make_engine(b)
    engine.rl.write_weights(engine.rl.read_checkpoint(str(b)), from_disk=str(b))
    engine.rl.sleep(2)
    assert engine.rl.wake_up(None) and engine.rl.disk_lineage == [str(b)]
    reqs = lambda: [request("x", [5, 6, 7, 8], max_tokens=8, ignore_eos=True)]  # noqa: E731
    assert engine.generate(reqs())["x"][0].token_ids == fresh_b.generate(reqs())["x"][0].token_ids


# ------------------------------------------------ refused / failed commands change nothing
def test_refused_pause_leaves_the_pool_serving(fake_pool):
    procs, broker, client = fake_pool
    for call, status, needle in [
        (lambda: client.pause("keep", rank=7), 400, "no live worker has rank 7"),
        (lambda: client.pause("later"), 400, "unknown pause mode"),
        (lambda: client.control("sleep", {"level": 5}), 400, "sleep level must be"),
        (lambda: client.control("sleep", {"level": 1, "mode": "soon"}), 400, "unknown pause mode"),
    ]:
        with pytest.raises(RequestError) as err:
            call()
        assert err.value.status == status and needle in err.value.message
        assert not client.is_paused() and not cluster_info(broker.frontend).paused
        # Nothing reached a worker: none of them paused either.
        assert not any(r.result["is_sleeping"] for r in client.control("is_sleeping").ranks)
        assert len(_gen(client, f"after-refusal-{time.monotonic_ns()}")) == 3  # served, not queued


def test_pause_without_a_worker_changes_nothing(tmp_path):
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker()
        with Client(broker.frontend) as client:
            with pytest.raises(RequestError) as err:
                client.pause("keep")
            assert err.value.status == 503 and "no worker" in err.value.message
            assert not client.is_paused() and not cluster_info(broker.frontend).paused
            procs.fake_worker(broker, 0)
            wait_for_workers(broker.frontend, 1)
            assert _gen(client, "first") == [0, 1, 2]  # dispatched at once: the broker is not paused


class _Call(threading.Thread):
    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.error, self.result = fn, None, None
        self.start()

    def run(self):
        try:
            self.result = self.fn()
        except RequestError as exc:
            self.error = exc


def test_failed_pause_is_undone_on_the_ranks_that_paused(tmp_path):
    """pause(wait) waits on a request that never finishes on its rank; that rank dies: the
    pause fails, the ranks that did pause are resumed and dispatch goes on."""
    held = [7, 1]  # --hold-token 7: never starts, so a pause(wait) there never answers
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker()
        workers = {rank: procs.fake_worker(broker, rank, "--hold-token", "7") for rank in (0, 1)}
        wait_for_workers(broker.frontend, 2)
        with Client(broker.frontend) as client:
            def paused_on(rank):
                return client.control("is_sleeping", rank=rank).ranks[0].result["is_sleeping"]

            # One rank fails (dies), the other paused: it is resumed.
            sent = cluster_info(broker.frontend).stats.dispatched
            stuck = _Call(lambda: _gen_prompt(client, "held-1", held, 1))
            # Dispatched: the pause reaches rank 1 after it (one ordered connection per worker).
            wait_for(lambda: cluster_info(broker.frontend).stats.dispatched > sent, 10, "the held request")
            pause = _Call(lambda: client.pause("wait"))
            wait_for(lambda: paused_on(0), 10, "rank 0 to pause")
            assert pause.is_alive() and client.is_paused()
            workers[1].kill9()
            pause.join(30)
            assert pause.error is not None and pause.error.status == 500 and "rank 1" in pause.error.message
            stuck.join(30)
            assert stuck.error is not None  # pinned to the rank that died
            assert not client.is_paused() and not paused_on(0)
            assert _gen(client, "after-partial") == [0, 1, 2]

            # Every rank fails: dispatch is back as well.
            sent = cluster_info(broker.frontend).stats.dispatched
            stuck = _Call(lambda: _gen_prompt(client, "held-0", held, 0))
            # Dispatched: the pause reaches rank 0 after it (one ordered connection per worker).
            wait_for(lambda: cluster_info(broker.frontend).stats.dispatched > sent, 10, "the held request")
            pause = _Call(lambda: client.pause("wait"))
            wait_for(lambda: cluster_info(broker.frontend).paused, 10, "the broker to pause")
            workers[0].kill9()
            pause.join(30)
            assert pause.error is not None and pause.error.status == 500
            assert not client.is_paused()
            procs.fake_worker(broker, 2)
            wait_for_workers(broker.frontend, 1, ranks={2})
            assert _gen(client, "after-total") == [2000, 2001, 2002]


def _gen_prompt(client, rid, prompt, rank=None):
    req = GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=SamplingParams(max_tokens=3),
                          data_parallel_rank=rank)
    return [t for d in client.generate(req) for t in d.token_ids]


def test_a_rank_lost_during_resume_or_relabel_does_not_leave_the_pool_behind(tmp_path):
    """A rank that stops answering (SIGSTOP: the broker only learns it is gone when its
    heartbeats stop) must not keep the survivors paused in the broker or held out as stale."""
    import signal

    with ProcGroup(tmp_path) as procs:
        broker = procs.broker()
        workers = {rank: procs.fake_worker(broker, rank) for rank in (0, 1, 2)}
        wait_for_workers(broker.frontend, 3)
        with Client(broker.frontend) as client:
            workers[2].popen.send_signal(signal.SIGSTOP)
            reply = client.control("update_weight_version", {"new_version": "v5"})
            assert reply.result == {"lost_ranks": [2]} and [r.rank for r in reply.ranks] == [0, 1]
            info = client.weight_info()
            assert info["weight_version"] == "v5"
            assert [(r["rank"], r["weight_version"], r["stale"]) for r in info["ranks"]] == [(0, "v5", False),
                                                                                            (1, "v5", False)]
            client.pause("keep")
            workers[1].popen.send_signal(signal.SIGSTOP)
            reply = client.control("resume")
            assert reply.result == {"lost_ranks": [1]} and [r.rank for r in reply.ranks] == [0]
            assert not client.is_paused()
            assert _gen(client, "after-resume") == [0, 1, 2]
            for rank in (1, 2):
                workers[rank].kill9()
