"""Spawn, watch and kill real tokserve processes for tests and benchmarks.

Every process gets free loopback TCP ports, logs to a file under ``log_dir`` (dumped
by ``Proc.tail()`` on failures), and is killed by ``ProcGroup.close()`` no matter what.

    with ProcGroup(tmp_path) as procs:
        broker = procs.broker()                      # waits until it answers INFO
        procs.fake_worker(broker, rank=0)
        wait_for_workers(broker.frontend, 1)
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import zmq

from common import framing
from common.protocol import ClusterInfo, MsgType

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


class Proc:
    def __init__(self, name: str, args: list[str], log_path: Path, env: Optional[dict] = None,
                 prefix: Optional[list[str]] = None, python: bool = True):
        """``args`` follow ``python`` (``-m ...``), or are a whole command line when
        ``python`` is False (another program, e.g. vllm-router); ``prefix``: a command
        that execs it in another context (``ip netns exec NS``)."""
        self.name, self.args, self.log_path = name, args, log_path
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.setdefault("TOKSERVE_LOG_LEVEL", "INFO")
        full_env.update(env or {})
        self._log = open(log_path, "ab")
        argv = [sys.executable, *args] if python else list(args)
        self.popen = subprocess.Popen([*(prefix or ()), *argv], cwd=REPO, env=full_env, stdout=self._log,
                                      stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill9(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)

    def terminate(self, timeout: float = 30) -> int:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
        return self.popen.wait(timeout)

    def stop(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(3)
            except subprocess.TimeoutExpired:
                self.kill9()
        self._log.close()

    def tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return f"--- {self.name} (pid {self.pid}) ---\n" + "\n".join(lines[-n:])


class BrokerProc(Proc):
    def __init__(self, frontend: str, backend: str, extra: list[str], log_path: Path, env=None):
        self.frontend, self.backend = frontend, backend
        super().__init__("broker", ["-m", "common.cli", "broker", "--frontend", frontend, "--backend", backend,
                                    *extra], log_path, env)


def cluster_info(frontend: str, timeout: float = 1.0) -> Optional[ClusterInfo]:
    """One INFO round trip over a throwaway DEALER; None when nothing answers in time."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(frontend)
        sock.send_multipart(framing.message(MsgType.INFO, framing.nonce_bytes(1)))
        if not sock.poll(int(timeout * 1000)):
            return None
        frames = sock.recv_multipart()
        return framing.decode(frames[2], ClusterInfo)
    finally:
        sock.close(0)


def timeout_scale() -> float:
    """How much longer than on an idle machine things may take now.

    TOKSERVE_TEST_TIMEOUT_SCALE when set; else the run-queue excess over the cores (load
    average 8 on 2 cores: 4x).  Read at each wait: the load changes during a suite."""
    raw = os.environ.get("TOKSERVE_TEST_TIMEOUT_SCALE")
    if raw:
        return max(1.0, float(raw))
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    return min(8.0, max(1.0, load / (os.cpu_count() or 1)))


def scaled(seconds: float) -> float:
    """A deadline for something that takes CPU: ``seconds`` on an idle machine, longer under load."""
    return seconds * timeout_scale()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll ``predicate`` until it returns something true.  ``timeout`` is the idle-machine
    bound, scaled by the machine's load (a deadline, never a duration: a state reached
    early returns at once)."""
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)


def wait_for_workers(frontend: str, count: int, timeout: float = 60.0, ranks: Optional[set] = None) -> ClusterInfo:
    """Wait until the broker lists exactly ``count`` workers (and these ``ranks``, if given)."""

    def check():
        info = cluster_info(frontend, 0.5)
        if info is None or len(info.workers) != count:
            return None
        if ranks is not None and {w.rank for w in info.workers} != set(ranks):
            return None
        return info

    return wait_for(check, timeout, f"{count} worker(s) registered at {frontend}")


class ProcGroup:
    """Owns every process a test starts; close() kills them all."""

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[Proc] = []

    def _log(self, name: str) -> Path:
        return self.log_dir / f"{name}-{len(self.procs)}.log"

    def broker(self, *extra: str, frontend: Optional[str] = None, backend: Optional[str] = None,
               wait: bool = True, env=None) -> BrokerProc:
        frontend = frontend or free_endpoint()
        extra = list(extra)
        if frontend.startswith("tcp://") and "--curve-authorized-keys" not in extra:
            # Tests run as one user on a loopback port they picked: the open door the broker refuses
            # by default is theirs alone (tests/integration/test_security_local.py covers the refusal).
            extra.append("--allow-unauthenticated-tcp-frontend")
        proc = BrokerProc(frontend, backend or free_endpoint(), extra, self._log("broker"), env)
        self.procs.append(proc)
        if wait:
            try:
                wait_for(lambda: cluster_info(proc.frontend, 0.3) is not None or not proc.alive(), 30,
                         "broker to answer INFO")
            except TimeoutError:
                raise TimeoutError(proc.tail()) from None
            if not proc.alive():
                raise RuntimeError("broker exited early\n" + proc.tail())
        return proc

    def fake_worker(self, broker: BrokerProc | str, rank: int = 0, *extra: str, env=None) -> Proc:
        backend = broker.backend if isinstance(broker, BrokerProc) else broker
        proc = Proc(f"fake-worker{rank}", ["-m", "tests.support.fake_worker", "--broker", backend, "--rank", str(rank),
                                           *extra], self._log(f"fake-worker{rank}"), env)
        self.procs.append(proc)
        return proc

    def worker(self, broker: BrokerProc | str, rank: int = 0, *extra: str, env=None) -> Proc:
        """A real `tokserve worker` process."""
        backend = broker.backend if isinstance(broker, BrokerProc) else broker
        # float32 unless the test names a dtype: tests compare with float32 references
        # (in-process engines, HF), and ``auto`` may pick bf16 for a float32 checkpoint.
        dtype = () if "--dtype" in extra else ("--dtype", "float32")
        proc = Proc(f"worker{rank}", ["-m", "common.cli", "worker", "--broker", backend, "--rank", str(rank),
                                      *dtype, *extra], self._log(f"worker{rank}"), env)
        self.procs.append(proc)
        return proc

    def spawn(self, name: str, args: list[str], env=None, prefix: Optional[list[str]] = None,
              python: bool = True) -> Proc:
        proc = Proc(name, args, self._log(name), env, prefix, python)
        self.procs.append(proc)
        return proc

    def tails(self) -> str:
        return "\n".join(p.tail() for p in self.procs)

    def close(self) -> None:
        for proc in self.procs:
            try:
                proc.stop()
            except Exception:
                pass

    def __enter__(self) -> "ProcGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
