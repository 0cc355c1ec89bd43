"""Malformed and oversized ZeroMQ traffic sent straight to the broker (frontend and
backend sockets) and to a real worker's socket; every process must drop and log it,
stay alive and keep serving.

test_broker.py covers a fixed list of garbage against fake workers; here hypothesis
generates the frames (random bytes, right magic with wrong types or frame counts,
msgpack bodies of the wrong shape, well-shaped GenerateRequests with wild values that
skip the gateway's validation), and the workers are real engines (tiny Llama).
"""
from __future__ import annotations

import os
import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common import framing
from common.client import Client, RequestError
from common.protocol import MAGIC, GenerateRequest, MsgType, Outputs, SamplingParams
from tests.support.procs import ProcGroup, free_endpoint, wait_for, wait_for_workers

pytestmark = pytest.mark.timeout(240)

VOCAB = 320
FRAME_CAP = 4 << 20  # broker --max-frame-bytes for clients


def _worker_args(llama_dir, heartbeat: float) -> list[str]:
    return ["--model", str(llama_dir), "--max-model-len", "64", "--max-num-seqs", "16", "--num-kv-blocks", "64",
            "--threads", "1", "--heartbeat-interval", str(heartbeat)]


class FakeBroker:
    """A ROUTER the test binds for one real worker to connect to: the test plays the broker."""

    def __init__(self):
        self.endpoint = free_endpoint()
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.endpoint)
        self.worker: bytes = b""

    def recv(self, timeout: float = 5.0):
        if not self.sock.poll(int(timeout * 1000)):
            return None
        return self.sock.recv_multipart()

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            frames = self.recv(1)
            if frames and frames[2] == MsgType.READY:
                self.worker = frames[0]
                self.beat()
                return
        raise TimeoutError("worker never sent READY")

    def send(self, *frames) -> None:
        self.sock.send_multipart([self.worker, *frames])

    def beat(self) -> None:
        self.send(MAGIC, MsgType.HEARTBEAT, b"")

    def generate(self, request: GenerateRequest, client: bytes = b"client-1", timeout: float = 20) -> list:
        """Send a GENERATE like the broker does; return its deltas once it finished (answering READY anew)."""
        self.send(MAGIC, MsgType.GENERATE, framing.encode(request), client)
        deltas, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            frames = self.recv(0.3)
            self.beat()
            if frames is None:
                continue
            kind = frames[2]
            if kind == MsgType.OUTPUTS:
                header = framing.decode(frames[3], framing.OutputsHeader)
                for i in range(4, len(frames), 2):
                    assert frames[i] == client
                    deltas += framing.decode(frames[i + 1], Outputs).deltas
                if request.request_id in header.finished:
                    return deltas
            elif kind == MsgType.ERROR:
                return [framing.decode(frames[3], framing.ErrorMsg)]
            elif kind == MsgType.READY:  # re-registered (should not happen): keep going
                self.worker = frames[0]
        raise TimeoutError(f"no end for {request.request_id}")

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, llama_dir):
    with ProcGroup(tmp_path_factory.mktemp("fuzz-zmq")) as procs:
        broker = procs.broker("--max-frame-bytes", str(FRAME_CAP))
        worker = procs.worker(broker, 0, *_worker_args(llama_dir, 1.0))
        fake = FakeBroker()
        # Slow heartbeats: the test is the broker here and only beats when it sends something.
        lone = procs.worker(fake.endpoint, 0, *_worker_args(llama_dir, 30.0))
        try:
            wait_for_workers(broker.frontend, 1, timeout=120)
            fake.wait_ready()
            with Client(broker.frontend) as client:
                yield dict(broker=broker, worker=worker, client=client, fake=fake, lone=lone, procs=procs)
        finally:
            fake.close()


