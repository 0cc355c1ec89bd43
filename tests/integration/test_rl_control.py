"""The RL control plane end to end: real broker, two real workers, a gateway with
--enable-rl and an API key; weights pushed over ZMQ frames, gloo and from disk.

The workers boot from tiny llama A (seed 0); B (seed 1) is the same architecture
with other weights.  References are in-process engines loaded from A and B.
Each test leaves the pool serving A (restored from disk) and resumed.
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest
from safetensors.torch import load_file

from common import tensor_frames
from common.client import Client, RequestError
from common.dist_weight_transfer import TrainerWeightSender, weight_checksums
from common.protocol import GenerateRequest, SamplingParams
from tests.support.engine_helpers import make_engine, request
from tests.support.gateway_helpers import GENERATE, metric_value, start_gateway
from tests.support.model_factory import tiny_model_dir
from tests.support.procs import ProcGroup, cluster_info, free_port, wait_for, wait_for_workers

API_KEY = "rl-secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
WORKER_ARGS = ("--max-num-seqs", "8", "--num-kv-blocks", "128", "--threads", "1", "--max-model-len", "256")
PROMPTS = [[5, 9, 11, 40, 77, 3], [100, 23, 18, 64], [7, 7, 200, 31, 90, 12, 45]]


def _state_dict(model_dir):
    return load_file(str(model_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def models(tiny_model_root):
    return tiny_model_dir("llama", tiny_model_root, 0), tiny_model_dir("llama", tiny_model_root, 1)


@pytest.fixture(scope="module")
def references(models):
    """Greedy continuations of PROMPTS under A and under B (in-process engines)."""
    out = {}
    for label, model_dir in zip("AB", models):
        engine = make_engine(model_dir)
        res = engine.generate([request(f"{label}{i}", p, max_tokens=12, ignore_eos=True)
                               for i, p in enumerate(PROMPTS)])
        out[label] = [res[f"{label}{i}"][0].token_ids for i in range(len(PROMPTS))]
        engine.close()
    assert out["A"] != out["B"]
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory, models):
    a, _ = models
    with ProcGroup(tmp_path_factory.mktemp("rl-stack")) as procs:
        broker = procs.broker()
        for rank in (0, 1):
            procs.worker(broker, rank, "--model", str(a), *WORKER_ARGS)
        wait_for_workers(broker.frontend, 2, timeout=120)
        gw = start_gateway(procs, broker.frontend, "--enable-rl", "--api-key", API_KEY)
        with httpx.Client(base_url=gw.url, timeout=120, headers=AUTH) as http, Client(broker.frontend) as client:
            yield procs, broker, http, client


@pytest.fixture
def pool(stack, models):
    """The stack, put back to serving A (resumed, awake) after the test."""
    yield stack
    procs, broker, http, client = stack
    for _ in range(2):
        try:
            client.control("resume")
            client.wake_up()
            break
        except RequestError:  # e.g. a weight update left open by a failing test
            client.control("finish_weight_update")
    client.update_weights_from_disk(str(models[0]), "A")
    assert not client.is_paused()


def generate(client: Client, prompt, rank=None, max_tokens=12, rid=None):
    req = GenerateRequest(request_id=rid or f"g-{time.monotonic_ns()}", prompt_token_ids=list(prompt),
                          params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                          data_parallel_rank=rank)
    deltas = list(client.generate(req))
    return [t for d in deltas for t in d.token_ids], deltas


def served_by_each_rank(client: Client, max_tokens=12):
    return {rank: [generate(client, p, rank, max_tokens)[0] for p in PROMPTS] for rank in (0, 1)}


# --------------------------------------------------------------------------- routes
def test_rl_routes_need_the_api_key(stack):
    _, _, http, _ = stack
    r = httpx.post(str(http.base_url) + "/pause", timeout=10)
    assert r.status_code == 401
    assert httpx.get(str(http.base_url) + "/is_paused", timeout=10).status_code == 401
    assert http.get("/is_paused").json() == {"is_paused": False}
    assert http.get("/get_world_size").json() == {"world_size": 2}
    assert http.get("/get_world_size", params={"include_dp": "false"}).json() == {"world_size": 1}


def test_weight_versions_default_spans(stack):
    _, _, http, _ = stack
    body = {"token_ids": PROMPTS[0], "sampling_params": {"max_tokens": 5, "temperature": 1.0, "seed": 3, "ignore_eos": True,
                                                         "n": 2}}
    r = http.post(GENERATE, json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    for choice in choices:
        assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": 5}]
    chunks = []
    with http.stream("POST", GENERATE, json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(httpx.Response(200, content=line[6:]).json())
    finals = [c for ch in chunks for c in ch["choices"] if c["finish_reason"] is not None]
    others = [c for ch in chunks for c in ch["choices"] if c["finish_reason"] is None]
    assert len(finals) == 2 and all(c["weight_versions"] == [{"version": "default", "start": 0, "end": 5}]
                                    for c in finals)
    assert others and all(c["weight_versions"] is None for c in others)


# ------------------------------------------------------------------- transfer backends
def test_update_over_zmq_frames(pool, models, references):
    _, _, http, client = pool
    sd_b = _state_dict(models[1])
    # Small buckets: several update_weights rounds, tensors cut across frames.
    assert client.update_weights(sd_b.items(), "v-zmq", bucket_bytes=20_000) == len(sd_b)
    assert served_by_each_rank(client) == {0: references["B"], 1: references["B"]}
    info = http.get("/weight_info").json()
    assert info["weight_version"] == "v-zmq"
    assert [(r["rank"], r["weight_version"], r["stale"]) for r in info["ranks"]] == [(0, "v-zmq", False),
                                                                                    (1, "v-zmq", False)]
    baseline = {}
    for rank in (0, 1):
        baseline.update(weight_checksums(sd_b.items(), prefix=f"dp{rank}:pp0:pcp0:tp0:"))
    assert http.post("/weight_checker", json={"action": "checksum"}).json()["checksums"] == baseline
    assert http.post("/weight_checker", json={"action": "compare", "baseline": baseline}).json() == {
        "match": True, "mismatches": []}
    tokens, deltas = generate(client, PROMPTS[0], max_tokens=4)
    assert deltas[-1].weight_versions == [("v-zmq", 0, 4)]


def test_update_from_disk_over_http(pool, models, references):
    _, _, http, client = pool
    assert http.post("/start_weight_update").json() == {"message": "Weight update started"}
    assert http.post("/update_weights", json={"update_info": {"path": str(models[1])}}).json() == {
        "message": "Weights updated"}
    # Staged until finish: the pool still serves A.
    assert generate(client, PROMPTS[0], 0)[0] == references["A"][0]
    assert http.post("/finish_weight_update", json={"weight_version": "v-disk"}).json() == {
        "message": "Weight update finished"}
    assert served_by_each_rank(client) == {0: references["B"], 1: references["B"]}
    assert http.get("/weight_info").json()["weight_version"] == "v-disk"
    assert http.post("/update_weight_version", json={"new_version": "v-disk-2"}).json() == {
        "success": True, "new_version": "v-disk-2"}
    assert http.get("/weight_info").json()["weight_version"] == "v-disk-2"


def test_update_over_gloo_with_a_trainer(pool, models, references):
    _, _, http, client = pool
    sd_b = _state_dict(models[1])
    named = sorted(sd_b.items())
    sender = TrainerWeightSender("127.0.0.1", free_port(), world_size=3, packed=True,
                                 packed_buffer_size_bytes=50_000, backend="gloo", timeout_s=60)
    errors = []

    def run(fn):
        t = threading.Thread(target=lambda: _catch(fn, errors))
        t.start()
        return t

    joined = run(sender.connect)
    assert http.post("/init_weight_transfer_engine", json={"init_info": sender.init_info()}).json() == {
        "message": "Weight transfer initialized"}
    joined.join(60)
    # Not paused (as TRL's VLLMClient sends it): the engine threads receive each bucket
    # between two steps and stage it; serving stays on A until finish swaps B in.
    assert http.post("/start_weight_update").status_code == 200
    for half in (named[: len(named) // 2], named[len(named) // 2:]):
        sending = run(lambda half=half: sender.send(half))
        assert http.post("/update_weights", json={"update_info": sender.update_info(half)}).status_code == 200
        sending.join(60)
    assert not errors
    assert served_by_each_rank(client) == {0: references["A"], 1: references["A"]}
    assert http.post("/finish_weight_update", json={"weight_version": "v-gloo-staged"}).status_code == 200
    assert served_by_each_rank(client) == {0: references["B"], 1: references["B"]}
    # Paused: written in place as it arrives.
    assert http.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    assert http.post("/start_weight_update").status_code == 200
    for half in (named[: len(named) // 2], named[len(named) // 2:]):  # two buckets
        sending = run(lambda half=half: sender.send(half))
        assert http.post("/update_weights", json={"update_info": sender.update_info(half)}).status_code == 200
        sending.join(60)
    assert not errors
    # Written in place while paused: resuming before finish would serve half an update.
    r = http.post("/resume")
    assert r.status_code == 400 and "finish_weight_update" in r.json()["error"]["message"]
    assert http.post("/finish_weight_update", json={"weight_version": "v-gloo"}).status_code == 200
    assert http.post("/resume").json() == {"status": "resumed"}
    assert served_by_each_rank(client) == {0: references["B"], 1: references["B"]}
    assert http.post("/shutdown_weight_transfer_engine").json() == {"message": "Weight transfer shut down"}
    baseline = {}
    for rank in (0, 1):
        baseline.update(weight_checksums(named, prefix=f"dp{rank}:pp0:pcp0:tp0:"))
    assert http.post("/weight_checker", json={"action": "compare", "baseline": baseline}).json()["match"]


def _catch(fn, errors):
    try:
        fn()
    except Exception as exc:  # surfaced by the test's assert on ``errors``
        errors.append(exc)


# ---------------------------------------------------------------------- pause modes
class _Stream(threading.Thread):
    def __init__(self, client, prompt, max_tokens, rank=0, rid=None):
        super().__init__(daemon=True)
        self.client, self.prompt, self.max_tokens, self.rank = client, prompt, max_tokens, rank
        self.rid = rid or f"s-{time.monotonic_ns()}"
        self.tokens: list[int] = []
        self.deltas = []
        self.error = None

    def run(self):
        req = GenerateRequest(request_id=self.rid, prompt_token_ids=list(self.prompt),
                              params=SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True),
                              data_parallel_rank=self.rank)
        try:
            for d in self.client.generate(req):
                self.deltas.append(d)
                self.tokens.extend(d.token_ids)
        except Exception as exc:
            self.error = exc


def _settled_length(stream, quiet_s: float = 0.3, timeout: float = 20.0) -> int:
    """The stream's token count once no delta has arrived for ``quiet_s`` (a paused stream's
    last deltas may reach this loaded process late)."""
    deadline = time.monotonic() + timeout
    seen, since = len(stream.tokens), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = len(stream.tokens)
        if now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return seen
    raise TimeoutError("the paused stream kept receiving tokens")


def test_pause_keep_update_resume_splits_the_stream(pool, models, references):
    _, _, http, client = pool
    client.control("update_weight_version", {"new_version": "A"})
    total = 120
    for attempt in range(3):
        stream = _Stream(client, PROMPTS[1], total, rid=f"split-{attempt}")
        stream.start()
        wait_for(lambda: len(stream.tokens) >= 5, 30, "the stream to start")
        assert http.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
        # The pause must catch the stream running: on a loaded machine this thread may see
        # its first tokens only after it finished; then run it again, not on the clock.
        try:
            wait_for(lambda: any(w.load.running for w in client.info().workers), 10, "the stream frozen")
            break
        except TimeoutError:
            assert http.post("/resume").json() == {"status": "resumed"}
            stream.join(60)
    else:
        raise AssertionError("three tries and the pause never caught the stream running")
    assert http.get("/is_paused").json() == {"is_paused": True}
    frozen = _settled_length(stream)  # deltas of the step that ran as the pause landed may still arrive
    time.sleep(0.5)  # the negative check: nothing more while paused
    assert len(stream.tokens) == frozen < total  # frozen: no token while paused
    client.update_weights(_state_dict(models[1]).items(), "v-new")
    assert http.post("/resume").json() == {"status": "resumed"}
    stream.join(60)
    assert stream.error is None and len(stream.tokens) == total
    spans = stream.deltas[-1].weight_versions
    assert [s[0] for s in spans] == ["A", "v-new"] and spans[0][1] == 0 and spans[-1][2] == total
    boundary = spans[0][2]
    assert spans[1][1] == boundary and 5 <= boundary == frozen
    # Before the switch: A's tokens; after it: exactly what B samples for that prefix.
    a_engine = make_engine(models[0])
    a_ref = a_engine.generate([request("a", PROMPTS[1], max_tokens=boundary, ignore_eos=True)])["a"][0].token_ids
    assert stream.tokens[:boundary] == a_ref
    b_engine = make_engine(models[1])
    cont = b_engine.generate([request("b", PROMPTS[1] + stream.tokens[:boundary], max_tokens=total - boundary,
                                      ignore_eos=True)])["b"][0].token_ids
    assert stream.tokens[boundary:] == cont


PAUSED = "Generation is paused. Please retry after it resumes."  # vLLM 0.33 core.py _reject_add_while_paused


def _assert_rejected_while_paused(http, client, broker):
    """vLLM 0.33: a user pause in abort / wait mode refuses new requests with a retryable 503,
    on the ZeroMQ wire and on the generation routes (the OpenAI ones share the relay)."""
    with pytest.raises(RequestError) as err:
        generate(client, PROMPTS[2], rank=None)
    assert (err.value.status, err.value.type, err.value.message) == (503, "ServiceUnavailableError", PAUSED)
    for n in (1, 2):  # vLLM rejects each child of an n>1 request (and reclaims the siblings): one 503
        r = http.post(GENERATE, json={"token_ids": PROMPTS[2], "sampling_params": {"max_tokens": 3, "n": n}})
        assert r.status_code == 503, r.text
        assert r.json() == {"error": {"message": PAUSED, "type": "ServiceUnavailableError", "param": None,
                                      "code": 503}}
    assert cluster_info(broker.frontend).pending == 0  # refused, not queued


def test_pause_abort_refuses_new_requests_until_resume(pool, references):
    _, broker, http, client = pool
    client.control("update_weight_version", {"new_version": "A"})
    stream = _Stream(client, PROMPTS[0], 200)
    stream.start()
    wait_for(lambda: len(stream.tokens) >= 2, 30, "the stream to start")
    assert http.post("/pause", params={"mode": "abort"}).json() == {"status": "paused"}
    stream.join(30)
    assert stream.deltas[-1].finish_reason == "abort" and len(stream.tokens) < 200
    assert http.get("/is_paused").json() == {"is_paused": True}
    _assert_rejected_while_paused(http, client, broker)
    assert http.post("/resume").json() == {"status": "resumed"}
    assert generate(client, PROMPTS[2])[0] == references["A"][2]
    r = http.post(GENERATE, json={"token_ids": PROMPTS[2], "sampling_params": {"max_tokens": 12, "temperature": 0,
                                                                              "ignore_eos": True}})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == references["A"][2]


def test_pause_keep_queues_new_requests_until_resume(pool, references):
    _, broker, http, client = pool
    assert http.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    waiting = _Stream(client, PROMPTS[2], 12, rank=None)
    waiting.start()
    wait_for(lambda: cluster_info(broker.frontend).pending == 1, 10, "the request queued in the broker")
    assert waiting.is_alive() and not waiting.tokens and waiting.error is None  # waits, is not rejected
    assert http.post("/resume").json() == {"status": "resumed"}
    waiting.join(60)
    assert waiting.error is None and waiting.tokens == references["A"][2]


def test_pause_keep_then_abort_ends_the_queued_requests(pool):
    """A pause(abort) ends the requests queued by an earlier pause(keep), as vLLM's abort
    empties its waiting queue; then new ones are refused."""
    _, broker, http, client = pool
    assert http.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    waiting = _Stream(client, PROMPTS[2], 12, rank=None)
    waiting.start()
    wait_for(lambda: cluster_info(broker.frontend).pending == 1, 10, "the request to queue")
    assert http.post("/pause", params={"mode": "abort"}).json() == {"status": "paused"}
    waiting.join(10)
    assert not waiting.is_alive() and waiting.error is None and waiting.deltas[-1].finish_reason == "abort"
    _assert_rejected_while_paused(http, client, broker)


def test_sleep_queues_new_requests_and_wake_up_ends_a_refusing_pause(pool, references):
    """vLLM 0.33: sleep pauses the scheduler without changing the refusal policy; wake_up
    resumes it, refusing no more."""
    _, broker, http, client = pool
    assert http.post("/sleep", params={"level": 0}).json() == {"status": "sleeping", "level": 0}
    waiting = _Stream(client, PROMPTS[2], 12, rank=None)
    waiting.start()
    wait_for(lambda: cluster_info(broker.frontend).pending == 1, 10, "the request to queue")
    assert http.post("/wake_up").status_code == 200
    waiting.join(60)
    assert waiting.error is None and waiting.tokens == references["A"][2]
    assert http.post("/pause", params={"mode": "wait"}).json() == {"status": "paused"}
    _assert_rejected_while_paused(http, client, broker)
    assert http.post("/wake_up").status_code == 200
    assert not client.is_paused() and generate(client, PROMPTS[2])[0] == references["A"][2]


def test_pause_wait_returns_when_in_flight_requests_finished(pool):
    _, broker, http, client = pool
    stream = _Stream(client, PROMPTS[0], 60)
    stream.start()
    wait_for(lambda: stream.tokens, 30, "the stream to start")
    assert http.post("/pause", params={"mode": "wait"}).json() == {"status": "paused"}
    stream.join(5)
    assert not stream.is_alive() and stream.deltas[-1].finish_reason == "length" and len(stream.tokens) == 60
    _assert_rejected_while_paused(http, client, broker)


def test_abort_requests_aborts_everything(pool):
    _, _, http, client = pool
    streams = [_Stream(client, p, 300, rank=i % 2) for i, p in enumerate(PROMPTS[:2])]
    for s in streams:
        s.start()
    wait_for(lambda: all(s.tokens for s in streams), 30, "the streams to start")
    assert http.post("/abort_requests", json={}).json() == {"status": "aborted", "aborted": 2}
    for s in streams:
        s.join(30)
        assert s.deltas[-1].finish_reason == "abort"


# ------------------------------------------------------------------ caches and sleep
def test_reset_prefix_cache_drops_cached_blocks(pool):
    _, _, http, client = pool
    prompt = list(range(10, 60))  # 3 full blocks of 16
    generate(client, prompt, 0, 2)
    assert generate(client, prompt, 0, 2)[1][0].num_cached_tokens == 48
    assert http.post("/reset_prefix_cache").json() == {"success": True}
    assert generate(client, prompt, 0, 2)[1][0].num_cached_tokens == 0


def sleep_states(http) -> dict:
    """vllm:engine_sleep_state per engine (rank): {rank: (awake, weights_offloaded, discard_all)}."""
    text = http.get("/metrics").text
    assert "# TYPE vllm:engine_sleep_state gauge" in text
    return {rank: tuple(metric_value(text, "vllm:engine_sleep_state", engine=str(rank), sleep_state=s)
                        for s in ("awake", "weights_offloaded", "discard_all")) for rank in (0, 1)}


def assert_sleep_states(http, want: tuple) -> None:
    """The gauges as soon as /sleep or /wake_up answered, with no waiting: the broker records
    the level from the workers' replies and /metrics asks the broker afresh."""
    assert sleep_states(http) == {0: want, 1: want}


