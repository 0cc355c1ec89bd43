"""The CPU worker keeps freed activation memory (common/malloc_tuning.py): after the
tuning a freed 24 MB buffer stays resident, so the next step reuses its pages
instead of faulting them in again; without it glibc returns it at once.  What it
keeps is bounded: the worker's PeriodicTrim hands freed heap pages back once its
interval has passed."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest

PROBE = """
import sys
from common.malloc_tuning import keep_freed_memory
tuned = sys.argv[1] == "1" and keep_freed_memory()
import torch  # noqa: E402  (after the tuning, as in the worker)

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

x = torch.ones(6 << 20)  # 24 MB, written: resident
before = rss_mb()
del x
print(int(tuned), round(before - rss_mb()))
"""


@pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0].startswith("glibc"),
                    reason="glibc malloc only")
@pytest.mark.parametrize("tune", [True, False])
def test_freed_buffers_stay_resident_only_when_tuned(tune):
    out = subprocess.run([sys.executable, "-c", PROBE, "1" if tune else "0"], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    tuned, released_mb = int(out[0]), int(out[1])
    assert tuned == int(tune)
    if tune:
        assert released_mb < 4  # kept in the heap
    else:
        assert released_mb > 20  # glibc gave it back (mmapped chunk)


TRIM_PROBE = """
import sys
from common.malloc_tuning import PeriodicTrim, keep_freed_memory
assert keep_freed_memory()

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

class Clock:
    now = 0.0
    def __call__(self):
        return self.now

clock = Clock()
trim = PeriodicTrim(float(sys.argv[1]), clock)
# requests' buffers of many sizes, interleaved with small objects that outlive them (the
# holes a long-running worker's heap fills with): 64 MB freed, the heap top still in use
bufs, keep = [], []
for i in range(64):
    bufs.append(b"x" * ((1 << 20) + 4096 * i))
    keep.append(b"y" * 200)
before = rss_mb()
del bufs
kept = rss_mb()
clock.now = 1e9
trim.tick()
print(round(before - kept), round(kept - rss_mb()), trim.trims)
"""


@pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0].startswith("glibc"),
                    reason="glibc malloc only")
@pytest.mark.parametrize("interval", [60.0, 0.0])
def test_periodic_trim_returns_what_the_tuning_keeps(interval):
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE, str(interval)], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    released_on_free, released_by_trim, trims = (int(x) for x in out)
    assert released_on_free < 8  # the tuning keeps freed memory resident...
    if interval:
        assert trims == 1 and released_by_trim > 48  # ...until the trim gives it back
    else:
        assert trims == 0 and released_by_trim < 8  # interval 0: kept for good
