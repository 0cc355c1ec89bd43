"""Security: local-only defaults (configuration and the sockets actually listening),
CURVE authentication of broker peers (common/security.py), and no pickle anywhere."""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
import zmq

from common import config, security
from common.client import Client, RequestError
from common.protocol import GenerateRequest, SamplingParams
from tests.support.gateway_helpers import gen_body, post, start_gateway
from tests.support.procs import REPO, ProcGroup, free_port, scaled, wait_for

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")]


def _req(rid: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=4))


# ----------------------------------------------------------------------------- local-only by default
def test_default_addresses_are_private_ipc_sockets(monkeypatch, tmp_path):
    """Nothing reachable off-host by default: every default endpoint is a Unix socket in
    the private (0700) runtime directory, and the gateway binds loopback."""
    from broker.main import build_parser as broker_parser
    from common import runtime_dir
    from common.launcher import build_parser as launcher_parser
    from gateway.main import build_parser as gateway_parser
    from worker.main import build_parser as worker_parser

    for var in ("TOKSERVE_FRONTEND", "TOKSERVE_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TOKSERVE_RUNTIME_DIR", str(tmp_path / "rt"))
    broker = broker_parser().parse_args([])
    launcher = launcher_parser().parse_args([])
    endpoints = [config.frontend_address(), config.backend_address(), broker.frontend, broker.backend,
                 worker_parser().parse_args([]).broker, launcher.frontend, launcher.backend]
    assert {e.split("://")[0] for e in endpoints} == {"ipc"}
    assert {Path(runtime_dir.ipc_path(e)).parent for e in endpoints} == {tmp_path / "rt"}
    assert runtime_dir.ensure() == tmp_path / "rt"
    assert (tmp_path / "rt").stat().st_mode & 0o777 == 0o700
    assert gateway_parser().parse_args([]).host == "127.0.0.1"
    assert launcher.host == "127.0.0.1"


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that process ``pid`` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            addr_hex, port_hex = fields[1].split(":")
            raw = bytes.fromhex(addr_hex)
            # /proc prints the address as 32-bit words in host (little-endian) order.
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((socket.inet_ntop(family, raw), int(port_hex, 16)))
    return found


def test_processes_started_with_defaults_listen_on_no_tcp_port(tmp_path):
    """Broker, worker and gateway started without any address flag: the broker listens on
    Unix sockets in the private runtime directory only, the gateway on loopback."""
    if os.environ.get("TOKSERVE_FRONTEND") or os.environ.get("TOKSERVE_BACKEND"):
        pytest.skip("TOKSERVE_FRONTEND/BACKEND set in the environment")
    rt = Path(tempfile.mkdtemp(prefix="tsrt-"))  # short: a Unix socket path must fit 107 bytes
    env = {"TOKSERVE_RUNTIME_DIR": str(rt)}
    port = free_port()  # the gateway's port is always explicit; its host is left to the default
    try:
        with ProcGroup(tmp_path) as procs:
            broker = procs.spawn("broker", ["-m", "common.cli", "broker"], env=env)
            worker = procs.spawn("fake-worker", ["-m", "tests.support.fake_worker"], env=env)
            gateway = procs.spawn("gateway", ["-m", "common.cli", "gateway", "--port", str(port), "--info-ttl", "0.2"],
                                  env=env)
            url = f"http://127.0.0.1:{port}"

            def healthy():
                try:
                    return httpx.get(url + "/health", timeout=1).status_code == 200
                except httpx.HTTPError:
                    return False

            wait_for(healthy, 60, "default stack healthy", interval=0.2)
            assert _listening(broker.pid) == []
            assert _listening(worker.pid) == []  # workers only connect out
            assert _listening(gateway.pid) == [("127.0.0.1", port)]
            assert rt.stat().st_mode & 0o777 == 0o700
            assert {p.name for p in rt.iterdir() if p.is_socket()} == {"frontend.sock", "backend.sock"}
    finally:
        shutil.rmtree(rt, ignore_errors=True)