def test_sleep_releases_and_wake_up_restores(pool, references, models):
    procs, broker, http, client = pool
    assert_sleep_states(http, (1, 0, 0))
    assert 'model_name="' in next(line for line in http.get("/metrics").text.splitlines()
                                  if line.startswith("vllm:engine_sleep_state{"))
    # Level 0 only pauses the scheduler: asleep, neither level flag (vLLM's record_sleep_state(1, 0)).
    assert http.post("/sleep", params={"level": 0}).json() == {"status": "sleeping", "level": 0}
    assert_sleep_states(http, (0, 0, 0))
    assert http.post("/wake_up").json() == {"status": "awake", "tags": None}
    assert_sleep_states(http, (1, 0, 0))
    for level in (1, 2):
        assert http.post("/sleep", params={"level": level}).json() == {"status": "sleeping", "level": level}
        assert_sleep_states(http, (0, int(level == 1), int(level == 2)))
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        wait_for(lambda: all(w.load.total_kv_blocks == 0 for w in cluster_info(broker.frontend).workers), 10,
                 "KV memory released")
        assert_sleep_states(http, (0, int(level == 1), int(level == 2)))  # the load reports agree
        if level == 2:
            partial = http.post("/wake_up", params={"tags": "kv_cache"}).json()
            assert partial == {"status": "sleeping", "tags": ["kv_cache"]}
            assert_sleep_states(http, (0, 0, 1))  # not fully awake: the state stays
        assert http.post("/wake_up").json() == {"status": "awake", "tags": None}
        assert_sleep_states(http, (1, 0, 0))
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        wait_for(lambda: all(w.load.free_kv_blocks == 128 for w in cluster_info(broker.frontend).workers), 10,
                 "KV memory restored")
        assert_sleep_states(http, (1, 0, 0))
        assert served_by_each_rank(client) == {0: references["A"], 1: references["A"]}


