"""glibc malloc tuning: the CPU worker keeps freed memory, the gateway gives it back.

``keep_freed_memory`` (CPU workers): keep freed activation memory in the process.

A prefill step's activations are tens of MB.  glibc gives large frees back to the
kernel (heap-top trimming, munmap of mmapped chunks), so the next big step faults
every page in again and the kernel zeroes each one: on the small bench model the
first 2048-token prefill after a run of decode steps measured ~300-350 ms instead
of ~250 ms.  vLLM's CPU backend asks users to preload tcmalloc for the same
reason; this is the glibc equivalent from inside the process: the largest mmap
threshold glibc allows (bigger blocks come from the heap) and no trimming.  The
cost is that the worker's resident memory stays at its peak step's, as it would
with tcmalloc.

``return_large_allocations`` and ``trim_freed_memory`` (the gateway, which decodes large
images): the opposite.  A decode
allocates hundreds of MB from the decoding thread's malloc arena; freed, most of it stays
in the arena (glibc returns only the top of the main heap), so one burst of large images
left the gateway at ~2.5 GB for good.  ``malloc_trim(0)`` hands every arena's free pages
back to the kernel.  The request's later buffers (resized image, its bytes, the encoded
wire request: a few MB each with a real processor) are made on the event loop's thread,
where glibc's *dynamic* mmap threshold, raised to 32 MB by the first large free, puts them
on the heap: fixing the threshold sends every such buffer to its own mapping, returned
whole when freed (measured: 3 concurrent 13000x13000 images on /generate left the gateway
at +85 MB without, +0 with; big request bodies and token lists likewise, +20 MB per 20 MiB
token list at a 1 MB threshold, hence 256 KiB).  The gateway sets it once at start-up.

``PeriodicTrim`` (CPU workers): the bound on what ``keep_freed_memory`` keeps.  With no
trimming at all, freed memory the allocator cannot reuse for the next request's
differently sized buffers (holes between live chunks, thread arenas) piled up: a
30-minute soak grew each worker's RSS ~45 MB (~10 %) and it never came back.  A
``malloc_trim(0)`` once a minute hands those free pages back; the only cost is that
the next step faults its activation pages in again once (a few ms on the demo model),
so a worker's RSS stays within one step's working set of what it uses.

``release_pages`` (CPU model loading): hand a tensor's pages back to the kernel while the
tensor keeps its address, shape and storage (views of it stay valid; it reads as zeros
afterwards).  A quantized checkpoint kept int4 on CPU loads each layer dense first and
packs it as soon as its rows are in (quantization/kept.py); the dense copy is still the
model's parameter until the model swaps in the packed one, so it cannot be freed, but
nothing reads it again: releasing its pages keeps the load's peak near the packed model's
size instead of the dense model's.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import threading
from typing import Optional

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for the threshold on 64-bit
TRIM_THRESHOLD = (1 << 31) - 1


@functools.lru_cache(maxsize=None)
def _libc_function(name: str, argtypes: tuple, restype):
    """The C library's ``name`` with its signature set, None where it has none (musl,
    macOS); looked up once: ``find_library`` runs ``ldconfig``, about 2 ms a call."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn


def _mallopt():
    return _libc_function("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)


def keep_freed_memory() -> bool:
    """Tune glibc malloc as above; False (and nothing changed) where the C library
    has no mallopt or refuses (musl, macOS)."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    log.debug("malloc tuning %s", "applied" if ok else "refused")
    return ok


GATEWAY_MMAP_THRESHOLD = 256 << 10


def return_large_allocations(threshold: int = GATEWAY_MMAP_THRESHOLD) -> bool:
    """Allocations of ``threshold`` bytes or more get their own mapping, unmapped on free
    (and glibc stops moving the threshold).  False where mallopt is missing or refuses."""
    mallopt = _mallopt()
    return mallopt is not None and mallopt(M_MMAP_THRESHOLD, threshold) == 1


_PAGE = mmap.PAGESIZE
MADV_DONTNEED = 4  # Linux's value (sys/mman.h)


def release_pages(t) -> int:
    """``madvise(MADV_DONTNEED)`` on the whole pages inside CPU tensor ``t``'s bytes (its
    contents become zeros); the bytes released, 0 where the C library has no madvise."""
    madvise = _libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int)
    if madvise is None:
        return 0
    start = t.data_ptr()
    first = -(-start // _PAGE) * _PAGE  # only pages wholly inside: the allocator's headers stay
    last = (start + t.numel() * t.element_size()) // _PAGE * _PAGE
    if last <= first or madvise(first, last - first, MADV_DONTNEED) != 0:
        return 0
    return last - first


_trim_lock = threading.Lock()


def _malloc_trim():
    return _libc_function("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)  # None: not glibc, nothing to trim with


def can_trim() -> bool:
    """Whether this C library has glibc's malloc_trim."""
    return bool(_malloc_trim())


def trim_freed_memory() -> Optional[bool]:
    """glibc ``malloc_trim(0)``: free pages of every arena back to the kernel.  True when
    something was released, False when nothing was, None without glibc.  Costs a walk of
    the arenas (about a millisecond per GB of free memory): callers rate-limit it."""
    fn = _malloc_trim()
    if not fn:
        return None
    with _trim_lock:  # concurrent trims would only walk the same arenas twice
        return bool(fn(0))


class PeriodicTrim:
    """``trim_freed_memory()`` at most once per ``interval`` seconds, from the caller's
    loop (the worker's engine loop between steps: never while a step's buffers are
    live).  ``interval`` 0 or a C library without malloc_trim: never."""

    def __init__(self, interval: float, clock=None):
        import time

        self.interval = interval
        self._clock = clock or time.monotonic
        self._next = self._clock() + interval
        self.enabled = interval > 0 and can_trim()
        self.trims = 0

    def tick(self) -> None:
        if not self.enabled:
            return
        now = self._clock()
        if now < self._next:
            return
        self._next = now + self.interval
        trim_freed_memory()
        self.trims += 1
