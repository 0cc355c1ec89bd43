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

The worker may run as root, so the file is written the way nobody else can redirect:
its folder must be writable by the worker's user (or root) only (``check_location``:
in a shared folder such as /tmp another user could plant a symlink where we write, or
swap the file), the path must not be a symlink, and each write goes to a fresh
random-named file (``mkstemp``: O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600) renamed over PATH,
which replaces whatever PATH is rather than writing through it.
"""
from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

# A broker heartbeats its workers every second by default, and declares one dead after
# three missed beats; a probe allowing five seconds tolerates a slow beat or two.
DEFAULT_MAX_AGE_S = 5.0


def check_location(path: str | os.PathLike) -> None:
    """ValueError unless ``path`` is a safe place for the ready file: not a symlink, in
    an existing folder that only we (or root) own and nobody else can write to."""
    path = Path(path)
    folder = path.parent
    hint = ("put it in a folder only this user can write, e.g. the private runtime directory "
            "($TOKSERVE_RUNTIME_DIR/worker.ready)")
    try:
        st = os.stat(folder)
    except OSError as exc:
        raise ValueError(f"--ready-file {path}: cannot use folder {folder}: {exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"--ready-file {path}: {folder} is not a directory")
    if st.st_uid not in (os.getuid(), 0):
        raise ValueError(f"--ready-file {path}: folder {folder} belongs to uid {st.st_uid}, who could swap the file "
                         f"for a symlink; {hint}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"--ready-file {path}: folder {folder} (mode {stat.S_IMODE(st.st_mode):04o}) is writable by "
                         f"other users, who could plant a symlink where the worker writes; {hint}")
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            raise ValueError(f"--ready-file {path} is a symlink: the worker replaces the file it names, never "
                             f"writes through a link; remove it or name the real path")
    except FileNotFoundError:
        pass


class ReadyFile:
    """The worker's side: ``mark()`` on each broker heartbeat, ``clear()`` when disowned,
    ``retire()`` for good (drain, exit).  Called from the worker's IO thread, and
    ``retire()`` from its main thread: a lock keeps a late ``mark()`` from recreating the
    file after ``retire()``."""

    def __init__(self, path: str | os.PathLike, **identity):
        check_location(path)
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
                    os.utime(self.path, follow_symlinks=False)  # one syscall per heartbeat once it exists
                    return
                except FileNotFoundError:
                    pass  # removed behind our back: write it again
            self._write()

    def _write(self) -> None:
        body = json.dumps({"pid": os.getpid(), **self.identity}).encode()
        # A name nobody can predict, created exclusively without following links (no
        # pre-planted symlink redirects the write), then renamed over PATH: readers never
        # see a half-written file, and a link at PATH is replaced, not followed.
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        try:
            try:
                os.write(fd, body)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
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
