"""Start *cells* (one broker + its workers + a gateway, each cell with its own private
runtime directory, hence its own worker and control tokens) and vllm-router in front of
them, for the cells tests and benchmarks/cells.py.

    with ProcGroup(tmp) as procs:
        cells = [start_cell(procs, tmp / f"cell{i}", model_dir) for i in range(2)]
        router = start_vllm_router(procs, [c.url for c in cells], "kv_aware", api_key=KEY)
"""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx

from tests.support.procs import BrokerProc, Proc, ProcGroup, free_port, wait_for, wait_for_workers

CELL_WORKER_ARGS = ("--max-num-seqs", "16", "--num-kv-blocks", "512", "--threads", "1", "--max-model-len", "1024",
                    "--block-size", "16")


def vllm_router_binary() -> Optional[str]:
    """vllm-router's console script (pip install vllm-router: a Rust binary in a wheel)."""
    here = Path(sys.executable).parent / "vllm-router"
    return str(here) if here.exists() else shutil.which("vllm-router")


@dataclass
class Cell:
    name: str
    runtime_dir: Path
    broker: BrokerProc
    workers: list[Proc]
    gateway: Proc
    port: int
    kv_events_endpoint: Optional[str]
    env: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _healthy(url: str, proc: Proc, procs: ProcGroup) -> bool:
    if not proc.alive():
        raise RuntimeError(f"{proc.name} exited\n" + procs.tails())
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def start_cell(procs: ProcGroup, root: Path, model_dir: Path, *, workers: int = 1, api_key: Optional[str] = None,
               kv_events: bool = True, worker_args=CELL_WORKER_ARGS, gateway_args=(), broker_args=()) -> Cell:
    """One cell; returns once its gateway's /health is 200 (its workers registered)."""
    runtime = Path(root) / "runtime"
    runtime.mkdir(parents=True, exist_ok=True)
    os.chmod(runtime, 0o700)
    env = {"TOKSERVE_RUNTIME_DIR": str(runtime)}
    # The publisher's default (the flag without a value): ipc:// in the cell's private runtime
    # directory, which vllm-router (run by this user) subscribes to as to tcp://.
    kv_endpoint = f"ipc://{runtime}/kv-events.sock" if kv_events else None
    extra = ["--kv-events-endpoint"] if kv_endpoint else []
    broker = procs.broker(*extra, *broker_args, env=env)
    worker_procs = [procs.worker(broker, rank, "--model", str(model_dir), *worker_args, env=env)
                    for rank in range(workers)]
    wait_for_workers(broker.frontend, workers, timeout=180)
    port = free_port()
    key = ["--api-key", api_key] if api_key else []
    gateway = procs.spawn(f"{Path(root).name}-gateway", ["-m", "common.cli", "gateway", "--port", str(port),
                                                          "--broker", broker.frontend, "--info-ttl", "0.2", *key,
                                                          *gateway_args], env=env)
    cell = Cell(Path(root).name, runtime, broker, worker_procs, gateway, port, kv_endpoint, env)
    wait_for(lambda: _healthy(cell.url, gateway, procs), 120, f"{cell.name} gateway /health", interval=0.2)
    return cell


class Router:
    def __init__(self, proc: Proc, port: int):
        self.proc, self.port = proc, port
        self.url = f"http://127.0.0.1:{port}"


def start_vllm_router(procs: ProcGroup, urls: list[str], policy: str, *extra: str,
                      api_key: Optional[str] = None) -> Router:
    """vllm-router over ``urls``; returns once it serves /health.  Health checks every
    second, one failure marks a backend unhealthy: a dead cell leaves the rotation."""
    binary = vllm_router_binary()
    assert binary, "vllm-router is not installed (pip install vllm-router)"
    port = free_port()
    args = [binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", policy,
            "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1",
            "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--health-check-timeout-secs", "2",
            "--log-level", "info", *extra]
    if api_key:
        args += ["--api-key", api_key]
    proc = procs.spawn(f"vllm-router-{policy}", args, env={"RUST_LOG": os.environ.get("RUST_LOG", "info")},
                       python=False)
    router = Router(proc, port)
    wait_for(lambda: _healthy(router.url, proc, procs), 120, f"vllm-router ({policy}) /health", interval=0.2)
    return router


class KvEventWatcher:
    """Subscribes to cells' KV-event publishers (as vllm-router does) and counts the
    announcements of every stored block by its token ids, so a test can wait until a
    prompt's blocks were published before sending the conversation's next turn."""

    def __init__(self, endpoints: list[str]):
        import threading

        import zmq

        self._zmq = zmq
        self._stored: dict[tuple[int, ...], int] = {}  # token ids -> times announced
        self._cond = threading.Condition()
        self._stop = False
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        for endpoint in endpoints:
            self._sock.connect(endpoint)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec

        while not self._stop:
            if not self._sock.poll(100):
                continue
            _topic, _seq, payload = self._sock.recv_multipart()
            _ts, events, *_ = msgspec.msgpack.decode(payload)
            with self._cond:
                for event in events:
                    if event.get("type") == "BlockStored":
                        key = tuple(event["token_ids"])
                        self._stored[key] = self._stored.get(key, 0) + 1
                self._cond.notify_all()

    def wait_stored(self, block: list[int], times: int = 1, timeout: float = 30.0) -> None:
        """Until a cell has announced ``block`` (these token ids) ``times`` times: a second
        time is a re-announcement for a subscriber that joined later (broker/kv_publisher.py)."""
        key = tuple(block)
        with self._cond:
            if not self._cond.wait_for(lambda: self._stored.get(key, 0) >= times, timeout):
                raise TimeoutError(f"no cell announced the block {block[:4]}... {times} time(s) within {timeout}s")

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self._sock.close(0)
