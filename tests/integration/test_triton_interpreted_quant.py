"""Runs tests/support/triton_interpreted_quant.py: checkpoint-quantized weights kept
quantized (the CUDA path: FP8 on the W8A8 GEMM, int4 on the W4A16 GEMM) on CPU tensors
under Triton's interpreter, through the paged model and the engine.  TRITON_INTERPRET=1
must be set before the kernels are decorated, and TOKSERVE_KEEP_QUANTIZED=1 makes the
CPU worker keep them as CUDA does, so it runs in a fresh interpreter."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_kept_quantized_weights_under_interpreter(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", TOKSERVE_KEEP_QUANTIZED="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "t"),
         str(ROOT / "tests" / "support" / "triton_interpreted_quant.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    m = re.search(r"(\d+) passed", proc.stdout)
    assert m and int(m.group(1)) >= 23 and "skipped" not in proc.stdout, tail
