"""Debug aid for memory growth: a daemon thread that logs, every N seconds, glibc's
allocator totals (``mallinfo2``) and, optionally, the Python allocations that grew most
since the first snapshot (``tracemalloc``).

    TOKSERVE_MEMORY_REPORT_S=60 tokserve serve ...          # mallinfo2 once a minute per process
    TOKSERVE_MEMORY_REPORT_S=60 TOKSERVE_TRACEMALLOC=1 ...  # plus the top Python growth sites

It tells the three kinds of growth apart: Python objects kept (tracemalloc grows),
C allocations kept (``in_use`` grows), or freed memory the allocator holds on to
(``free`` grows, ``in_use`` flat: fragmentation / no trimming).  Off by default:
tracemalloc slows every allocation.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time
from typing import Optional

log = logging.getLogger(__name__)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def mallinfo2() -> Optional[dict]:
    """glibc's allocator totals in bytes: ``heap`` (sbrk + arena heaps), ``mmapped``
    (chunks with their own mapping), ``in_use`` and ``free`` (inside the heaps); None
    without glibc >= 2.33."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    info = fn()
    return {"heap": info.arena, "mmapped": info.hblkhd, "in_use": info.uordblks, "free": info.fordblks}


def _report(label: str, interval: float, traced: bool) -> None:
    import tracemalloc

    first = tracemalloc.take_snapshot() if traced else None
    while True:
        time.sleep(interval)  # a periodic report, not a wait for a state
        info = mallinfo2() or {}
        log.warning("memory %s pid %d: %s", label, os.getpid(),
                    ", ".join(f"{k} {v / 2**20:.1f} MB" for k, v in info.items()))
        if first is not None:
            stats = tracemalloc.take_snapshot().compare_to(first, "lineno")
            total = sum(s.size_diff for s in stats)
            log.warning("memory %s pid %d: python %+.1f MB since start; top growth:\n  %s", label, os.getpid(),
                        total / 2**20, "\n  ".join(str(s) for s in stats[:12]))


def start_from_env(label: str) -> bool:
    """Start the report thread when TOKSERVE_MEMORY_REPORT_S is set; True if started."""
    interval = float(os.environ.get("TOKSERVE_MEMORY_REPORT_S") or 0)
    if interval <= 0:
        return False
    traced = os.environ.get("TOKSERVE_TRACEMALLOC", "") not in ("", "0")
    if traced:
        import tracemalloc

        tracemalloc.start(4)
    threading.Thread(target=_report, args=(label, interval, traced), name="memory-report", daemon=True).start()
    return True