# -------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("path, kwargs, needle", [
    ("/pause", {"params": {"mode": "later"}}, "unknown pause mode"),
    ("/pause", {"params": {"mode": "keep", "rank": "7"}}, "no live worker has rank 7"),
    ("/finish_weight_update", {"json": {"weight_version": "x"}}, "no weight update in progress"),
    ("/update_weights", {"json": {"update_info": {"names": ["model.nope.weight"], "dtype_names": ["float32"],
                                                  "shapes": [[4]]}}}, "unknown weight 'model.nope.weight'"),
    ("/update_weights", {"json": {"update_info": {"names": ["model.norm.weight"], "dtype_names": ["float32"],
                                                  "shapes": [[3, 3]]}}}, "has shape [3, 3]"),
    ("/update_weights", {"json": {"update_info": {"names": ["model.norm.weight"], "dtype_names": ["int8"],
                                                  "shapes": [[64]]}}}, "unsupported weight dtype"),
    ("/update_weights", {"json": {"update_info": {"path": "/nonexistent/ckpt"}}}, "is not a directory"),
    ("/init_weight_transfer_engine", {"json": {"init_info": {"master_address": "127.0.0.1"}}}, "lacks"),
    ("/weight_checker", {"json": {"action": "compare"}}, "requires a 'baseline'"),
    ("/sleep", {"params": {"level": "3"}}, "level must be"),
    ("/wake_up", {"params": {"tags": "gpu"}}, "unknown wake_up tag"),
    ("/update_weight_version", {"json": {}}, "new_version"),
])
def test_bad_control_input_is_a_400_and_nothing_changes(pool, references, path, kwargs, needle):
    _, _, http, client = pool
    r = http.post(path, **kwargs)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert http.get("/is_paused").json() == {"is_paused": False}  # else the generate below would wait
    assert generate(client, PROMPTS[0], 1)[0] == references["A"][0]


