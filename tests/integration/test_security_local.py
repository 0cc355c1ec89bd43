"""Other users of the same machine (the attack: uid ``nobody`` next to a root-run stack).

ZeroMQ over TCP knows no peer uid, so a loopback port is open to every local user; the
broker's frontend and KV-event publisher therefore default to ipc:// in the 0700 runtime
directory and take TCP only when it authenticates peers (frontend: CURVE with authorized
keys) or when the operator opts into the open door by a named flag.  The attacker runs as
a forked child that drops to uid nobody (we run as root), so the kernel's own checks
decide, not a simulation of them.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from broker.kv_publisher import CellKvPublisher
from common import framing
from common.client import Client
from common.readiness import ReadyFile
from common.protocol import GenerateRequest, KvBlockTokens, KvEvents, MsgType, SamplingParams
from tests.support.procs import ProcGroup, cluster_info, free_port, wait_for

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to uid nobody needs root")


def as_nobody(fn) -> dict:
    """Run ``fn`` in a forked child as uid/gid nobody; its JSON-able result comes back.
    The child uses only modules already imported (nobody may not read our virtualenv)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = fn()
            out["uid"] = os.getuid()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, never raised in a fork
            out = {"error": repr(exc)}
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    result = json.loads(data)
    assert result.get("uid") == NOBODY, result
    return result


def _request(rid: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=[1, 2, 3],
                           params=SamplingParams(max_tokens=4, temperature=0.0))


def _intruder(frontend: str, wait_s: float = 3.0):
    """A plain DEALER, no credential: INFO and GENERATE, then count the answers."""

    def attack() -> dict:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(frontend)
            sock.send_multipart(framing.message(MsgType.INFO, framing.nonce_bytes(1)), zmq.NOBLOCK)
            sock.send_multipart(framing.message(MsgType.GENERATE, _request("nobody-req")), zmq.NOBLOCK)
        except zmq.Again:
            return {"answers": 0, "sent": False}
        answers = 0
        while sock.poll(int(wait_s * 1000)):  # bounded: an absence can only be shown within a deadline
            sock.recv_multipart()
            answers += 1
        sock.close(0)
        ctx.term()
        return {"answers": answers, "sent": True}

    return attack


@pytest.fixture
def private_dir():
    path = Path(tempfile.mkdtemp(prefix="tslo-"))  # short: Unix socket paths must fit 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# ------------------------------------------------------------------------------------ frontend
@pytest.mark.parametrize("curve", [False, True], ids=["plaintext", "curve-without-authorized-keys"])
def test_tcp_frontend_that_admits_anyone_refuses_to_start_and_leaves_nothing(tmp_path, private_dir, curve):
    runtime = private_dir / "rt"  # not there yet: a refused start must not create it or its tokens
    port = free_port()
    extra = []
    if curve:
        from common import security

        extra = ["--curve-secret-file", str(security.generate(tmp_path / "keys", "broker")[1])]
    with ProcGroup(tmp_path / "logs") as procs:
        broker = procs.spawn("broker", ["-m", "common.cli", "broker", "--frontend", f"tcp://127.0.0.1:{port}",
                                        *extra], env={"TOKSERVE_RUNTIME_DIR": str(runtime)})
        assert broker.popen.wait(30) != 0
        log = broker.log_path.read_text()
        assert "--allow-unauthenticated-tcp-frontend" in log and "--curve-authorized-keys" in log, log
    assert not runtime.exists()  # no tokens, no sockets
    assert not _listening(port)


