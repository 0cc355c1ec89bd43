"""Keep the CPU worker's freed activation memory in the process (glibc malloc).

A prefill step's activations are tens of MB.  glibc gives large frees back to the
kernel (heap-top trimming, munmap of mmapped chunks), so the next big step faults
every page in again and the kernel zeroes each one: on the small bench model the
first 2048-token prefill after a run of decode steps measured ~300-350 ms instead
of ~250 ms.  vLLM's CPU backend asks users to preload tcmalloc for the same
reason; this is the glibc equivalent from inside the process: the largest mmap
threshold glibc allows (bigger blocks come from the heap) and no trimming.  The
cost is that the worker's resident memory stays at its peak step's, as it would
with tcmalloc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for the threshold on 64-bit
TRIM_THRESHOLD = (1 << 31) - 1


def keep_freed_memory() -> bool:
    """Tune glibc malloc as above; False (and nothing changed) where the C library
    has no mallopt or refuses (musl, macOS)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    log.debug("malloc tuning %s", "applied" if ok else "refused")
    return ok