@pytest.mark.parametrize("method, path, kwargs, param", [
    # FastAPI's location form, as vLLM's validation_exception_handler names them
    ("post", "/pause", {"params": {"mode": "invalid"}}, "query.mode"),
    ("post", "/pause", {"params": {"clear_cache": "maybe"}}, "query.clear_cache"),
    ("post", "/pause", {"params": {"rank": "first"}}, "query.rank"),
    ("post", "/sleep", {"params": {"level": "3"}}, "query.level"),
    ("post", "/sleep", {"params": {"level": "deep"}}, "query.level"),
    ("post", "/sleep", {"params": {"mode": "later"}}, "query.mode"),
    ("post", "/wake_up", {"params": {"tags": "gpu"}}, "query.tags"),
    ("get", "/get_world_size", {"params": {"include_dp": "maybe"}}, "query.include_dp"),
    ("post", "/reset_prefix_cache", {"params": {"reset_running_requests": "maybe"}},
     "query.reset_running_requests"),
    ("post", "/reset_prefix_cache", {"params": {"reset_external": "maybe"}}, "query.reset_external"),
    # Body(embed=True) fields
    ("post", "/init_weight_transfer_engine", {"json": {}}, "body.init_info"),
    ("post", "/update_weights", {"json": {}}, "body.update_info"),
    ("post", "/finish_weight_update", {"json": {"weight_version": 1}}, "body.weight_version"),
    ("post", "/update_weight_version", {"json": {}}, "body.new_version"),
    ("post", "/weight_checker", {"json": {"action": "sum"}}, "body.action"),
    ("post", "/abort_requests", {"json": {"request_ids": 5}}, "body.request_ids"),
    # vLLM's HTTPException: no param
    ("post", "/weight_checker", {"json": {"action": "compare"}}, None),
])
def test_bad_parameters_are_named_as_vllm_names_them(stack, method, path, kwargs, param):
    _, _, http, _ = stack
    r = getattr(http, method)(path, **kwargs)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "BadRequestError" and err["code"] == 400, err


