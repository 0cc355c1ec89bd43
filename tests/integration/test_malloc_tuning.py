"""The CPU worker keeps freed activation memory (common/malloc_tuning.py): after the
tuning a freed 24 MB buffer stays resident, so the next step reuses its pages
instead of faulting them in again; without it glibc returns it at once."""
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
