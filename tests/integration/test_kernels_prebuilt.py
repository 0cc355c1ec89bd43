"""The native CPU kernels are built at install time (`tokserve build-kernels`, the last
step of the README's install and of .ci/run) and a worker then imports that build
directly: no compiler, no ninja, no waiting at the first `tokserve serve`.  A build whose
stamp does not match this torch is not trusted and goes through torch's checked build."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from worker.engine import kernels
from worker.engine.kernels import STAMP, kernel_module_name, prebuilt_library

ROOT = Path(__file__).resolve().parents[2]
NAME = kernel_module_name(ROOT / "worker" / "engine" / "kernels")
# A process that cannot compile anything: no c++, no ninja on its PATH.  CXX stays unset,
# so the kernels' name (keyed by the toolchain) is the same as in this process.
NO_TOOLCHAIN = {"PATH": "/nonexistent"}
LOAD_AND_RUN = ("import torch, worker.engine.kernels as k; m = k.load_cpu_kernels(); print(m and m.__file__); "
                "x = torch.randn(3, 8); w = torch.randn(8)\n"
                "if m: torch.testing.assert_close(m.rms_norm(x, w, 1e-5), "
                "x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w, atol=1e-5, rtol=1e-5)")


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "CXX"}
    full.update(PYTHONPATH=str(ROOT), TOKSERVE_LOG_LEVEL="INFO", **env)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=300)


def test_kernels_were_built_before_the_tests_ran():
    """What the install left behind: the session start (tests/conftest.py) found the
    kernels built and stamped, so no worker of the suite (nor the first `tokserve
    serve`) compiles."""
    assert os.environ.get("TOKSERVE_TEST_KERNELS_PREBUILT") == "1", (
        "the CPU kernels were compiled by the test session, not at install time: the install must end with "
        "`tokserve build-kernels` (README, .ci/run)")
    assert prebuilt_library(NAME) is not None


def test_build_kernels_command_finds_the_build_and_says_where():
    proc = subprocess.run([sys.executable, "-m", "common.cli", "build-kernels", "--strict"], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    library = kernels.build_directory(NAME) / f"{NAME}.so"
    assert f"native CPU kernels already built: {library}" in proc.stdout
    assert "compiling" not in proc.stdout + proc.stderr


@pytest.fixture
def copied_build(tmp_path) -> Path:
    """This environment's stamped build, copied into an extension cache of the test's own."""
    library = prebuilt_library(NAME)
    assert library is not None, "no stamped build (see test_kernels_were_built_before_the_tests_ran)"
    dest = tmp_path / "ext" / NAME
    dest.mkdir(parents=True)
    shutil.copy2(library, dest)  # copy2: the stamp records the library's size and mtime
    shutil.copy2(library.parent / STAMP, dest)
    return dest


def test_a_stamped_build_loads_without_any_compiler(copied_build):
    env = dict(NO_TOOLCHAIN, TORCH_EXTENSIONS_DIR=str(copied_build.parent))
    proc = _run(LOAD_AND_RUN, env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[0] == str(copied_build / f"{NAME}.so")
    assert "compiling" not in proc.stderr and "unavailable" not in proc.stderr
    # The control: the same process with an empty cache cannot build them (so the load
    # above was not a compile) and falls back to torch's ops.
    empty = copied_build.parent.parent / "empty"
    proc = _run(LOAD_AND_RUN, dict(NO_TOOLCHAIN, TORCH_EXTENSIONS_DIR=str(empty)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[0] == "None"
    assert "compiling the native CPU kernels" in proc.stderr and "native CPU kernels unavailable" in proc.stderr


@pytest.mark.parametrize("field,value", [("torch", "2.0.0"), ("torch_git", "0" * 40), ("python", "cpython-39"),
                                         ("size", 1)])
def test_a_build_stamped_for_another_torch_or_library_is_not_imported(copied_build, field, value):
    stamp = copied_build / STAMP
    fields = json.loads(stamp.read_text())
    fields[field] = value
    stamp.write_text(json.dumps(fields))
    proc = _run(LOAD_AND_RUN, dict(NO_TOOLCHAIN, TORCH_EXTENSIONS_DIR=str(copied_build.parent)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Handed to torch's build (which needs the missing toolchain), never imported as is.
    assert proc.stdout.split()[0] == "None"
    assert "native CPU kernels unavailable" in proc.stderr
