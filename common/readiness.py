"""A worker's readiness as the broker sees it, for orchestrators' probes (Kubernetes exec
readiness probe, a supervisor's health check).

A worker started with ``--ready-file PATH`` keeps PATH fresh while the broker
acknowledges it: the broker heartbeats only the workers it registered (a READY with the
right worker token, a rank nobody else holds), so every heartbeat it sends this worker
touches the file, and the worker removes it when the broker disowns it (DISCONNECT), goes
silent for a liveness period, or the worker drains or stops.

``tokserve worker-ready PATH --max-age S`` (the probe) succeeds only when the file exists,
was touched within S seconds and names a live process.  Freshness is what makes this
robust: a worker whose IO thread or whole process hangs or is killed stops touching the
file, and a broker that vanishes stops the heartbeats that touch it, so the probe fails
within S seconds in every case without the probe itself talking to the broker (which
would need the broker's address, keys and a network path from every worker pod).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Optional

# A broker heartbeats its workers every second by default, and declares one dead after
# three missed beats; a probe allowing five seconds tolerates a slow beat or two.
DEFAULT_MAX_AGE_S = 5.0


class ReadyFile:
    """The worker's side: ``mark()`` on each broker heartbeat, ``clear()`` when disowned,
    ``retire()`` for good (drain, exit).  Called from the worker's IO thread, and
    ``retire()`` from its main thread: a lock keeps a late ``mark()`` from recreating the
    file after ``retire()``."""

    def __init__(self, path: str | os.PathLike, **identity):
        self.path = Path(path)
        self.identity = identity  # written into the file for people reading it (rank, broker)
        self._lock = threading.Lock()
        self._written = False
        self._retired = False

    def mark(self) -> None:
        with self._lock:
            if self._retired:
                return
            if self._written:
                try:
                    os.utime(self.path)  # one syscall per heartbeat once the file exists
                    return
                except FileNotFoundError:
                    pass  # removed behind our back: write it again
            self._write()

    def _write(self) -> None:
        body = json.dumps({"pid": os.getpid(), **self.identity}).encode()
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, body)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)  # readers never see a half-written file
        self._written = True

    def clear(self) -> None:
        with self._lock:
            self._unlink()

    def retire(self) -> None:
        with self._lock:
            self._retired = True
            self._unlink()

    def _unlink(self) -> None:
        self._written = False
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def check(path: str | os.PathLike, max_age: float = DEFAULT_MAX_AGE_S, now: Optional[float] = None) -> tuple[bool, str]:
    """(ready, why) for the probe: fresh file naming a live process."""
    path = Path(path)
    try:
        st = path.stat()
        data = json.loads(path.read_bytes() or b"{}")
    except FileNotFoundError:
        return False, f"{path} does not exist: the broker has not acknowledged this worker (or disowned it)"
    except (OSError, ValueError) as exc:
        return False, f"cannot read {path}: {exc}"
    age = (time.time() if now is None else now) - st.st_mtime
    if age > max_age:
        return False, f"{path} is {age:.1f}s old (> {max_age:g}s): no broker heartbeat reached the worker lately"
    pid = data.get("pid") if isinstance(data, dict) else None
    if not isinstance(pid, int) or pid <= 0:
        return False, f"{path} names no worker process"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False, f"worker pid {pid} named in {path} is gone"
    except PermissionError:
        pass  # alive, another user's: the freshness check above still holds
    return True, f"ready: worker pid {pid} acknowledged by the broker {age:.1f}s ago"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="tokserve worker-ready",
                                description="readiness probe: exit 0 while the broker acknowledges the worker that "
                                            "writes FILE (tokserve worker --ready-file FILE), else 1")
    p.add_argument("file")
    p.add_argument("--max-age", type=float, default=DEFAULT_MAX_AGE_S,
                   help="seconds since the last broker heartbeat the worker saw (default %(default)s)")
    p.add_argument("--quiet", action="store_true", help="print nothing")
    args = p.parse_args(argv)
    ready, why = check(args.file, args.max_age)
    if not args.quiet:
        print(why, file=sys.stdout if ready else sys.stderr)
    return 0 if ready else 1


if __name__ == "__main__":
    sys.exit(main())
