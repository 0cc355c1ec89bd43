"""common/readiness.py in process: the ready file's life cycle and the probe's verdicts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from common import readiness
from common.readiness import ReadyFile, check


def test_mark_writes_pid_and_identity_privately(tmp_path):
    f = ReadyFile(tmp_path / "w.ready", rank=3, broker="tcp://b:5556")
    f.mark()
    data = json.loads((tmp_path / "w.ready").read_text())
    assert data == {"pid": os.getpid(), "rank": 3, "broker": "tcp://b:5556"}
    assert (tmp_path / "w.ready").stat().st_mode & 0o077 == 0
    assert check(tmp_path / "w.ready")[0]


def test_mark_refreshes_the_mtime(tmp_path):
    path = tmp_path / "w.ready"
    f = ReadyFile(path)
    f.mark()
    os.utime(path, (time.time() - 100, time.time() - 100))
    assert not check(path, max_age=5)[0]
    f.mark()
    assert check(path, max_age=5)[0]


def test_mark_rewrites_a_file_removed_behind_its_back(tmp_path):
    path = tmp_path / "w.ready"
    f = ReadyFile(path)
    f.mark()
    path.unlink()
    f.mark()
    assert check(path)[0]


def test_clear_then_mark_again(tmp_path):
    path = tmp_path / "w.ready"
    f = ReadyFile(path)
    f.mark()
    f.clear()
    ready, why = check(path)
    assert not ready and "does not exist" in why
    f.mark()
    assert check(path)[0]


def test_retire_is_final(tmp_path):
    path = tmp_path / "w.ready"
    f = ReadyFile(path)
    f.mark()
    f.retire()
    f.mark()  # a heartbeat that raced the drain must not bring it back
    assert not path.exists()


def test_stale_file_is_not_ready(tmp_path):
    path = tmp_path / "w.ready"
    ReadyFile(path).mark()
    ready, why = check(path, max_age=5, now=time.time() + 6)
    assert not ready and "old" in why


def test_dead_pid_is_not_ready(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    path = tmp_path / "w.ready"
    path.write_text(json.dumps({"pid": proc.pid}))
    ready, why = check(path)
    assert not ready and "gone" in why


def test_garbage_file_is_not_ready(tmp_path):
    path = tmp_path / "w.ready"
    path.write_text("{not json")
    assert not check(path)[0]
    path.write_text(json.dumps({"pid": "1"}))
    assert not check(path)[0]


def test_probe_exit_codes(tmp_path, capsys):
    path = tmp_path / "w.ready"
    assert readiness.main([str(path)]) == 1
    assert "does not exist" in capsys.readouterr().err
    ReadyFile(path).mark()
    assert readiness.main([str(path), "--max-age", "30"]) == 0
    assert readiness.main([str(path), "--quiet"]) == 0
    assert capsys.readouterr().err == ""
