"""Runs the Triton kernel checks (tests/support/triton_interpreted_kernels.py) and the model
and engine on the Triton backend (tests/support/triton_interpreted_model.py) on CPU tensors
under Triton's interpreter.  TRITON_INTERPRET=1 must be set before the kernels are
decorated, so they run in a fresh interpreter, one for both files."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
FILES = ("triton_interpreted_kernels.py", "triton_interpreted_model.py")


def test_triton_kernels_and_backend_under_interpreter(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "t"),
         *[str(ROOT / "tests" / "support" / f) for f in FILES]],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    m = re.search(r"(\d+) passed", proc.stdout)
    assert m and int(m.group(1)) >= 20 and "skipped" not in proc.stdout, tail
