"""PeriodicTrim (common/malloc_tuning.py): the worker's bound on kept freed memory trims
at most once per interval, never with interval 0."""
from __future__ import annotations

import pytest

from common import malloc_tuning
from common.malloc_tuning import PeriodicTrim


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def trims(monkeypatch):
    calls = []
    monkeypatch.setattr(malloc_tuning, "can_trim", lambda: True)
    monkeypatch.setattr(malloc_tuning, "trim_freed_memory", lambda: calls.append(1) or True)
    return calls


def test_trims_once_per_interval(trims):
    clock = Clock()
    trim = PeriodicTrim(60.0, clock)
    trim.tick()
    assert trims == []  # not before the first interval has passed
    clock.now += 59.9
    trim.tick()
    assert trims == []
    clock.now += 0.2
    trim.tick()
    trim.tick()  # the same moment again: still one
    assert len(trims) == 1 and trim.trims == 1
    clock.now += 60.0
    trim.tick()
    assert len(trims) == 2


def test_interval_zero_never_trims(trims):
    clock = Clock()
    trim = PeriodicTrim(0.0, clock)
    for _ in range(3):
        clock.now += 1000
        trim.tick()
    assert trims == [] and not trim.enabled


def test_without_malloc_trim_nothing_is_called(monkeypatch):
    monkeypatch.setattr(malloc_tuning, "can_trim", lambda: False)
    monkeypatch.setattr(malloc_tuning, "trim_freed_memory", lambda: pytest.fail("trimmed without glibc"))
    clock = Clock()
    trim = PeriodicTrim(1.0, clock)
    clock.now += 10
    trim.tick()
    assert not trim.enabled


def test_worker_flag_default_and_refusal():
    from worker.main import build_parser, main

    assert build_parser().parse_args([]).malloc_trim_interval == 60.0
    with pytest.raises(SystemExit, match="--malloc-trim-interval must be >= 0"):
        main(["--malloc-trim-interval", "-1"])


def test_release_pages_gives_back_a_live_tensors_pages_and_keeps_it_usable():
    """``release_pages`` (kept-int4 loading): the tensor's whole pages leave the resident
    set, its address, shape and views stay valid, and it reads as zeros afterwards."""
    import mmap

    import torch

    from common.malloc_tuning import release_pages

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    t = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, every page touched
    ptr, before = t.data_ptr(), rss()
    released = release_pages(t)
    assert released >= t.numel() - 2 * mmap.PAGESIZE
    assert rss() <= before - 48 * (1 << 20)
    assert t.data_ptr() == ptr and t[mmap.PAGESIZE: 1 << 20].sum() == 0  # a partial head page stays
    t[:16].fill_(3)  # and it is still a writable tensor
    assert int(t[:16].sum()) == 48