def test_update_without_transfer_group_is_refused(pool, references):
    _, _, http, client = pool
    info = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[64]]}
    r = http.post("/update_weights", json={"update_info": info})
    assert r.status_code == 400 and "init_weight_transfer_engine" in r.json()["error"]["message"]
    assert served_by_each_rank(client)[0] == references["A"]


# -------------------------------------------------------------------- consistency
def test_restarted_worker_is_brought_to_the_pool_version(pool, models, references):
    procs, broker, http, client = pool
    client.update_weights_from_disk(str(models[1]), "v-disk-B")
    victim = next(p for p in procs.procs if p.name == "worker1" and p.alive())
    victim.kill9()
    wait_for_workers(broker.frontend, 1, timeout=30)
    procs.worker(broker, 1, "--model", str(models[0]), *WORKER_ARGS)  # boots from A
    wait_for(lambda: any(r["rank"] == 1 and not r["stale"] and r["weight_version"] == "v-disk-B"
                         for r in http.get("/weight_info").json()["ranks"]), 120, "rank 1 replayed to v-disk-B")
    assert served_by_each_rank(client)[1] == references["B"]

    # Over the wire the update cannot be replayed: a restarted worker is held out.
    client.update_weights(_state_dict(models[0]).items(), "v-wire-A")
    victim = next(p for p in procs.procs if p.name == "worker1" and p.alive())
    victim.kill9()
    wait_for_workers(broker.frontend, 1, timeout=30)
    procs.worker(broker, 1, "--model", str(models[1]), *WORKER_ARGS)  # boots from B: wrong weights
    wait_for_workers(broker.frontend, 2, timeout=120)
    ranks = {r["rank"]: r for r in http.get("/weight_info").json()["ranks"]}
    assert ranks[1]["stale"] and ranks[1]["weight_version"] == "default" and not ranks[0]["stale"]
    with pytest.raises(RequestError) as err:
        generate(client, PROMPTS[0], 1)
    assert err.value.status == 503 and "held out" in err.value.message
    # Unpinned requests only reach the current rank.
    for i in range(4):
        assert generate(client, PROMPTS[i % 3], None)[0] == references["A"][i % 3]
    client.update_weights(_state_dict(models[0]).items(), "v-wire-A", rank=1)
    assert {r["rank"]: r["stale"] for r in client.weight_info()["ranks"]} == {0: False, 1: False}
    assert served_by_each_rank(client)[1] == references["A"]


