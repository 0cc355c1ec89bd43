"""`tokserve cells`: an RL control operation fanned out to two real cells (each: broker +
worker + gateway with --enable-rl, its own runtime directory), answers aggregated, exit
status 1 with a report when a cell fails (common/cells_control.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.support.cells import CELL_WORKER_ARGS, start_cell
from tests.support.model_factory import tiny_model_dir
from tests.support.procs import REPO, ProcGroup, free_port

API_KEY = "cells-rl-secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LORA_ARGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16")


@pytest.fixture(scope="module")
def cells(tmp_path_factory, tiny_model_root):
    model = tiny_model_dir("llama", tiny_model_root, 0)
    root = tmp_path_factory.mktemp("cells-control")
    with ProcGroup(root / "logs") as procs:
        yield model, [start_cell(procs, root / f"cell{i}", model, api_key=API_KEY, kv_events=False,
                                 worker_args=(*CELL_WORKER_ARGS, *LORA_ARGS),
                                 gateway_args=("--enable-rl", "--allow-runtime-lora")) for i in range(2)]


def _tokserve_cells(*args: str, key: str = API_KEY) -> tuple[int, list[dict], str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "TOKSERVE_API_KEY": key}
    done = subprocess.run([sys.executable, "-m", "common.cli", "cells", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, lines, done.stdout + done.stderr


def _paused(cell) -> bool:
    return httpx.get(cell.url + "/is_paused", headers=AUTH, timeout=30).json()["is_paused"]


def test_cells_pause_resume_fan_out_to_every_cell(cells):
    _, (a, b) = cells
    urls = ["--cell", a.url, "--cell", b.url]
    rc, lines, out = _tokserve_cells("pause", "--mode", "keep", *urls)
    assert rc == 0, out
    assert [(l["cell"], l["ok"], l["answer"]) for l in lines] == [(a.url, True, {"status": "paused"}),
                                                                  (b.url, True, {"status": "paused"})]
    assert _paused(a) and _paused(b)
    rc, lines, out = _tokserve_cells("is-paused", *urls)
    assert rc == 0 and [l["answer"] for l in lines] == [{"is_paused": True}] * 2, out
    rc, lines, out = _tokserve_cells("resume", *urls)
    assert rc == 0, out
    assert not _paused(a) and not _paused(b)


def test_cells_failing_cell_is_reported_and_pause_is_all_or_nothing(cells, tmp_path):
    _, (a, b) = cells
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cells_file = tmp_path / "cells.txt"
    cells_file.write_text(f"# our cells\n{a.url}\n{dead}  # cell c, down\n{b.url}\n")
    rc, lines, out = _tokserve_cells("pause", "--cells-file", str(cells_file))
    assert rc == 1, out
    assert [(l["cell"], l["ok"]) for l in lines] == [(a.url, True), (dead, False), (b.url, True)]
    assert lines[1]["status"] == 0 and "no answer" in lines[1]["answer"]
    assert "pause: FAILED on" in out and "resumed the 2 that had paused" in out and "no cell is left paused" in out
    assert not _paused(a) and not _paused(b)
    # Cells refusing the key: their 401 (vLLM's body), named in the report.
    rc, lines, out = _tokserve_cells("resume", "--cell", a.url, "--cell", b.url, key="wrong")
    assert rc == 1 and [l["status"] for l in lines] == [401, 401], out
    assert lines[0]["answer"] == {"error": "Unauthorized"} and f"--cell for: {a.url} {b.url}" in out


def test_cells_update_weights_commits_on_every_cell(cells):
    model, (a, b) = cells
    rc, lines, out = _tokserve_cells("update-weights", "--path", str(model), "--version", "cells-v1",
                                     "--cell", a.url, "--cell", b.url)
    assert rc == 0, out
    assert all(l["answer"]["message"] == "Weight update finished" for l in lines), out
    for cell in (a, b):
        info = httpx.get(cell.url + "/weight_info", headers=AUTH, timeout=30).json()
        assert info["weight_version"] == "cells-v1", info
    # A checkpoint folder that does not exist: refused at the load phase, nothing committed anywhere.
    rc, lines, out = _tokserve_cells("update-weights", "--path", str(model) + "-missing", "--version", "cells-v2",
                                     "--cell", a.url, "--cell", b.url)
    assert rc == 1 and "nothing was committed on any cell" in out, out
    for cell in (a, b):
        assert httpx.get(cell.url + "/weight_info", headers=AUTH, timeout=30).json()["weight_version"] == "cells-v1"


def _models(cell) -> set[str]:
    return {m["id"] for m in httpx.get(cell.url + "/v1/models", headers=AUTH, timeout=30).json()["data"]}


def test_cells_load_and_unload_lora_on_every_cell(cells, tmp_path):
    pytest.importorskip("peft")
    from tests.support.lora_factory import build_adapter

    model, (a, b) = cells
    adapter = build_adapter(model, tmp_path / "qv", ["q_proj", "v_proj"], rank=4, seed=1)
    urls = ["--cell", a.url, "--cell", b.url]
    rc, lines, out = _tokserve_cells("load-lora", "--name", "qv", "--path", str(adapter), *urls)
    assert rc == 0 and all(l["ok"] for l in lines), out
    assert "qv" in _models(a) and "qv" in _models(b)
    # Served by both cells: a request naming the adapter works on each.
    for cell in (a, b):
        r = httpx.post(cell.url + "/inference/v1/generate", headers=AUTH, timeout=60,
                       json={"model": "qv", "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3}})
        assert r.status_code == 200, r.text
    rc, lines, out = _tokserve_cells("unload-lora", "--name", "qv", *urls)
    assert rc == 0, out
    assert "qv" not in _models(a) and "qv" not in _models(b)
    # Unloading again: each cell's 4xx, reported per cell, exit status 1.
    rc, lines, out = _tokserve_cells("unload-lora", "--name", "qv", *urls)
    assert rc == 1 and all(400 <= l["status"] < 500 for l in lines), out


class _Recorder:
    """A real HTTP server on a free loopback port: answers every request with ``reply(handler)``
    and records (method, path, Authorization header) of each."""

    def __init__(self, reply):
        import http.server
        import threading

        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(self):
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                seen.append((self.command, self.path, self.headers.get("Authorization")))
                status, headers, body = reply(self)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = _any

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_cells_never_follow_a_redirect_and_count_only_the_routes_own_answer():
    """A "cell" answering 302 to another port: the key never reaches that port (no request at
    all), the cell fails (status 302), and a pause is all or nothing across the real-answer
    cell beside it.  A 200 that is not the route's answer (another server's page) fails too."""
    elsewhere = _Recorder(lambda h: (200, {"Content-Type": "application/json"},
                                     json.dumps({"status": "paused", "is_paused": True}).encode()))
    redirector = _Recorder(lambda h: (302, {"Location": elsewhere.url + h.path}, b""))
    good = _Recorder(lambda h: (200, {"Content-Type": "application/json"}, json.dumps(
        {"status": "paused" if h.path.startswith("/pause") else "resumed"}).encode()))
    not_a_cell = _Recorder(lambda h: (200, {"Content-Type": "text/html"}, b"<html>welcome</html>"))
    try:
        rc, lines, out = _tokserve_cells("pause", "--cell", good.url, "--cell", redirector.url)
        assert rc == 1, out
        assert [(l["cell"], l["ok"], l["status"]) for l in lines] == [(good.url, True, 200),
                                                                      (redirector.url, False, 302)]
        assert "redirected to" in lines[1]["error"] and "not followed" in lines[1]["error"]
        assert "resumed the 1 that had paused" in out
        assert [m for m, _, _ in good.seen] == ["POST", "POST"] and good.seen[1][1] == "/resume"
        assert redirector.seen[0][2] == f"Bearer {API_KEY}"  # the listed cell got it, as the operator said
        for op in ("is-paused", "resume"):  # a GET too: nothing follows, so nothing carries the key away
            rc, lines, out = _tokserve_cells(op, "--cell", redirector.url)
            assert rc == 1 and lines[0]["status"] == 302, out
        assert elsewhere.seen == []
        rc, lines, out = _tokserve_cells("pause", "--cell", not_a_cell.url)
        assert rc == 1 and lines[0]["ok"] is False and "not the answer of /pause" in lines[0]["error"], out
        assert "pause: FAILED on" in out
    finally:
        for server in (elsewhere, redirector, good, not_a_cell):
            server.close()