@needs_root
def test_local_user_reaches_a_tcp_frontend_only_when_the_operator_opens_the_door(tmp_path, private_dir):
    """Default ipc frontend: uid nobody cannot even connect (0700 runtime directory) while
    Client() with no arguments is served.  The named flag is what opens TCP to nobody."""
    env = {"TOKSERVE_RUNTIME_DIR": str(private_dir), "TOKSERVE_FRONTEND": "", "TOKSERVE_BACKEND": ""}
    with ProcGroup(tmp_path / "logs") as procs, pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        for var in ("TOKSERVE_CONTROL_TOKEN_FILE", "TOKSERVE_WORKER_TOKEN_FILE"):
            mp.delenv(var, raising=False)
        procs.spawn("broker", ["-m", "common.cli", "broker"])
        procs.spawn("fake-worker", ["-m", "tests.support.fake_worker"])
        frontend = f"ipc://{private_dir}/frontend.sock"
        wait_for(lambda: getattr(cluster_info(frontend, 0.5), "workers", None), 60, "the default stack")
        before = cluster_info(frontend).stats.dispatched
        assert as_nobody(_intruder(frontend))["answers"] == 0
        with Client() as client:  # the user's own path: no endpoint, no token given
            assert len(list(client.generate(_request("mine")))) == 4
            client.pause()
            client.resume()
        assert cluster_info(frontend).stats.dispatched == before + 1  # ours only

        port = free_port()
        opened = procs.spawn("open-broker", ["-m", "common.cli", "broker", "--frontend", f"tcp://127.0.0.1:{port}",
                                             "--backend", f"ipc://{private_dir}/b2.sock",
                                             "--allow-unauthenticated-tcp-frontend"])
        wait_for(lambda: cluster_info(f"tcp://127.0.0.1:{port}", 0.5) is not None or not opened.alive(), 30,
                 "the opted-in broker")
        assert opened.alive(), opened.tail()
        seen = as_nobody(_intruder(f"tcp://127.0.0.1:{port}"))
        assert seen["answers"] >= 1  # exactly the open door the flag names: why it is not the default


# ---------------------------------------------------------------------------- KV-event publisher
def _subscriber(endpoint: str, wait_s: float):
    def subscribe() -> dict:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        tokens = []
        while sub.poll(int(wait_s * 1000)):
            _, _, payload = sub.recv_multipart()
            for event in msgspec.msgpack.decode(payload)[1]:
                tokens += event.get("token_ids", [])
        sub.close(0)
        ctx.term()
        return {"tokens": tokens}

    return subscribe


@needs_root
def test_kv_events_of_the_default_ipc_publisher_reach_only_the_same_user(private_dir):
    """The publisher re-announces every held block to each new subscriber (XPUB): a
    subscriber that connects gets the cell's cached prompt tokens.  Root (same user) does;
    uid nobody cannot connect to the socket in the 0700 directory."""
    ctx = zmq.Context.instance()
    pub = CellKvPublisher(ctx, f"ipc://{private_dir}/kv-events.sock")
    secret_prompt = [7, 7, 7, 7]
    pub.on_events(b"w0", KvEvents(stored=[b"secret-k"], tokens=[
        KvBlockTokens(b"secret-k", None, np.asarray(secret_prompt, dtype="<i4").tobytes())]), 4, 64)
    try:
        import threading

        stop = threading.Event()

        def serve():  # the broker's loop: hear subscriptions, pump re-announcements
            while not stop.is_set():
                if pub.sock.poll(20):
                    pub.on_subscriptions()
                while pub.replaying:
                    pub.pump()

        loop = threading.Thread(target=serve, daemon=True)
        loop.start()
        try:
            assert as_nobody(_subscriber(pub.endpoint, 2.0))["tokens"] == []
            mine = _subscriber(pub.endpoint, 2.0)()
            assert mine["tokens"] == secret_prompt  # the same path works for the router's user
        finally:
            stop.set()
            loop.join(5)
    finally:
        pub.close()