# ----------------------------------------------------------------------------- CURVE
@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    root = tmp_path_factory.mktemp("curve")
    authorized = root / "authorized"
    authorized.mkdir()
    out = {}
    cli = subprocess.run([sys.executable, "-m", "common.cli", "curve-keys", str(root / "keys"), "--name", "broker"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert security.load_keypair(root / "keys" / "broker.key_secret").public.decode() in cli.stdout
    assert (root / "keys" / "broker.key_secret").stat().st_mode & 0o077 == 0  # secret: owner-only
    out["broker"] = root / "keys" / "broker.key_secret"
    for name in ("gateway", "worker", "stranger"):
        public, secret = security.generate(root / "keys", name)
        out[name] = secret
        if name in ("gateway", "worker"):  # the broker admits these two only
            shutil.copy(public, authorized)
    out["broker_public"] = root / "keys" / "broker.key"
    out["authorized"] = authorized
    return out


@pytest.fixture(scope="module")
def curve_cluster(keys, tmp_path_factory):
    with ProcGroup(tmp_path_factory.mktemp("curve-logs")) as procs:
        broker = procs.broker("--curve-secret-file", str(keys["broker"]), "--curve-authorized-keys",
                              str(keys["authorized"]), wait=False)
        server_key = security.load_public_key(str(keys["broker_public"])).decode()
        procs.fake_worker(broker, 0, "--curve-server-key", server_key, "--curve-client-key-file", str(keys["worker"]))
        # Knows the broker's key but is not authorized: must never register.
        procs.fake_worker(broker, 1, "--curve-server-key", server_key, "--curve-client-key-file",
                          str(keys["stranger"]))
        yield broker, procs, server_key.encode()


def _ranks(client: Client):
    try:
        return [w.rank for w in client.info(timeout=scaled(1.0)).workers]
    except RequestError:  # no answer yet (a loaded broker): the caller polls again
        return None


def test_authorized_client_is_served_and_unauthorized_worker_never_registers(keys, curve_cluster):
    broker, procs, server_key = curve_cluster
    with Client(broker.frontend, curve_server_key=server_key,
                curve_client_keys=security.load_keypair(keys["gateway"])) as client:
        wait_for(lambda: _ranks(client) == [0], 20, "the authorized worker over CURVE")
        assert sum(len(d.token_ids) for d in client.generate(_req("allowed"))) == 4
        # The stranger has been reconnecting all along (its READY queued since it started);
        # a few more broker round trips must still list the authorized worker alone.
        stranger = next(p for p in procs.procs if p.name == "fake-worker1")
        wait_for(lambda: "worker rank 1 serving" in stranger.tail(), 60, "the stranger worker to send its READY")
        for _ in range(5):
            assert wait_for(lambda: _ranks(client), 20, "the broker's INFO") == [0]


@pytest.mark.parametrize("who", ["stranger", "ephemeral", "plaintext"])
def test_client_without_an_authorized_key_gets_nothing(keys, curve_cluster, who):
    broker, _, server_key = curve_cluster
    kwargs = {"plaintext": {},
              "ephemeral": {"curve_server_key": server_key},  # right server key, no authorized certificate
              "stranger": {"curve_server_key": server_key,
                           "curve_client_keys": security.load_keypair(keys["stranger"])}}[who]
    with Client(broker.frontend, **kwargs) as client:
        with pytest.raises(RequestError) as exc:
            list(client.generate(_req(f"denied-{who}")))
        assert exc.value.status == 503  # never connected: the request could not even be sent
        with pytest.raises(RequestError):
            client.info(timeout=0.5)
    assert broker.alive()


def test_gateway_with_curve_flags(keys, curve_cluster):
    broker, procs, _ = curve_cluster
    good = start_gateway(procs, broker.frontend, "--curve-server-key", str(keys["broker_public"]),
                         "--curve-client-key-file", str(keys["gateway"]))
    r = post(good, gen_body([1, 2], max_tokens=3))
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3, r.text
    stranger = start_gateway(procs, broker.frontend, "--curve-server-key", str(keys["broker_public"]),
                             "--curve-client-key-file", str(keys["stranger"]), wait_healthy=False)
    assert httpx.get(stranger.url + "/health", timeout=scaled(10)).status_code == 503
    assert post(stranger, gen_body([1, 2], max_tokens=3)).status_code == 503


def test_bad_key_files_are_clear_startup_errors(keys, tmp_path):
    with pytest.raises(ValueError, match="no secret key"):
        security.load_keypair(keys["broker_public"])
    with pytest.raises(ValueError, match="neither a Z85"):
        security.load_public_key(str(tmp_path / "missing.key"))
    with pytest.raises(ValueError, match="does not exist"):
        security.start_authenticator(zmq.Context.instance(), tmp_path / "nowhere")
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker("--curve-secret-file", str(keys["broker"]), "--curve-authorized-keys",
                              str(tmp_path / "nowhere"), wait=False)
        assert broker.popen.wait(30) != 0
        assert "does not exist" in broker.log_path.read_text()


# ----------------------------------------------------------------------------- no pickle
_FORBIDDEN = [
    (re.compile(r"^\s*(import|from)\s+(pickle|cPickle|_pickle|cloudpickle|dill|marshal|shelve)\b", re.M),
     "pickle-family import"),
    (re.compile(r"\b(recv|send)_pyobj\b"), "pyzmq pickle transport"),
    (re.compile(r"\btorch\.load\((?![^)]*weights_only\s*=\s*True)"), "torch.load without weights_only=True"),
]


def test_no_pickle_anywhere():
    this = Path(__file__).resolve()
    # The project's own code only: a virtual environment inside the checkout (as .ci/run makes)
    # holds third-party packages that legitimately use pickle.
    packages = ("common", "broker", "worker", "gateway", "tests", "benchmarks")
    files = [p for pkg in packages for p in (REPO / pkg).rglob("*.py") if p.resolve() != this]
    assert len(files) > 50
    hits = []
    for path in files:
        text = path.read_text(errors="replace")
        for pattern, what in _FORBIDDEN:
            for m in pattern.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                hits.append(f"{path.relative_to(REPO)}:{line}: {what}")
    assert not hits, "\n".join(hits)
