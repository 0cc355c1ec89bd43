"""A non-editable install keeps the native CPU kernels: the wheel ships their sources
and headers, and the installed copy loads the same build as the checkout (the build
is keyed by content and toolchain, compiled from a staged copy, so it is not rebuilt);
another environment (torch elsewhere, another compiler) gets a build of its own."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from worker.engine.kernels import HEADERS, SOURCES, kernel_module_name, load_cpu_kernels

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "worker" / "engine" / "kernels"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools")
    out = tmp_path_factory.mktemp("wheel")
    # Built from a clean copy: setuptools stages into the tree's build/ and *.egg-info,
    # which would leak stale files into the wheel and race with concurrent test runs.
    src = tmp_path_factory.mktemp("src") / "tokserve"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", ".cache",
        ".whl", ".gl"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True, timeout=300)
    (whl,) = out.glob("tokserve-*.whl")
    return whl


def test_wheel_ships_kernel_sources_and_headers(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in SOURCES + HEADERS:
        assert f"worker/engine/kernels/{f}" in names, f
    assert "worker/engine/kernels/triton/attention.py" in names
    meta = next(zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    # SDPA enable_gqa needs torch 2.5 (F.rms_norm 2.4); Triton for its tests, on Linux where it ships
    assert any(r.replace(" ", "").startswith("torch>=2.5") for r in requires), requires
    assert any(r.startswith("triton") and "extra == \"test\"" in r for r in requires), requires


def _built_library() -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    name = kernel_module_name(KERNELS)
    return Path(_get_build_directory(name, verbose=False)) / f"{name}.so"


def test_installed_copy_loads_the_same_kernel_build(wheel, tmp_path):
    assert load_cpu_kernels() is not None, "the checkout's kernels must build here"
    library = _built_library()
    built_at = library.stat().st_mtime_ns
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
    assert "compiling the native CPU kernels" not in proc.stderr
    assert library.stat().st_mtime_ns == built_at, "the installed copy rebuilt the checkout's kernels"


def test_another_environment_gets_its_own_kernel_build(tmp_path, monkeypatch):
    """Torch's compile command holds torch's include dirs and the compiler, and ninja
    rebuilds when the command changes: two virtual environments sharing one build dir
    would rebuild each other's kernels on every alternate start."""
    here = kernel_module_name(KERNELS)
    # torch imported from another path, as from a second virtual environment
    import torch

    alt = tmp_path / "venv2"
    alt.mkdir()
    (alt / "torch").symlink_to(Path(torch.__file__).parent, target_is_directory=True)
    code = ("import pathlib, torch, worker.engine.kernels as k; print(torch.__file__); "
            f"print(k.kernel_module_name(pathlib.Path({str(KERNELS)!r})))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(alt), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    torch_file, other = proc.stdout.split()
    assert Path(torch_file).parent == alt / "torch"
    assert other != here
    same = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert same.stdout.split()[1] == here  # deterministic across processes
    monkeypatch.setenv("CXX", "clang++")
    assert kernel_module_name(KERNELS) != here


def test_module_name_is_keyed_by_content_not_location(tmp_path):
    copy = tmp_path / "kernels"
    copy.mkdir()
    for f in SOURCES + HEADERS:
        (copy / f).write_bytes((KERNELS / f).read_bytes())
    assert kernel_module_name(copy) == kernel_module_name(KERNELS)
    (copy / HEADERS[0]).write_bytes((KERNELS / HEADERS[0]).read_bytes() + b"\n// edited\n")
    assert kernel_module_name(copy) != kernel_module_name(KERNELS)  # an edited header is a new build