def test_broker_kv_events_default_is_the_private_runtime_directory_and_tcp_needs_its_flag(tmp_path, private_dir):
    env = {"TOKSERVE_RUNTIME_DIR": str(private_dir), "TOKSERVE_FRONTEND": "", "TOKSERVE_BACKEND": ""}
    with ProcGroup(tmp_path / "logs") as procs:
        refused = procs.spawn("tcp-kv", ["-m", "common.cli", "broker", "--kv-events-endpoint",
                                         f"tcp://127.0.0.1:{free_port()}"], env=env)
        assert refused.popen.wait(30) != 0
        assert "--kv-events-allow-tcp" in refused.log_path.read_text()
        assert not (private_dir / "control.token").exists()  # refused before anything was created
        procs.spawn("broker", ["-m", "common.cli", "broker", "--kv-events-endpoint"], env=env)
        info = wait_for(lambda: cluster_info(f"ipc://{private_dir}/frontend.sock", 0.5), 30, "the broker")
        assert info.kv_events_endpoint == f"ipc://{private_dir}/kv-events.sock"
        assert (private_dir / "kv-events.sock").exists()


# ------------------------------------------------------------------------------------ ready file
def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "root-owned.conf"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    return victim


@needs_root
def test_ready_file_in_a_folder_others_can_write_is_refused_so_a_planted_symlink_changes_nothing(
        tmp_path, private_dir):
    """uid nobody plants a symlink at the name the worker used to write through
    (``.NAME.<pid>.tmp``, predictable) in a shared sticky folder like /tmp: the worker
    refuses the folder instead of overwriting root's file."""
    shared = private_dir  # directly under /tmp: nobody can reach it once it is opened up
    shared.chmod(0o1777)
    victim = _victim(tmp_path)
    path = shared / "worker.ready"
    pid = os.getpid()

    def plant() -> dict:
        os.symlink(victim, shared / f".worker.ready.{pid}.tmp")
        return {}

    as_nobody(plant)
    with pytest.raises(ValueError, match="writable by other users"):
        ReadyFile(path, rank=0).mark()
    assert victim.read_text() == "precious\n" and not path.exists()


def test_ready_file_write_never_follows_a_link_and_refuses_a_symlinked_path(tmp_path):
    folder = tmp_path / "private"
    folder.mkdir(mode=0o700)
    victim = _victim(tmp_path)
    for name in (f".worker.ready.{os.getpid()}.tmp", ".worker.ready.tmp"):  # names an attacker could guess
        os.symlink(victim, folder / name)
    ready = ReadyFile(folder / "worker.ready", rank=3)
    ready.mark()
    ready.mark()
    assert victim.read_text() == "precious\n"
    assert not (folder / "worker.ready").is_symlink() and json.loads((folder / "worker.ready").read_text()) == {
        "pid": os.getpid(), "rank": 3}
    assert (folder / "worker.ready").stat().st_mode & 0o077 == 0
    assert sorted(p.name for p in folder.iterdir() if not p.is_symlink()) == ["worker.ready"]  # no temp left
    ready.retire()
    os.symlink(victim, folder / "linked.ready")
    with pytest.raises(ValueError, match="is a symlink"):
        ReadyFile(folder / "linked.ready")


@pytest.mark.parametrize("where", ["world-writable", "symlink"])
def test_worker_refuses_an_unsafe_ready_file_before_loading_anything(tmp_path, private_dir, llama_dir, where):
    victim = _victim(tmp_path)
    folder = tmp_path / "ready-dir"
    folder.mkdir(mode=0o700)
    if where == "world-writable":
        folder.chmod(0o1777)
        path = folder / "worker.ready"
    else:
        path = folder / "worker.ready"
        os.symlink(victim, path)
    env = {"TOKSERVE_RUNTIME_DIR": str(private_dir / "rt")}
    with ProcGroup(tmp_path / "logs") as procs:
        worker = procs.worker(f"ipc://{private_dir}/backend.sock", 0, "--model", str(llama_dir), "--ready-file",
                              str(path), env=env)
        assert worker.popen.wait(60) != 0
        log = worker.log_path.read_text()
        assert "--ready-file" in log and ("writable by other users" in log or "is a symlink" in log), log
    assert victim.read_text() == "precious\n"
    assert not (private_dir / "rt").exists()  # refused before the worker token was created
