"""Shared pytest fixtures.  Model fixtures build tiny random HF checkpoints once per
session (tests/model_factory.py); append new fixtures below."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import model_factory


def pytest_sessionstart(session):
    # Build the native CPU kernels once, up front (~45 s on a fresh machine, then
    # cached): worker processes started by the tests then load them instead of
    # compiling inside their start-up timeouts.
    from worker.engine.kernels import load_cpu_kernels

    load_cpu_kernels()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


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
    from worker.engine.demo_model import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("demo") / "demo-model")