# --------------------------------------------------------- a rank lost mid-update
def _frozen_on_each_rank(client) -> bool:
    """Both ranks hold unfinished requests (their load reports, sent while paused)."""
    loads = {w.rank: w.load for w in client.info().workers}
    return all(r in loads and loads[r].running + loads[r].waiting > 0 for r in (0, 1))


def test_rank_killed_during_a_disk_update_does_not_split_the_pool(pool, models, references):
    """pause(keep) -> start -> update from disk -> kill -9 rank 1 -> finish: the survivor
    commits, the pool's version is the new one, the finish says so and names rank 1, and
    rank 1's replacement is replayed to the new weights before it serves."""
    procs, broker, http, client = pool
    client.control("update_weight_version", {"new_version": "A"})
    total = 200
    prompts = [[(7 * i + j) % 250 + 3 for j in range(5 + i % 4)] for i in range(24)]
    for attempt in range(3):
        streams = [_Stream(client, p, total, rank=i % 2, rid=f"lost-{attempt}-{i}") for i, p in enumerate(prompts)]
        for s in streams:
            s.start()
        # Eight seats per worker: 16 streams decode, the others wait in the workers.
        wait_for(lambda: sum(1 for s in streams if s.tokens) >= 16, 120, "16 streams to produce a token")
        client.pause("keep")
        # The scenario needs requests frozen on both ranks.  This thread sees tokens late on
        # a loaded machine, so every stream may have finished by the time it paused: then
        # run it again rather than depend on the clock.
        try:
            wait_for(lambda: _frozen_on_each_rank(client), 10, "requests frozen on both ranks")
            break
        except TimeoutError:
            client.resume()
            for s in streams:
                s.join(120)
    else:
        raise AssertionError("three tries and the pause never froze requests on both ranks")
    client.control("start_weight_update")
    client.control("update_weights", {"update_info": {"path": str(models[1])}})
    victim = next(p for p in procs.procs if p.name == "worker1" and p.alive())
    victim.kill9()
    reply = client.control("finish_weight_update", {"weight_version": "v-after-loss"})
    assert reply.result == {"committed": True, "weight_version": "v-after-loss", "lost_ranks": [1],
                            "reproducible_from_disk": True}
    assert [r.rank for r in reply.ranks] == [0]
    info = client.weight_info()
    assert info["weight_version"] == "v-after-loss"
    assert [(r["rank"], r["weight_version"], r["stale"]) for r in info["ranks"]] == [(0, "v-after-loss", False)]

    procs.worker(broker, 1, "--model", str(models[0]), *WORKER_ARGS)  # a replacement: boots from A
    wait_for(lambda: [(r["rank"], r["weight_version"], r["stale"]) for r in client.weight_info()["ranks"]] ==
             [(0, "v-after-loss", False), (1, "v-after-loss", False)], 180, "rank 1 replayed to v-after-loss")
    client.resume()
    for s in streams:
        s.join(120)
        assert not s.is_alive()
    # Rank 1's streams were pinned there: those not done before the kill end with its death.
    for s in streams[1::2]:
        assert (s.error is None and len(s.tokens) == total) or (
            isinstance(s.error, RequestError) and s.error.status == 500 and "died" in s.error.message), s.error
    assert any(s.error is not None for s in streams[1::2])
    # Rank 0's streams were frozen and continue on the new weights: their tokens before the
    # switch are A's, every token after it is what B samples for that prefix.
    survivors = streams[0::2]
    assert all(s.error is None and len(s.tokens) == total for s in survivors)
    a_engine, b_engine = make_engine(models[0]), make_engine(models[1])
    boundaries = []  # tokens sampled by A; a stream that finished before the pause is all A
    for i, s in enumerate(survivors):
        spans = s.deltas[-1].weight_versions
        versions = [v for v, _, _ in spans]
        assert versions in (["A"], ["A", "v-after-loss"], ["v-after-loss"]), spans
        boundaries.append(spans[0][2] if versions[0] == "A" else 0)
    a_ref = a_engine.generate([request(f"a{i}", s.prompt, max_tokens=b, ignore_eos=True)
                               for i, (s, b) in enumerate(zip(survivors, boundaries)) if b])
    b_ref = b_engine.generate([request(f"b{i}", s.prompt + s.tokens[:b], max_tokens=total - b, ignore_eos=True)
                               for i, (s, b) in enumerate(zip(survivors, boundaries)) if b < total])
    for i, (s, b) in enumerate(zip(survivors, boundaries)):
        if b:
            assert s.tokens[:b] == a_ref[f"a{i}"][0].token_ids
        if b < total:
            assert s.tokens[b:] == b_ref[f"b{i}"][0].token_ids
    assert any(0 < b < total for b in boundaries), "no stream was frozen across the update"
    # Both ranks serve the new weights.
    assert served_by_each_rank(client) == {0: references["B"], 1: references["B"]}


