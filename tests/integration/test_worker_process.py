"""Real `tokserve worker` processes (real engine, tiny random Llama) behind a real
broker: streamed outputs equal the in-process engine's, abort frees the engine,
and a worker killed mid-stream fails its streams without hangs."""
from __future__ import annotations

import asyncio
import random
import time

import msgspec
import numpy as np
import pytest
import zmq

from common import framing
from common.client import AsyncClient, Client, RequestError
from common.prefix_hash import prompt_routing_hashes
from common.protocol import MAGIC, GenerateRequest, KvBlockTokens, KvEvents, MsgType, OutputsHeader, SamplingParams, WorkerReady
from tests.support.procs import ProcGroup, cluster_info, free_endpoint, wait_for, wait_for_workers

pytestmark = pytest.mark.timeout(120)

ENGINE_ARGS = dict(num_kv_blocks=128, block_size=16, max_num_seqs=32, seed=0)


def _cli(args: dict) -> list[str]:
    out = []
    for k, v in args.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


def _requests(count: int, vocab: int = 256) -> list[GenerateRequest]:
    rng = random.Random(1234)
    reqs = []
    for i in range(count):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 40))]
        if i % 2:
            params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.0)
        else:  # seeded sampling is batch-invariant: per-request generator
            params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.8, seed=i, n=1 + i % 3)
        reqs.append(GenerateRequest(request_id=f"req-{i}", prompt_token_ids=prompt, params=params))
    return reqs


@pytest.fixture(scope="module")
def real_cluster(llama_dir, tmp_path_factory):
    with ProcGroup(tmp_path_factory.mktemp("worker-logs")) as procs:
        broker = procs.broker()
        workers = [procs.worker(broker, rank, "--model", str(llama_dir), "--threads", "1", *_cli(ENGINE_ARGS))
                   for rank in (0, 1)]
        try:
            wait_for_workers(broker.frontend, 2, timeout=90)
        except TimeoutError:
            pytest.fail("workers did not register\n" + procs.tails())
        yield broker, workers, procs


def _collect(deltas) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for d in deltas:
        tokens.setdefault(d.index, []).extend(d.token_ids)
    return tokens


def test_concurrent_streams_match_in_process_engine(real_cluster, llama_dir):
    broker, _, _ = real_cluster
    reqs = _requests(50)

    async def run_all():
        async with AsyncClient(broker.frontend) as client:
            async def one(r):
                deltas = [d async for d in client.generate(r)]
                return r.request_id, deltas
            return dict(await asyncio.gather(*(one(r) for r in reqs)))

    streamed = asyncio.run(run_all())

    from worker.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=str(llama_dir), num_threads=1, dtype="float32", **ENGINE_ARGS))
    expected = engine.generate(reqs)
    for r in reqs:
        got = streamed[r.request_id]
        assert _collect(got) == {d.index: d.token_ids for d in expected[r.request_id]}, r.request_id
        finishes = sorted((d.index, d.finish_reason) for d in got if d.finish_reason)
        assert finishes == sorted((d.index, d.finish_reason) for d in expected[r.request_id])


def test_bad_input_is_a_400_from_the_engine(real_cluster):
    broker, _, _ = real_cluster
    with Client(broker.frontend) as client:
        with pytest.raises(RequestError) as exc:
            list(client.generate(GenerateRequest(request_id="oov", prompt_token_ids=[1, 100_000])))
    assert exc.value.status == 400 and "out of vocabulary" in exc.value.message


def test_abort_frees_the_request_on_the_worker(real_cluster):
    broker, _, _ = real_cluster
    params = SamplingParams(max_tokens=900, ignore_eos=True, temperature=0.0)
    with Client(broker.frontend) as client:
        stream = client.generate(GenerateRequest(request_id="long", prompt_token_ids=list(range(1, 60)),
                                                 params=params, data_parallel_rank=0))
        next(stream)
        client.abort(["long"])
        rest = list(stream)
        assert rest and rest[-1].finish_reason == "abort"

    def freed():
        load = cluster_info(broker.frontend).workers[0].load
        return load.running == 0 and load.waiting == 0 and load.free_kv_blocks == load.total_kv_blocks

    wait_for(freed, 5, "worker 0 to free the aborted request's KV blocks")