# ----------------------------------------------------------------------------- strategies
ints64 = st.integers(-2 ** 63, 2 ** 63 - 1)
wild_ints = st.one_of(st.integers(-3, 400), st.sampled_from([2 ** 31, 2 ** 63 - 1, -2 ** 63]), ints64)
wild_floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -1.0, 1e-9, 3.0, 1e300])
msgpack_values = st.recursive(st.none() | st.booleans() | wild_ints | wild_floats | st.text(max_size=10) |
                              st.binary(max_size=10),
                              lambda inner: st.lists(inner, max_size=5) |
                              st.dictionaries(st.text(max_size=5), inner, max_size=4), max_leaves=15)
bodies = st.one_of(st.binary(max_size=64), msgpack_values.map(msgspec.msgpack.encode))
types = st.sampled_from([MsgType.GENERATE, MsgType.ABORT, MsgType.OUTPUTS, MsgType.ERROR, MsgType.READY,
                         MsgType.HEARTBEAT, MsgType.DISCONNECT, MsgType.INFO, b"\x00", b"\xff", b"", b"\x01\x01"])
magics = st.sampled_from([MAGIC, MAGIC, MAGIC, b"", b"TM2", b"TM1\x00"]) | st.binary(max_size=4)
frame_lists = st.one_of(
    st.lists(st.binary(max_size=32), min_size=1, max_size=5),
    st.tuples(magics, types, st.lists(bodies, max_size=4)).map(lambda t: [t[0], t[1], *t[2]]),
)

wild_params = st.builds(
    SamplingParams, n=wild_ints, temperature=wild_floats, top_p=wild_floats, top_k=wild_ints, min_p=wild_floats,
    seed=st.none() | ints64, presence_penalty=wild_floats, frequency_penalty=wild_floats,
    repetition_penalty=wild_floats, stop=st.none() | st.lists(st.text(max_size=5), max_size=3),
    stop_token_ids=st.none() | st.lists(wild_ints, max_size=3), ignore_eos=st.booleans(),
    max_tokens=st.none() | wild_ints, max_tokens_is_default=st.booleans(), min_tokens=wild_ints,
    logprobs=st.none() | wild_ints, prompt_logprobs=st.none() | wild_ints,
    prompt_logprob_token_ids=st.none() | st.lists(st.lists(wild_ints, max_size=3), max_size=3),
    detokenize=st.booleans(), skip_special_tokens=st.booleans(), include_stop_str_in_output=st.booleans(),
    logit_bias=st.none() | st.dictionaries(wild_ints, wild_floats, max_size=3),
    allowed_token_ids=st.none() | st.lists(wild_ints, max_size=4),
    bad_words=st.none() | st.lists(st.text(max_size=6), max_size=3))
_rid = iter(range(10 ** 9))
wild_requests = st.builds(
    lambda params, prompt, **kw: GenerateRequest(request_id=f"wild-{next(_rid)}", prompt_token_ids=prompt,
                                                 params=params, **kw),
    params=wild_params, prompt=st.lists(wild_ints, max_size=8), priority=wild_ints,
    cache_salt=st.none() | st.text(max_size=8), output_text=st.booleans(),
    session_id=st.none() | st.text(max_size=8))


def fuzz(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                    derandomize=True)


_calls: dict = {}


def _every(period: int, check) -> None:
    """Run ``check`` on every ``period``-th example of the calling test: a process that
    still runs but stopped serving is caught while the fuzzing goes on."""
    key = check.__code__.co_firstlineno
    n = _calls[key] = _calls.get(key, 0) + 1
    if n % period == 0:
        check(n)


def _serves(client: Client, rid: str) -> None:
    req = GenerateRequest(request_id=rid, prompt_token_ids=[1, 2, 3],
                          params=SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    deltas = list(client.generate(req))
    assert sum(len(d.token_ids) for d in deltas) == 3 and deltas[-1].finish_reason == "length"


# ----------------------------------------------------------------------------- broker
@fuzz(300)
@given(frames=frame_lists, side=st.sampled_from(["frontend", "backend"]))
def test_random_frames_to_broker_sockets(cluster, frames, side):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 200)
    sock.connect(cluster["broker"].frontend if side == "frontend" else cluster["broker"].backend)
    sock.send_multipart(frames)
    sock.close()
    broker = cluster["broker"]
    assert broker.alive(), broker.tail()
    _every(100, lambda n: _serves(cluster["client"], f"during-random-frames-{n}"))


