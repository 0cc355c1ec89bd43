"""Compiled grammars: a bounded LRU cache in front of a compile thread pool.

Compiling a JSON schema takes milliseconds to seconds, so it never runs on the
engine's step loop (vLLM's StructuredOutputManager does the same with its executor):
``submit`` hands a missing key to the pool and returns a Future; requests for a key
already compiling share its Future.  The cache is bounded by entries and by the
compiled grammars' own size (``memory_size_bytes``); the least recently used go first.
Queued compiles are bounded too (``Overloaded`` past it), so clients cannot pile up
unbounded compiler work.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

from common.errors import Overloaded
from worker.engine.structured_output.spec import PARAM, GrammarKey

DEFAULT_MAX_ENTRIES = 512
DEFAULT_MAX_BYTES = 512 * 1024 * 1024
DEFAULT_MAX_PENDING = 256


class GrammarCache:
    def __init__(self, compile_fn: Callable[[GrammarKey], Any], *, workers: int = 1,
                 max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_pending: int = DEFAULT_MAX_PENDING):
        self._compile = compile_fn
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_pending = max_pending
        self._entries: "OrderedDict[GrammarKey, tuple[Any, int]]" = OrderedDict()
        self._bytes = 0
        self._pending: dict[GrammarKey, Future] = {}
        self._lock = threading.Lock()  # the pool's done-callbacks insert; the engine thread reads
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar-compile")
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def get(self, key: GrammarKey) -> Optional[Any]:
        """The compiled grammar when cached (now the most recently used), else None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def submit(self, key: GrammarKey) -> Future:
        """A Future of ``key``'s compiled grammar (a cached one is returned done)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                done: Future = Future()
                done.set_result(entry[0])
                return done
            future = self._pending.get(key)
            if future is not None:
                return future
            if len(self._pending) >= self.max_pending:
                raise Overloaded(f"{PARAM}: {len(self._pending)} grammars are being compiled on this worker "
                                 f"(the limit); retry later", PARAM)
            self.misses += 1
            future = self._pool.submit(self._run, key)
            self._pending[key] = future
        return future

    def _run(self, key: GrammarKey) -> Any:
        """In the pool: compile, and cache before the Future resolves (whoever sees it
        done finds the entry)."""
        try:
            compiled = self._compile(key)
        except BaseException:
            with self._lock:  # failures are not cached: the next request gets the compiler's reason again
                self._pending.pop(key, None)
            raise
        with self._lock:
            self._pending.pop(key, None)
            self._insert(key, compiled)
        return compiled

    def _insert(self, key: GrammarKey, compiled: Any) -> None:
        """(under the lock) keep ``compiled``, evicting the least recently used past the bounds."""
        size = int(getattr(compiled, "memory_size_bytes", 0) or 0)
        if size > self.max_bytes:
            return  # larger than the whole cache: used by its requests, not kept
        self._entries[key] = (compiled, size)
        self._bytes += size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self._bytes -= evicted

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
