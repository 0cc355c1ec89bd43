"""Security of the ZeroMQ side (issue 33): who may register as a worker, whose outputs
reach a client, who may send CONTROL commands, where the broker may listen.

Everything runs through real processes and sockets: a broker, fake or real workers,
and rogue peers played by the test with raw DEALER sockets.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path

import httpx
import pytest
import zmq

from common import framing, runtime_dir, security
from common.client import AsyncClient, Client, RequestError
from common.protocol import (MAGIC, Abort, CompletionDelta, ErrorMsg, GenerateRequest, ModelInfo, MsgType, Outputs,
                             OutputsHeader, SamplingParams, WorkerLoad, WorkerReady)
from tests.support.gateway_helpers import metric_value, start_gateway
from tests.support.procs import ProcGroup, cluster_info, free_endpoint, scaled, wait_for, wait_for_workers

pytestmark = pytest.mark.timeout(180)

FAKE_MODEL = ModelInfo(name="fake-model", vocab_size=1_000_000, max_model_len=4096, max_num_seqs=64,
                       eos_token_ids=[2], has_tokenizer=False)
FORGED_TOKEN = 424242


def _req(rid: str, max_tokens: int = 4, rank=None, prompt=(1, 2, 3)) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=list(prompt), data_parallel_rank=rank,
                           params=SamplingParams(max_tokens=max_tokens, temperature=0.0))


@pytest.fixture
def private_dir():
    """A fresh runtime directory with a short path (Unix socket paths must fit 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="tsrt-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _stats(frontend: str):
    info = cluster_info(frontend, 1.0)
    return None if info is None else info.stats


class RawWorker:
    """A process-local peer on the broker's backend that speaks the worker protocol by hand."""

    def __init__(self, backend: str, rank: int, token: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(backend)
        self.rank, self.token = rank, token
        self.received: list[list[bytes]] = []
        self.ready()

    def ready(self) -> None:
        msg = WorkerReady(self.rank, FAKE_MODEL, WorkerLoad(max_num_seqs=64), pid=os.getpid(), worker_token=self.token)
        self.sock.send_multipart(framing.message(MsgType.READY, msg))

    def pump(self, timeout: float = 0.05) -> None:
        """Heartbeat, keep what the broker sent; re-register when it says DISCONNECT (as a worker does)."""
        self.sock.send_multipart(framing.message(MsgType.HEARTBEAT, WorkerLoad(max_num_seqs=64)))
        while self.sock.poll(int(timeout * 1000)):
            frames = self.sock.recv_multipart()
            self.received.append(frames)
            if frames[1] == MsgType.DISCONNECT:
                self.ready()

    def types(self) -> set:
        return {f[1] for f in self.received}

    def send(self, *frames) -> None:
        self.sock.send_multipart([MAGIC, *frames])

    def close(self) -> None:
        self.sock.close(0)


# ----------------------------------------------------------------------------- worker impersonation
def test_worker_without_the_token_is_never_registered_nor_sent_prompts(tmp_path):
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker()
        procs.fake_worker(broker, 0)
        wait_for_workers(broker.frontend, 1)
        rogues = [RawWorker(broker.backend, 1, ""), RawWorker(broker.backend, 2, "x" * 43)]
        try:
            with Client(broker.frontend) as client:
                for i in range(6):  # served meanwhile: none may go to a rogue
                    deltas = list(client.generate(_req(f"r{i}")))
                    assert [d.token_ids[0] for d in deltas] == [0, 1, 2, 3]  # rank 0's tokens
                    for rogue in rogues:
                        rogue.pump()
                wait_for(lambda: _stats(broker.frontend).workers_refused >= 2, 10, "both READYs refused")
                for rogue in rogues:
                    rogue.pump()
                    assert MsgType.GENERATE not in rogue.types()
                    assert MsgType.DISCONNECT in rogue.types()  # told to go away, not welcomed
                assert [w.rank for w in client.info().workers] == [0]
        finally:
            for rogue in rogues:
                rogue.close()


def test_outputs_for_another_workers_request_are_dropped_and_counted(tmp_path):
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker()
        procs.fake_worker(broker, 0, "--step-delay", "0.05")
        wait_for_workers(broker.frontend, 1)
        # A registered worker (it knows the token) that turns on the others' users.
        rogue = RawWorker(broker.backend, 1, runtime_dir.read_token(runtime_dir.WORKER))
        try:
            wait_for(lambda: (rogue.pump(), len(cluster_info(broker.frontend).workers) == 2)[1], 10,
                     "the second worker registered")
            with Client(broker.frontend) as client:
                # The bait, dispatched to the rogue, tells it the client's routing identity.
                bait: dict = {}
                t = threading.Thread(target=lambda: bait.update(d=list(client.generate(_req("bait", 1, rank=1)))))
                t.start()

                def got_bait():
                    rogue.pump()
                    return next((f for f in rogue.received if f[1] == MsgType.GENERATE), None)

                frames = wait_for(got_bait, 10, "the bait request at the rogue")
                client_id = frames[3]
                rogue.send(MsgType.OUTPUTS, framing.encode(OutputsHeader(finished=["bait"])), client_id,
                           framing.encode(Outputs([CompletionDelta("bait", 0, [7], finish_reason="length")])))
                t.join(10)
                assert [d.token_ids for d in bait["d"]] == [[7]]  # its own request: relayed as always

                victim = client.generate(_req("victim", 40, rank=0))
                first = next(victim)
                forged = Outputs([CompletionDelta("victim", 0, [FORGED_TOKEN], finish_reason="stop")])
                rogue.send(MsgType.OUTPUTS, framing.encode(OutputsHeader(started=["victim"], finished=["victim"])),
                           client_id, framing.encode(forged))
                # One body mixing its own (finished) request with the victim's: dropped whole.
                rogue.send(MsgType.OUTPUTS, framing.encode(OutputsHeader()), client_id, framing.encode(
                    Outputs([CompletionDelta("bait", 0, [8]), CompletionDelta("victim", 0, [FORGED_TOKEN])])))
                rogue.send(MsgType.ERROR, framing.encode(ErrorMsg("victim", 500, "forged failure")), client_id)
                wait_for(lambda: (rogue.pump(), _stats(broker.frontend).outputs_foreign_dropped >= 3)[1], 10,
                         "the forged messages counted")
                rest = list(victim)
            tokens = [t for d in [first, *rest] for t in d.token_ids]
            assert tokens == list(range(40))  # rank 0's real output, all of it, nothing forged
            assert rest[-1].finish_reason == "length"
            gw = start_gateway(procs, broker.frontend)
            text = httpx.get(gw.url + "/metrics").text
            assert metric_value(text, "tokserve:broker_outputs_foreign_dropped_total") >= 3
        finally:
            rogue.close()


def test_a_client_cannot_abort_another_clients_request(tmp_path):
    """ABORT is open to every peer, so it only reaches the sender's own requests (the
    cross-client abort is the control op, behind the token)."""
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker()
        procs.fake_worker(broker, 0, "--step-delay", "0.02")
        wait_for_workers(broker.frontend, 1)
        with Client(broker.frontend) as victim_client:
            stream = victim_client.generate(_req("theirs", 30))
            first = next(stream)
            other = zmq.Context.instance().socket(zmq.DEALER)
            other.setsockopt(zmq.LINGER, 0)
            try:
                other.connect(broker.frontend)
                other.send_multipart(framing.message(MsgType.ABORT, Abort(["theirs"])))
                # The broker handles one peer's messages in order: the INFO answer means the ABORT was handled.
                other.send_multipart(framing.message(MsgType.INFO, framing.nonce_bytes(1)))
                assert other.poll(10_000)
            finally:
                other.close(0)
            rest = list(stream)
        assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 30
        assert rest[-1].finish_reason == "length"


def test_only_a_gateway_with_control_routes_reads_the_control_token():
    from gateway.app import make_client
    from gateway.settings import GatewaySettings

    token = runtime_dir.load_or_create_token(runtime_dir.CONTROL)
    assert make_client(GatewaySettings())._token() == ""  # never even reads the file
    assert make_client(GatewaySettings(enable_rl=True))._token() == token
    assert make_client(GatewaySettings(allow_runtime_lora=True))._token() == token


# ----------------------------------------------------------------------------- control plane
@pytest.fixture(scope="module")
def control_stack(tmp_path_factory, llama_dir):
    from tests.support.lora_factory import ATTENTION, build_adapter

    root = tmp_path_factory.mktemp("control")
    adapter = build_adapter(llama_dir, root / "adapter", ATTENTION, rank=8)
    with ProcGroup(root / "logs") as procs:
        broker = procs.broker()
        procs.worker(broker, 0, "--model", str(llama_dir), "--max-model-len", "64", "--num-kv-blocks", "64",
                     "--max-num-seqs", "4", "--threads", "1", "--enable-lora", "--max-lora-rank", "8")
        wait_for_workers(broker.frontend, 1, timeout=120)
        with Client(broker.frontend) as trainer:  # reads the control token from the runtime directory
            yield broker, trainer, adapter, llama_dir


def _refused(call) -> RequestError:
    with pytest.raises(RequestError) as exc:
        call()
    assert exc.value.status == 401 and exc.value.type == "Unauthorized", exc.value
    assert "control token" in exc.value.message
    return exc.value


def test_control_without_the_token_is_refused_and_changes_nothing(control_stack):
    broker, trainer, adapter, model_dir = control_stack
    checksums = trainer.weight_checksums()
    greedy = [d.token_ids for d in trainer.generate(_req("before", 6))]
    refused_before = _stats(broker.frontend).control_refused
    for kwargs in ({"read_control_token": False}, {"control_token": "x" * 43}):
        with Client(broker.frontend, **kwargs) as intruder:
            _refused(lambda: intruder.pause())
            _refused(lambda: intruder.control("weight_checker", {"action": "reset"}))
            _refused(lambda: intruder.load_lora("evil", str(adapter)))
            _refused(lambda: intruder.update_weights_from_disk(str(model_dir)))
            _refused(lambda: intruder.is_paused())
            _refused(lambda: intruder.abort_all())
            # Generation stays open to any peer that can connect, and is unchanged.
            assert [d.token_ids for d in intruder.generate(_req("intruder", 6))] == greedy
    assert _stats(broker.frontend).control_refused == refused_before + 12
    info = cluster_info(broker.frontend)
    assert not info.paused and "evil" not in (info.lora_adapters or {})
    assert trainer.is_paused() is False
    assert trainer.weight_checksums() == checksums
    assert [d.token_ids for d in trainer.generate(_req("after", 6))] == greedy


def test_control_with_the_token_works(control_stack):
    broker, trainer, adapter, model_dir = control_stack
    checksums = trainer.weight_checksums()
    trainer.pause()
    try:
        assert trainer.is_paused() and cluster_info(broker.frontend).paused
    finally:
        trainer.resume()
    assert trainer.is_paused() is False
    trainer.load_lora("good", str(adapter))
    assert "good" in cluster_info(broker.frontend).lora_adapters
    trainer.control("weight_checker", {"action": "reset"})
    assert trainer.weight_checksums() != checksums
    trainer.update_weights_from_disk(str(model_dir))
    assert trainer.weight_checksums() == checksums


def test_a_raw_control_frame_without_token_is_refused(control_stack):
    """An older or hand-written client that sends no token field at all."""
    from common.protocol import ControlReply, ControlRequest

    broker, *_ = control_stack
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(broker.frontend)
        sock.send_multipart(framing.message(MsgType.CONTROL, ControlRequest(9, "pause", {"mode": "abort"})))
        assert sock.poll(10_000)
        reply = framing.decode(sock.recv_multipart()[2], ControlReply)
        assert (reply.nonce, reply.ok, reply.status, reply.error_type) == (9, False, 401, "Unauthorized")
    finally:
        sock.close(0)
    assert not cluster_info(broker.frontend).paused


# ----------------------------------------------------------------------------- where the broker listens
@pytest.mark.parametrize("flag,endpoint", [("--frontend", "tcp://0.0.0.0:{port}"), ("--backend", "tcp://*:{port}"),
                                           ("--frontend", "tcp://example.invalid:{port}")])
def test_non_loopback_bind_without_curve_refuses_to_start(tmp_path, flag, endpoint):
    port = free_endpoint().rsplit(":", 1)[1]
    with ProcGroup(tmp_path) as procs:
        kw = {"frontend": endpoint.format(port=port)} if flag == "--frontend" else \
            {"backend": endpoint.format(port=port)}
        broker = procs.broker(wait=False, **kw)
        assert broker.popen.wait(30) != 0
        assert "--curve-secret-file" in broker.log_path.read_text()


def test_non_loopback_bind_with_curve_starts(tmp_path):
    """The refusal is about plaintext: with CURVE (and only known peers) the broker listens on every interface."""
    keys = tmp_path / "keys"
    secret = security.generate(keys, "broker")[1]
    public = security.generate(keys, "peer")[0]
    (tmp_path / "authorized").mkdir()
    shutil.copy(public, tmp_path / "authorized")
    port = free_endpoint().rsplit(":", 1)[1]
    with ProcGroup(tmp_path / "logs") as procs:
        broker = procs.broker("--curve-secret-file", str(secret), "--curve-authorized-keys",
                              str(tmp_path / "authorized"), frontend=f"tcp://0.0.0.0:{port}", wait=False)
        wait_for(lambda: "broker frontend=tcp://0.0.0.0" in broker.log_path.read_text() or not broker.alive(), 30,
                 "the broker to listen")
        assert broker.alive(), broker.tail()


def test_is_local_endpoint_and_the_in_process_broker_refuses_too():
    local = ["ipc:///tmp/x.sock", "tcp://127.0.0.1:5", "tcp://127.8.9.1:5", "tcp://[::1]:5", "tcp://localhost:5"]
    remote = ["tcp://0.0.0.0:5", "tcp://*:5", "tcp://10.1.2.3:5", "tcp://[::]:5", "tcp://host.example:5",
              "tcp://eth0:5"]
    assert all(runtime_dir.is_local_endpoint(e) for e in local)
    assert not any(runtime_dir.is_local_endpoint(e) for e in remote)
    from broker.broker import Broker, BrokerConfig

    with pytest.raises(ValueError, match="--curve-secret-file"):  # embedding the broker is no way around it
        Broker(BrokerConfig(frontend="tcp://127.0.0.1:0", backend="tcp://0.0.0.0:0"))


def test_second_broker_on_a_live_ipc_socket_refuses_to_start(tmp_path, private_dir):
    env = {"TOKSERVE_RUNTIME_DIR": str(private_dir)}
    frontend, backend = f"ipc://{private_dir}/frontend.sock", f"ipc://{private_dir}/backend.sock"
    with ProcGroup(tmp_path) as procs:
        first = procs.broker(frontend=frontend, backend=backend, env=env)
        second = procs.broker(frontend=frontend, backend=backend, env=env, wait=False)
        assert second.popen.wait(30) != 0
        assert "already listening" in second.log_path.read_text()
        assert first.alive() and cluster_info(frontend) is not None  # its socket was not taken over


# ----------------------------------------------------------------------------- runtime directory
def test_runtime_dir_is_created_private_and_tokens_are_owner_only(monkeypatch, private_dir):
    target = private_dir / "nested" / "rt"
    monkeypatch.setenv("TOKSERVE_RUNTIME_DIR", str(target))
    monkeypatch.delenv("TOKSERVE_CONTROL_TOKEN_FILE", raising=False)
    assert runtime_dir.ensure() == target
    assert stat.S_IMODE(target.stat().st_mode) == 0o700
    token = runtime_dir.load_or_create_token(runtime_dir.CONTROL)
    assert len(token) >= 43 and runtime_dir.load_or_create_token(runtime_dir.CONTROL) == token
    assert runtime_dir.read_token(runtime_dir.CONTROL) == token
    assert stat.S_IMODE((target / "control.token").stat().st_mode) == 0o600
    assert sorted(p.name for p in target.iterdir()) == ["control.token"]  # no temporary file left behind
    (target / "control.token").chmod(0o644)
    with pytest.raises(runtime_dir.RuntimeDirError, match="chmod 600"):
        runtime_dir.read_token(runtime_dir.CONTROL)


@pytest.mark.parametrize("kind", ["world-writable", "group-readable", "symlink", "other-owner"])
def test_unsafe_runtime_dir_is_refused(tmp_path, private_dir, kind):
    unsafe = private_dir / "rt"
    if kind == "other-owner":
        if os.getuid() != 0:
            pytest.skip("giving a folder to another user needs root")
        unsafe.mkdir(mode=0o700)
        os.chown(unsafe, 65534, 65534)  # as pre-created by another user (nobody), with private permissions
    elif kind == "symlink":
        (private_dir / "elsewhere").mkdir(mode=0o700)
        unsafe.symlink_to(private_dir / "elsewhere")
    else:
        unsafe.mkdir()
        unsafe.chmod(0o777 if kind == "world-writable" else 0o750)  # as pre-created by another user
    env = {"TOKSERVE_RUNTIME_DIR": str(unsafe), "TOKSERVE_FRONTEND": "", "TOKSERVE_BACKEND": ""}
    with ProcGroup(tmp_path) as procs:
        broker = procs.spawn("broker", ["-m", "common.cli", "broker"], env=env)
        worker = procs.spawn("fake-worker", ["-m", "tests.support.fake_worker"], env=env)
        assert broker.popen.wait(30) != 0 and worker.popen.wait(30) != 0
        for proc in (broker, worker):
            log = proc.log_path.read_text()
            assert str(unsafe) in log and ("private" in log or "symlink" in log or "not to us" in log), log
    assert not (private_dir / "elsewhere" / "worker.token").exists()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKSERVE_RUNTIME_DIR", str(unsafe))
        for var in ("TOKSERVE_FRONTEND", "TOKSERVE_CONTROL_TOKEN_FILE"):
            mp.delenv(var, raising=False)
        with pytest.raises(runtime_dir.RuntimeDirError):
            asyncio.run(AsyncClient().start())  # a client refuses to connect to a socket planted there
        with pytest.raises(runtime_dir.RuntimeDirError):
            runtime_dir.read_token(runtime_dir.CONTROL)  # nor reads a token from there


def test_default_ipc_stack_serves_with_no_endpoint_or_token_given(tmp_path, private_dir, monkeypatch):
    monkeypatch.setenv("TOKSERVE_RUNTIME_DIR", str(private_dir))
    for var in ("TOKSERVE_FRONTEND", "TOKSERVE_BACKEND", "TOKSERVE_CONTROL_TOKEN_FILE", "TOKSERVE_WORKER_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    with ProcGroup(tmp_path) as procs:
        # Workers first, all at once: they race the broker to create the worker token, and
        # every one of them must end up with the same (atomically created) file.
        for rank in range(3):
            procs.spawn(f"fake-worker{rank}", ["-m", "tests.support.fake_worker", "--rank", str(rank)])
        procs.spawn("broker", ["-m", "common.cli", "broker"])
        with Client() as client:
            wait_for(lambda: _ranks(client) == [0, 1, 2], 60, "the workers over the default ipc sockets")
            assert [d.token_ids[0] for d in client.generate(_req("ipc", rank=2))] == [2000, 2001, 2002, 2003]
            client.pause()  # the control token was found in the runtime directory
            assert client.is_paused()
            client.resume()
    assert {p.name for p in private_dir.iterdir()} >= {"frontend.sock", "backend.sock", "control.token",
                                                        "worker.token"}


def _ranks(client: Client):
    try:
        return [w.rank for w in client.info(timeout=scaled(1.0)).workers]
    except RequestError:
        return None


# ----------------------------------------------------------------------------- multi-host
def test_tcp_with_curve_and_token_files(tmp_path):
    """The multi-host setup on one machine: each "host" has its own runtime directory, the
    broker listens on TCP with CURVE, and the token files are copied by hand."""
    keys, tokens = tmp_path / "keys", tmp_path / "tokens"
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    tokens.mkdir(mode=0o700)
    broker_secret = security.generate(keys, "broker")[1]
    certs = {}
    for name in ("worker", "trainer"):
        public, certs[name] = security.generate(keys, name)
        shutil.copy(public, authorized)
    server_key = security.load_keypair(broker_secret).public
    hosts = [Path(tempfile.mkdtemp(prefix="tsrt-")) for _ in range(3)]
    try:
        with ProcGroup(tmp_path / "logs") as procs:
            broker = procs.broker("--curve-secret-file", str(broker_secret), "--curve-authorized-keys",
                                  str(authorized), "--control-token-file", str(tokens / "control.token"),
                                  "--worker-token-file", str(tokens / "worker.token"), wait=False,
                                  env={"TOKSERVE_RUNTIME_DIR": str(hosts[0])})
            wait_for(lambda: (tokens / "worker.token").exists() and (tokens / "control.token").exists(), 30,
                     "the broker to create the token files")
            curve = ["--curve-server-key", server_key.decode(), "--curve-client-key-file", str(certs["worker"])]
            procs.fake_worker(broker, 0, *curve, "--worker-token-file", str(tokens / "worker.token"),
                              env={"TOKSERVE_RUNTIME_DIR": str(hosts[1])})
            # Authorized by CURVE, but with its own host's worker token: not the broker's.
            stranger = procs.fake_worker(broker, 1, *curve, env={"TOKSERVE_RUNTIME_DIR": str(hosts[2])})
            trainer_keys = security.load_keypair(certs["trainer"])
            with Client(broker.frontend, curve_server_key=server_key, curve_client_keys=trainer_keys,
                        control_token_file=str(tokens / "control.token")) as trainer, \
                    Client(broker.frontend, curve_server_key=server_key, curve_client_keys=trainer_keys,
                           read_control_token=False) as tokenless:
                wait_for(lambda: _ranks(trainer) == [0], 30, "the worker with the token file")
                wait_for(lambda: trainer.info().stats.workers_refused >= 1, 30, "the other worker refused")
                wait_for(lambda: "refused our registration" in stranger.log_path.read_text(), 30,
                         "the refused worker to say why")  # an operator sees it on the worker's side too
                assert _ranks(trainer) == [0]
                assert [d.token_ids[0] for d in trainer.generate(_req("curve"))] == [0, 1, 2, 3]
                assert [d.token_ids[0] for d in tokenless.generate(_req("curve2"))] == [0, 1, 2, 3]
                _refused(lambda: tokenless.pause())
                assert trainer.is_paused() is False
                trainer.pause()
                assert trainer.is_paused()
                trainer.resume()
            assert broker.alive()
    finally:
        for h in hosts:
            shutil.rmtree(h, ignore_errors=True)