def test_broker_alive_logged_and_serving_after_random_frames(cluster):
    broker = cluster["broker"]
    assert broker.alive(), broker.tail()
    wait_for(lambda: "dropped malformed message on frontend" in broker.log_path.read_text(), 5, "frontend log")
    wait_for(lambda: "dropped malformed message on backend" in broker.log_path.read_text(), 5, "backend log")
    _serves(cluster["client"], "after-random-frames")


def test_oversized_frames_to_broker(cluster):
    ctx = zmq.Context.instance()
    for endpoint, size in ((cluster["broker"].frontend, FRAME_CAP + 1),  # over the cap: peer disconnected
                           (cluster["broker"].backend, 16 << 20)):  # under the workers' 1 GiB cap: dropped
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(endpoint)
        sock.send_multipart([MAGIC, MsgType.GENERATE, os.urandom(size)])
        sock.close()
    time.sleep(0.5)
    assert cluster["broker"].alive()
    _serves(cluster["client"], "after-oversized")


@fuzz(120)
@given(request=wild_requests)
def test_wild_generate_requests_from_a_direct_client(cluster, request):
    """The gateway's validation is skipped: the worker's engine must refuse bad input with a 4xx."""
    try:
        deltas = list(cluster["client"].generate(request))
    except RequestError as exc:
        assert 400 <= exc.status < 500, exc
    else:
        assert deltas and deltas[-1].finish_reason is not None
    assert cluster["worker"].alive(), cluster["worker"].tail()
    _every(40, lambda n: _serves(cluster["client"], f"during-wild-requests-{n}"))


def test_worker_alive_and_serving_after_wild_requests(cluster):
    assert cluster["worker"].alive(), cluster["worker"].tail()
    _serves(cluster["client"], "after-wild-requests")
    assert len(cluster["client"].info().workers) == 1


# ----------------------------------------------------------------------------- worker socket
def test_malformed_and_oversized_frames_to_a_worker_socket(cluster):
    fake, lone = cluster["fake"], cluster["lone"]
    good = framing.encode(GenerateRequest(request_id="x", prompt_token_ids=[1]))
    for frames in ([MAGIC, MsgType.GENERATE, good],  # no client identity frame
                   [MAGIC, MsgType.GENERATE, os.urandom(40), b"client"],
                   [MAGIC, MsgType.GENERATE, good, b"client", b"extra"],
                   [MAGIC, MsgType.ABORT, b"\xc1"],
                   [MAGIC, MsgType.ABORT],
                   [MAGIC, MsgType.OUTPUTS, b""],
                   [MAGIC, b"\x99", b""],
                   [b"nope", MsgType.GENERATE, good, b"client"],
                   [MAGIC, MsgType.GENERATE, os.urandom(32 << 20), b"client"]):
        fake.send(*frames)
    fake.beat()
    # Runs before the random frames below: the worker's rate-limited log still has room.
    wait_for(lambda: "dropped malformed message" in lone.log_path.read_text(), 5, "worker log")
    wait_for(lambda: "undecodable GENERATE body" in lone.log_path.read_text(), 5, "worker log")
    _worker_serves(fake, lone, "after-garbage")


def _worker_serves(fake: FakeBroker, lone, rid: str) -> None:
    assert lone.alive(), lone.tail()
    request = GenerateRequest(request_id=rid, prompt_token_ids=[1, 2, 3],
                              params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    deltas = fake.generate(request)
    assert sum(len(d.token_ids) for d in deltas) == 4, deltas
    assert lone.alive(), lone.tail()


@fuzz(200)
@given(frames=frame_lists)
def test_random_frames_to_a_worker_socket(cluster, frames):
    fake, lone = cluster["fake"], cluster["lone"]
    fake.send(*frames)
    fake.beat()
    assert lone.alive(), lone.tail()
    _every(100, lambda n: _worker_serves(fake, lone, f"during-random-frames-{n}"))


def test_worker_alive_and_serving_after_random_frames(cluster):
    _worker_serves(cluster["fake"], cluster["lone"], "after-random-frames")
