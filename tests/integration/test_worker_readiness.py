"""The worker readiness probe (`tokserve worker --ready-file F` + `tokserve worker-ready F`,
the Kubernetes worker StatefulSet's exec probe) against a real broker and a real worker:
not fooled by a previous process's file,
not ready before the broker registered it, ready once it did, not ready once the broker
is gone, ready again when a broker comes back, never ready with a worker token the broker
refuses, and not ready once the worker drains."""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import pytest

from tests.support.procs import REPO, ProcGroup, free_endpoint, wait_for, wait_for_workers

pytestmark = pytest.mark.timeout(240)

WORKER_ARGS = ("--threads", "1", "--num-kv-blocks", "32", "--max-num-seqs", "4")


def probe(path, max_age: float = 5.0) -> subprocess.CompletedProcess:
    """The probe exactly as the StatefulSet runs it (a fresh process)."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "common.cli", "worker-ready", str(path), "--max-age", str(max_age)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def is_ready(path) -> bool:
    return probe(path).returncode == 0


def log_has(proc, text: str) -> bool:
    return text in proc.log_path.read_text(errors="replace")


def test_ready_follows_the_brokers_registration(tmp_path, llama_dir):
    frontend, backend = free_endpoint(), free_endpoint()
    ready_file = tmp_path / "worker.ready"
    # Left by a previous worker of this pod (a restarted container): fresh, naming a live process.
    ready_file.write_text(json.dumps({"pid": os.getpid()}))
    with ProcGroup(tmp_path / "logs") as procs:
        worker = procs.worker(backend, 0, "--model", str(llama_dir), "--ready-file", str(ready_file), *WORKER_ARGS)
        try:
            # The engine is up and READY went out, but no broker listens yet.
            wait_for(lambda: log_has(worker, "worker rank 0 serving") or not worker.alive(), 120, "worker start")
            assert worker.alive(), procs.tails()
            result = probe(ready_file)
            assert result.returncode == 1 and "does not exist" in result.stderr

            broker = procs.broker(frontend=frontend, backend=backend)
            wait_for_workers(broker.frontend, 1, timeout=60)
            wait_for(lambda: is_ready(ready_file), 60, "probe to pass once the broker registered the worker")
            assert probe(ready_file).stdout.startswith("ready: worker pid")

            broker.kill9()  # gone without a word: only the missing heartbeats tell
            wait_for(lambda: not is_ready(ready_file), 60, "probe to fail once the broker is gone")

            broker = procs.broker(frontend=frontend, backend=backend)  # a new broker: the worker re-registers
            wait_for_workers(broker.frontend, 1, timeout=60)
            wait_for(lambda: is_ready(ready_file), 60, "probe to pass again after re-registration")

            assert worker.terminate(timeout=60) == 0  # SIGTERM: drain, then exit
            assert not ready_file.exists()
            assert not is_ready(ready_file)
        except Exception:
            print(procs.tails())
            raise


def test_never_ready_with_a_refused_worker_token(tmp_path, llama_dir):
    wrong = tmp_path / "wrong.token"
    fd = os.open(wrong, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, secrets.token_urlsafe(32).encode())
    os.close(fd)
    ready_file = tmp_path / "worker.ready"
    with ProcGroup(tmp_path / "logs") as procs:
        broker = procs.broker()
        worker = procs.worker(broker, 0, "--model", str(llama_dir), "--ready-file", str(ready_file),
                              "--worker-token-file", str(wrong), *WORKER_ARGS)
        try:
            # The broker refused the READY and the worker heard it (the DISCONNECT that answers it).
            wait_for(lambda: broker.log_path.read_text(errors="replace").count("refused a worker registration") >= 1
                     and log_has(worker, "the broker refused our registration"), 120, "the broker to refuse the worker")
            assert worker.alive()
            assert not ready_file.exists()
            assert not is_ready(ready_file)
        except Exception:
            print(procs.tails())
            raise