def test_worker_publishes_kv_events(llama_dir, tmp_path):
    """A real worker, the test playing its broker (a ROUTER): READY is followed by a
    snapshot of its prefix cache (empty at start); serving a prompt of >= 2 full blocks
    sends, right after the OUTPUTS of the step that computed them, the blocks' routing
    keys, equal to what a gateway computes for the prompt (prompt_routing_hashes, salted
    too); a re-registration (the broker says DISCONNECT) is READY + a snapshot of every
    cached key."""
    bs = ENGINE_ARGS["block_size"]
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    endpoint = free_endpoint()
    router.bind(endpoint)

    def next_msg(timeout: float = 30.0):
        """The worker's next message other than a heartbeat: (identity, type, body frames)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not router.poll(int(left * 1000)):
                raise TimeoutError("no message from the worker\n" + procs.tails())
            frames = router.recv_multipart()
            assert frames[1] == MAGIC
            if frames[2] != MsgType.HEARTBEAT:
                return frames[0], frames[2], frames[3:]

    def kv_events(body: bytes) -> KvEvents:
        return msgspec.msgpack.decode(body, type=KvEvents)

    def serve(identity: bytes, req: GenerateRequest) -> list:
        """Send GENERATE; the worker's messages until it finished, then any trailing ones."""
        router.send_multipart([identity, MAGIC, MsgType.GENERATE, framing.encode(req), b"client-1"])
        seen = []
        while True:
            _, kind, rest = next_msg()
            seen.append((kind, rest))
            if kind == MsgType.OUTPUTS and req.request_id in framing.decode(rest[0], OutputsHeader).finished:
                break
        while router.poll(300):  # the last step's KV_EVENTS, if it had changes
            _, kind, rest = next_msg()
            seen.append((kind, rest))
        assert all(kind in (MsgType.OUTPUTS, MsgType.KV_EVENTS) for kind, _ in seen), seen
        for i, (kind, _) in enumerate(seen):
            if kind == MsgType.KV_EVENTS:  # one per step, after that step's OUTPUTS
                assert i > 0 and seen[i - 1][0] == MsgType.OUTPUTS, [k for k, _ in seen]
        return [kv_events(rest[0]) for kind, rest in seen if kind == MsgType.KV_EVENTS]

    with ProcGroup(tmp_path) as procs:
        try:
            # Slow heartbeats: the test answers none and must not be declared gone.
            procs.worker(endpoint, 0, "--model", str(llama_dir), "--threads", "1", "--heartbeat-interval", "30",
                         *_cli(ENGINE_ARGS))
            identity, kind, rest = next_msg(90)
            assert kind == MsgType.READY
            assert framing.decode(rest[0], WorkerReady).model.kv_block_size == bs
            _, kind, rest = next_msg()
            assert kind == MsgType.KV_EVENTS and kv_events(rest[0]) == KvEvents(cleared=True)

            params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
            prompt = [(7 * i + 3) % 200 for i in range(2 * bs + 5)]  # 2 full blocks + 5 tokens
            events = serve(identity, GenerateRequest(request_id="kv-1", prompt_token_ids=prompt, params=params))
            keys = prompt_routing_hashes(prompt, bs)
            assert len(keys) == 2
            # With their parent keys and token ids, for the cell's KV-event publisher (broker/kv_publisher.py).
            tokens = [KvBlockTokens(keys[i], keys[i - 1] if i else None,
                                    np.asarray(prompt[i * bs:(i + 1) * bs], dtype="<i4").tobytes()) for i in range(2)]
            assert len(events) == 1 and events[0] == KvEvents(stored=keys, tokens=tokens), events

            salted = [(11 * i + 5) % 200 for i in range(3 * bs + 1)]
            events = serve(identity, GenerateRequest(request_id="kv-2", prompt_token_ids=salted, params=params,
                                                     cache_salt="tenant-a"))
            salted_keys = prompt_routing_hashes(salted, bs, "tenant-a")
            assert len(salted_keys) == 3 and events == [KvEvents(stored=salted_keys)], events  # salted: no tokens

            # The same prompt again is a cache hit: nothing new to publish.
            assert serve(identity, GenerateRequest(request_id="kv-3", prompt_token_ids=prompt, params=params)) == []

            # Re-registration: READY, then the snapshot of everything cached.
            router.send_multipart([identity, MAGIC, MsgType.DISCONNECT, b""])
            _, kind, _ = next_msg()
            assert kind == MsgType.READY
            _, kind, rest = next_msg()
            assert kind == MsgType.KV_EVENTS
            snap = kv_events(rest[0])
            assert snap.cleared and not snap.removed and sorted(snap.stored) == sorted(keys + salted_keys)
        finally:
            router.close(0)



def test_kill9_worker_mid_stream_fails_its_streams(real_cluster):
    """Runs last in this module: it kills worker 1."""
    broker, workers, _ = real_cluster
    params = SamplingParams(max_tokens=900, ignore_eos=True, temperature=0.0)

    async def run():
        async with AsyncClient(broker.frontend) as client:
            async def one(i):
                deltas = []
                try:
                    async for d in client.generate(GenerateRequest(
                            request_id=f"victim-{i}", prompt_token_ids=[5, 6, 7 + i],
                            params=params if i % 2 else SamplingParams(max_tokens=300, ignore_eos=True),
                            data_parallel_rank=i % 2)):
                        deltas.append(d)
                    return deltas
                except RequestError as exc:
                    exc.at = time.monotonic()
                    return exc

            tasks = [asyncio.create_task(one(i)) for i in range(6)]
            await asyncio.sleep(0.5)  # streams are running on both workers
            workers[1].kill9()
            killed = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            return results, killed

    results, killed = asyncio.run(run())
    for i, res in enumerate(results):
        if i % 2:  # on the killed worker
            assert isinstance(res, RequestError) and res.status == 500 and "died" in res.message, res
            assert res.at - killed < 3.0
        else:
            assert not isinstance(res, Exception), res
            assert sum(len(d.token_ids) for d in res) == 300
    assert broker.alive()
    assert [w.rank for w in cluster_info(broker.frontend).workers] == [0]