def test_rank_killed_between_start_and_finish(pool, models, references):
    """The death lands on a bucket (staged: the pool is not paused): the bucket still counts
    for the survivors, finish commits there and the replacement is replayed."""
    procs, broker, http, client = pool
    client.control("update_weight_version", {"new_version": "A"})
    client.control("start_weight_update")
    victim = next(p for p in procs.procs if p.name == "worker1" and p.alive())
    victim.kill9()
    reply = client.control("update_weights", {"update_info": {"path": str(models[1])}})
    assert reply.result == {"lost_ranks": [1]} and [r.rank for r in reply.ranks] == [0]
    assert generate(client, PROMPTS[0], 0)[0] == references["A"][0]  # staged until finish
    r = http.post("/finish_weight_update", json={"weight_version": "v-b"})
    assert r.status_code == 200 and r.json() == {"message": "Weight update finished", "committed": True,
                                                 "weight_version": "v-b", "lost_ranks": [1],
                                                 "reproducible_from_disk": True}
    procs.worker(broker, 1, "--model", str(models[0]), *WORKER_ARGS)
    wait_for(lambda: [(r["rank"], r["weight_version"], r["stale"]) for r in client.weight_info()["ranks"]] ==
             [(0, "v-b", False), (1, "v-b", False)], 180, "rank 1 replayed to v-b")
    assert served_by_each_rank(client) == {0: references["B"], 1: references["B"]}


@pytest.mark.parametrize("paused", [False, True])
def test_a_refused_bucket_aborts_the_update_on_every_rank(pool, models, references, paused):
    """Rank 1 refuses a bucket, rank 0 took its bucket (staged, or written in place while
    paused): finish commits nowhere, rank 0 is back on A, the pool's version unchanged."""
    _, _, http, client = pool
    client.control("update_weight_version", {"new_version": "A"})
    sd_a = _state_dict(models[0])
    if paused:
        client.pause("keep")
    client.control("start_weight_update")
    client.control("update_weights", {"update_info": {"path": str(models[1])}}, rank=0)
    with pytest.raises(RequestError) as err:
        client.control("update_weights", {"update_info": {"path": "/nonexistent/ckpt"}}, rank=1)
    assert err.value.status == 400
    r = http.post("/finish_weight_update", json={"weight_version": "v-never"})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "rank 1" in message and "nothing was committed" in message
    info = client.weight_info()
    assert info["weight_version"] == "A"
    assert [(r["rank"], r["weight_version"], r["stale"]) for r in info["ranks"]] == [(0, "A", False), (1, "A", False)]
    baseline = {}
    for rank in (0, 1):
        baseline.update(weight_checksums(sd_a.items(), prefix=f"dp{rank}:pp0:pcp0:tp0:"))
    assert http.post("/weight_checker", json={"action": "compare", "baseline": baseline}).json() == {
        "match": True, "mismatches": []}
    if paused:
        client.resume()  # nothing is left open: resume is not refused
    assert served_by_each_rank(client) == {0: references["A"], 1: references["A"]}
    # Nothing stays open on any rank: a finish now has nothing to commit.
    with pytest.raises(RequestError) as err:
        client.control("finish_weight_update")
    assert err.value.status == 400 and "no weight update in progress" in err.value.message


