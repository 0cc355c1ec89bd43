"""Shared pytest fixtures.  Model fixtures build tiny random HF checkpoints once per
session (tests/support/model_factory.py); append new fixtures below."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tests.support import model_factory
from tests.support.procs import timeout_scale

# A private runtime directory (common/runtime_dir.py: default ipc sockets, control and
# worker tokens) per test session, inherited by every process the tests start: sessions
# never share sockets or tokens, nor touch the user's real one.  Short (under /tmp): a
# Unix socket path must fit 107 bytes.
_OWN_RUNTIME_DIR = None
if not os.environ.get("TOKSERVE_RUNTIME_DIR"):
    _OWN_RUNTIME_DIR = tempfile.mkdtemp(prefix="tsrt-")  # mode 0700
    os.environ["TOKSERVE_RUNTIME_DIR"] = _OWN_RUNTIME_DIR


def pytest_sessionfinish(session, exitstatus):
    if _OWN_RUNTIME_DIR is not None:
        shutil.rmtree(_OWN_RUNTIME_DIR, ignore_errors=True)


def pytest_sessionstart(session):
    # The install builds the native CPU kernels (`tokserve build-kernels`); should it
    # not have (an edited kernel, an install without that step), build them here, up
    # front, so that worker processes started by the tests load them instead of
    # compiling inside their start-up timeouts.  Whether the install had built them is
    # what tests/integration/test_kernels_prebuilt.py checks.
    from worker.engine.kernels import kernel_module_name, load_cpu_kernels, prebuilt_library

    name = kernel_module_name(Path(__file__).resolve().parents[1] / "worker" / "engine" / "kernels")
    os.environ["TOKSERVE_TEST_KERNELS_PREBUILT"] = "1" if prebuilt_library(name) is not None else "0"
    load_cpu_kernels()


# --- markers by location (added by scripts/reorganize_tests.py) ---
# tests/integration: ``integration``; tests/fuzz: ``fuzz``, plus ``integration`` when the
# module starts processes; tests/cuda: ``cuda``; the slowest integration files: ``slow``.
# ``python -m pytest -q -m "not integration"`` is the fast, in-process part.
_TESTS_DIR = Path(__file__).resolve().parent
_STARTS_PROCESSES = ("ProcGroup", "start_gateway", "BrokerProc", "subprocess", "Popen")
SLOW_FILES = {'test_broker.py',
              'test_gpu_check.py',
              'test_security_gateway.py',
              'test_security_transfer.py',
              'test_tensor_parallel.py',
              'test_triton_interpreted.py'}


def _mark_by_location(items):
    for item in items:
        try:
            rel = Path(str(item.path)).resolve().relative_to(_TESTS_DIR)
        except ValueError:
            continue
        top = rel.parts[0] if len(rel.parts) > 1 else ""
        if top == "integration":
            item.add_marker(pytest.mark.integration)
        elif top == "fuzz":
            item.add_marker(pytest.mark.fuzz)
            module = getattr(getattr(item, "module", None), "__dict__", {})
            if any(name in module for name in _STARTS_PROCESSES):
                item.add_marker(pytest.mark.integration)
        elif top == "cuda":
            item.add_marker(pytest.mark.cuda)
        if rel.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
# --- end of markers by location ---


def pytest_collection_modifyitems(config, items):
    _mark_by_location(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """A test's pytest-timeout scales with the machine's load, as its waits do
    (tests/support/procs.py: wait_for): on a busy machine a healthy test is slower, not
    hung.  Outermost wrapper, so pytest-timeout reads the scaled marker."""
    scale = timeout_scale()
    if scale > 1:
        marker = item.get_closest_marker("timeout")
        base = marker.args[0] if marker is not None and marker.args else marker.kwargs.get("timeout") \
            if marker is not None else item.config.getini("timeout")
        if base:
            item.add_marker(pytest.mark.timeout(float(base) * scale), append=False)
    yield


@pytest.fixture(scope="session")
def tiny_model_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_model(tiny_model_root):
    """``tiny_model(kind)`` -> directory of that tiny checkpoint (see model_factory.KINDS)."""
    return lambda kind, seed=0: model_factory.tiny_model_dir(kind, tiny_model_root, seed)


@pytest.fixture(scope="session")
def llama_dir(tiny_model) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="session")
def qwen2_dir(tiny_model) -> Path:
    return tiny_model("qwen2")


@pytest.fixture(scope="session")
def qwen3_dir(tiny_model) -> Path:
    return tiny_model("qwen3")


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> Path:
    from worker.engine.loading.demo_model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("demo") / "demo-model")


@pytest.fixture(scope="session")
def llama_bf16_dir(tiny_model_root) -> Path:
    """The tiny llama stored in bfloat16 (config.json torch_dtype bfloat16)."""
    return model_factory.tiny_bf16_model_dir("llama", tiny_model_root)
