"""A non-editable install keeps the native CPU kernels: the wheel ships their sources
and headers, and the installed copy loads the same build as the checkout (the build
is keyed by content, compiled from a staged copy, so it is not rebuilt)."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from worker.engine.kernels import _HEADERS, _SOURCES, kernel_module_name, load_cpu_kernels

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "worker" / "engine" / "kernels"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools")
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, timeout=300)
    (whl,) = out.glob("tokserve-*.whl")
    return whl


def test_wheel_ships_kernel_sources_and_headers(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in _SOURCES + _HEADERS:
        assert f"worker/engine/kernels/{f}" in names, f
    assert "worker/engine/kernels/triton/attention.py" in names


def test_installed_copy_loads_the_same_kernel_build(wheel, tmp_path):
    assert load_cpu_kernels() is not None, "the checkout's kernels must build here"
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import worker.engine.kernels as k, pathlib; m = k.load_cpu_kernels(); "
            "print(pathlib.Path(k.__file__).parent); print(m.__name__ if m else None)")
    env = dict(os.environ, PYTHONPATH=str(site))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    where, name = proc.stdout.split()
    assert Path(where) == site / "worker" / "engine" / "kernels"  # the installed copy, not the checkout
    assert name == kernel_module_name(KERNELS)
    assert "native CPU kernels unavailable" not in proc.stderr


def test_module_name_is_keyed_by_content_not_location(tmp_path):
    copy = tmp_path / "kernels"
    copy.mkdir()
    for f in _SOURCES + _HEADERS:
        (copy / f).write_bytes((KERNELS / f).read_bytes())
    assert kernel_module_name(copy) == kernel_module_name(KERNELS)
    (copy / _HEADERS[0]).write_bytes((KERNELS / _HEADERS[0]).read_bytes() + b"\n// edited\n")
    assert kernel_module_name(copy) != kernel_module_name(KERNELS)  # an edited header is a new build
