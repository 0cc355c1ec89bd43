"""The direct ZeroMQ client against a scripted in-process broker (a bare ROUTER)
and against an absent one."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from common import framing
from common.client import AsyncClient, Client, RequestError
from common.protocol import (MAGIC, Abort, ClusterInfo, CompletionDelta, ErrorMsg, GenerateRequest, MsgType,
                             Outputs, WorkerLoad, WorkerStatus)
from tests.support.procs import free_endpoint

pytestmark = pytest.mark.timeout(30)


def req(rid: str, n: int = 1) -> GenerateRequest:
    from common.protocol import SamplingParams
    return GenerateRequest(request_id=rid, prompt_token_ids=[1], params=SamplingParams(n=n))


class ScriptedBroker(threading.Thread):
    """A ROUTER that answers each message with ``script(frames) -> list of frame lists``."""

    def __init__(self, script):
        super().__init__(daemon=True)
        self.endpoint = free_endpoint()
        self.script = script
        self.received: list[tuple[bytes, list]] = []
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.endpoint)
        self._halt = threading.Event()

    def run(self):
        while not self._halt.is_set():
            if not self.sock.poll(20):
                continue
            identity, *frames = self.sock.recv_multipart()
            self.received.append((frames[1], frames))
            for reply in self.script(frames):
                self.sock.send_multipart([identity, *reply])

    def types(self):
        return [t for t, _ in self.received if t != MsgType.HEARTBEAT]

    def close(self):
        self._halt.set()
        self.join(2)
        self.sock.close(0)


@pytest.fixture
def scripted():
    brokers = []

    def make(script):
        b = ScriptedBroker(script)
        b.start()
        brokers.append(b)
        return b

    yield make
    for b in brokers:
        b.close()


def _outputs(*deltas):
    return framing.message(MsgType.OUTPUTS, Outputs(list(deltas)))


def test_deltas_of_all_choices_then_end_despite_garbage(scripted):
    def script(frames):
        if frames[1] != MsgType.GENERATE:
            return []
        rid = framing.decode(frames[2], GenerateRequest).request_id
        return [[b"garbage"], [MAGIC, b"\x55", b""], [MAGIC, MsgType.OUTPUTS, b"\x01\x02"],
                _outputs(CompletionDelta(rid, 0, [5]), CompletionDelta(rid, 1, [6]),
                         CompletionDelta("someone-else", 0, [9])),
                _outputs(CompletionDelta(rid, 1, [7], finish_reason="length")),
                _outputs(CompletionDelta(rid, 0, [8], finish_reason="stop", stop_reason=8))]

    broker = scripted(script)
    with Client(broker.endpoint) as client:
        deltas = list(client.generate(req("a", n=2)))
    assert [(d.index, d.token_ids, d.finish_reason) for d in deltas] == [
        (0, [5], None), (1, [6], None), (1, [7], "length"), (0, [8], "stop")]


def test_error_message_becomes_request_error(scripted):
    def script(frames):
        if frames[1] != MsgType.GENERATE:
            return []
        rid = framing.decode(frames[2], GenerateRequest).request_id
        return [framing.message(MsgType.ERROR, ErrorMsg(rid, 400, "Token id 9 is out of vocabulary",
                                                        param="token_ids"))]

    broker = scripted(script)
    with Client(broker.endpoint) as client:
        with pytest.raises(RequestError) as exc:
            list(client.generate(req("e")))
    err = exc.value
    assert (err.status, err.type, err.param, err.request_id) == (400, "BadRequestError", "token_ids", "e")
    assert err.to_json()["error"]["code"] == 400


def test_aclose_sends_abort_and_duplicate_id_is_rejected(scripted):
    def script(frames):
        if frames[1] == MsgType.GENERATE:
            rid = framing.decode(frames[2], GenerateRequest).request_id
            return [_outputs(CompletionDelta(rid, 0, [1]))]
        return []

    broker = scripted(script)

    async def run():
        async with AsyncClient(broker.endpoint) as client:
            gen = client.generate(req("x"))
            assert (await gen.__anext__()).token_ids == [1]
            with pytest.raises(RequestError) as exc:
                await client.generate(req("x")).__anext__()
            assert exc.value.status == 400
            await gen.aclose()
            assert client.in_flight == 0
            await client.abort(["y", "z"])
            await asyncio.sleep(0.2)

    asyncio.run(run())
    aborts = [framing.decode(f[2], Abort).request_ids for t, f in broker.received if t == MsgType.ABORT]
    assert aborts == [["x"], ["y", "z"]]


def test_info_round_trip_and_timeout(scripted):
    info = ClusterInfo(workers=[WorkerStatus(3, WorkerLoad(running=2))])

    def script(frames):
        if frames[1] == MsgType.INFO:
            return [framing.message(MsgType.INFO, info, frames[2])]
        return []

    broker = scripted(script)
    with Client(broker.endpoint) as client:
        assert client.info() == info
    mute = scripted(lambda frames: [])
    with Client(mute.endpoint) as client:
        t0 = time.monotonic()
        with pytest.raises(RequestError) as exc:
            client.info(timeout=0.3)
        assert exc.value.status == 503 and time.monotonic() - t0 < 2


def test_unreachable_broker_fails_fast():
    async def run():
        async with AsyncClient(free_endpoint(), heartbeat_interval=0.2) as client:
            t0 = time.monotonic()
            with pytest.raises(RequestError) as exc:
                async for _ in client.generate(req("nobody")):
                    pass
            assert exc.value.status == 503 and "unreachable" in exc.value.message
            assert time.monotonic() - t0 < 1.5
            with pytest.raises(RequestError):
                await client.info(timeout=0.3)

    asyncio.run(run())


def test_every_request_to_an_absent_broker_fails_fast():
    """A request made while nobody listens fails within about one heartbeat interval, the tenth
    as fast as the first.  It once hung until the silence bound (60 s): a heartbeat sent while a
    request waited for the connection stayed queued in pyzmq, and every later non-blocking send
    then reported success without a connection (the CI failure of the broker-restart test)."""
    async def run():
        async with AsyncClient(free_endpoint(), heartbeat_interval=0.1) as client:
            assert client.expiry >= 60  # the silence bound is not what fails them
            for i in range(10):
                t0 = time.monotonic()
                with pytest.raises(RequestError) as exc:
                    async for _ in client.generate(req(f"nobody-{i}")):
                        pass
                assert exc.value.status == 503 and "unreachable" in exc.value.message
                assert time.monotonic() - t0 < 2, i
                await asyncio.sleep(0.05)  # let heartbeats fire between requests, too

    asyncio.run(run())


def test_silent_broker_fails_in_flight_requests(scripted):
    broker = scripted(lambda frames: [])  # accepts the connection, never answers (no heartbeats)

    async def run():
        # The link stays up (libzmq answers its heartbeats): only the broker's silence tells.
        async with AsyncClient(broker.endpoint, heartbeat_interval=0.2, liveness=3,
                               unresponsive_timeout=0.6) as client:
            t0 = time.monotonic()
            with pytest.raises(RequestError) as exc:
                async for _ in client.generate(req("stuck")):
                    pass
            assert exc.value.status == 503 and "lost connection" in exc.value.message
            assert time.monotonic() - t0 < 2

    asyncio.run(run())


def test_sync_client_is_thread_safe(scripted):
    def script(frames):
        if frames[1] != MsgType.GENERATE:
            return []
        rid = framing.decode(frames[2], GenerateRequest).request_id
        return [_outputs(CompletionDelta(rid, 0, [k])) for k in range(5)] + [
            _outputs(CompletionDelta(rid, 0, [5], finish_reason="length"))]

    broker = scripted(script)
    results = {}
    with Client(broker.endpoint) as client:
        threads = [threading.Thread(target=lambda i=i: results.update(
            {i: [t for d in client.generate(req(f"t{i}")) for t in d.token_ids]})) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    assert results == {i: list(range(6)) for i in range(8)}