def test_rank_killed_during_an_update_over_the_wire(pool, models, references):
    """Tensors over ZMQ cannot be replayed: the survivor still commits and the pool records
    the version (never a survivor on weights the pool does not know); the finish says the
    update is not reproducible, and rank 1's replacement is held out until it gets them."""
    procs, broker, http, client = pool
    sd_b = _state_dict(models[1])
    client.control("start_weight_update")
    for info, frames in tensor_frames.buckets(sd_b.items(), 50_000):
        client.control("update_weights", {"update_info": info}, payload=frames)
    victim = next(p for p in procs.procs if p.name == "worker1" and p.alive())
    victim.kill9()
    reply = client.control("finish_weight_update", {"weight_version": "v-wire-b"})
    assert reply.result == {"committed": True, "weight_version": "v-wire-b", "lost_ranks": [1],
                            "reproducible_from_disk": False}
    procs.worker(broker, 1, "--model", str(models[0]), *WORKER_ARGS)
    wait_for_workers(broker.frontend, 2, timeout=180)
    info = client.weight_info()
    assert info["weight_version"] == "v-wire-b" and not info["reproducible_from_disk"]
    assert [(r["rank"], r["weight_version"], r["stale"]) for r in info["ranks"]] == [(0, "v-wire-b", False),
                                                                                    (1, "default", True)]
    for i in range(3):  # only the rank on the pool's weights serves
        assert generate(client, PROMPTS[i], None)[0] == references["B"][i]
    client.update_weights(sd_b.items(), "v-wire-b", rank=1)  # the trainer brings rank 1 current
    assert [r["stale"] for r in client.weight_info()["ranks"]] == [False, False]
    assert served_by_each_rank(client) == {0: references["B"], 1: references["B"]}


def test_a_start_refused_on_one_rank_is_dropped_on_the_others(pool, references):
    """An update session left open on rank 0 would make it stage what rank 1 writes at once."""
    _, _, http, client = pool
    assert http.post("/sleep", params={"level": 2, "rank": 1}).status_code == 200  # weights released
    r = http.post("/start_weight_update")
    assert r.status_code == 400 and "rank 1" in r.json()["error"]["message"], r.text
    r = http.post("/finish_weight_update", params={"rank": 0})
    assert r.status_code == 400 and "no weight update in progress" in r.json()["error"]["message"], r.text
    assert http.post("/wake_up").json() == {"status": "awake", "tags": None}
    assert served_by_each_rank(client) == {0: references["A"], 1: references["A"]}


def test_an_abort_that_cannot_undo_in_place_writes_holds_the_rank_out(pool, models, references):
    """The weights came over the wire before the update: rank 0's in-place writes cannot be
    rebuilt from disk, so after the abort it is labelled apart and held out, never served."""
    _, _, http, client = pool
    sd_a = _state_dict(models[0])
    client.update_weights(sd_a.items(), "A-wire")  # A again, but over the wire: not reproducible
    client.pause("keep")
    client.control("start_weight_update")
    client.control("update_weights", {"update_info": {"path": str(models[1])}}, rank=0)  # in place
    with pytest.raises(RequestError):
        client.control("update_weights", {"update_info": {"path": "/nonexistent/ckpt"}}, rank=1)
    r = http.post("/finish_weight_update", json={"weight_version": "v-never"})
    assert r.status_code == 400 and "nothing was committed" in r.json()["error"]["message"], r.text
    info = client.weight_info()
    assert info["weight_version"] == "A-wire"
    assert [(r["rank"], r["weight_version"], r["stale"]) for r in info["ranks"]] == [
        (0, "A-wire+partial-update", True), (1, "A-wire", False)]
    client.resume()
    for i in range(3):  # only rank 1 serves
        assert generate(client, PROMPTS[i], None)[0] == references["A"][i]
    client.update_weights(sd_a.items(), "A-wire", rank=0)  # the trainer repairs rank 0
    assert [r["stale"] for r in client.weight_info()["ranks"]] == [False, False]
    assert served_by_each_rank(client) == {0: references["A"], 1: references["A"]}


def test_update_weights_without_start_is_all_or_nothing(pool, models, references):
    """A lone /update_weights (written at once, as vLLM) that one rank refuses leaves every
    rank on the old weights; accepted, it reaches every rank."""
    _, _, http, client = pool
    client.control("update_weight_version", {"new_version": "A"})
    assert http.post("/sleep", params={"level": 2, "rank": 1}).status_code == 200  # rank 1 cannot take weights
    r = http.post("/update_weights", json={"update_info": {"path": str(models[1])}})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "rank 1" in message and "nothing was committed" in message
    assert http.post("/wake_up").json() == {"status": "awake", "tags": None}
    assert served_by_each_rank(client) == {0: references["A"], 1: references["A"]}
    assert http.post("/update_weights", json={"update_info": {"path": str(models[1])}}).json() == {
        "message": "Weights updated"}
    assert served_by_each_rank(client) == {0: references["B"], 1: references["B"]}
    info = client.weight_info()
    assert info["weight_version"] == "A" and info["reproducible_from_disk"]  # no new label, as vLLM
