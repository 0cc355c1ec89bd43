"""Where the gateway's CPU-heavy text work runs: tokenizing, chat-template rendering,
detokenizing and encoding large responses.

On the event loop one 7 MB ``/tokenize`` prompt stalled every other request (``/health``
included) for 13 s.  Here such work runs on a bounded pool of threads: the tokenizer
releases the GIL while it encodes and Jinja yields it every switch interval, so the loop
keeps answering.  Jobs beyond ``workers + queue`` are refused with 503 instead of piling
up (each holds its request body), and after big requests glibc is asked to give the
freed heap back to the kernel (``MemoryTrimmer``).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import gc
import logging
import os
import time
from collections import deque
from typing import Any, Callable, Iterator, Optional

from common import malloc_tuning
from common.errors import Overloaded

log = logging.getLogger("tokserve.gateway")


def default_render_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


class RenderPool:
    """``workers`` threads; at most ``workers + queue`` jobs admitted (running or
    waiting), the rest get 503.  Each job also carries a ``weight``, the size of its
    request body: jobs run together only while their weights add up to at most
    ``weight_budget`` (the gateway passes --max-prompt-chars), because tokenizing
    costs ~200 bytes of memory per character (a 10 MB chat peaked at 2.5 GB), so
    several big prompts at once could exhaust the machine.  A job heavier than the
    budget runs alone.  Heavy jobs wait first come, first served; light ones (up to
    budget/8) do not wait for them."""

    def __init__(self, workers: int, queue: int, weight_budget: int = 8 * 1024 * 1024):
        self.workers = workers
        self.queue = queue
        self.weight_budget = weight_budget
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="tokserve-render")
        self._pending = 0  # jobs admitted and not finished: waiting for weight, queued or running
        self._weight = 0  # weight of the jobs submitted to the executor and not finished
        self._waiters: deque = deque()  # (weight, future) of jobs waiting for weight, in arrival order
        self._loop: Optional[asyncio.AbstractEventLoop] = None  # the gateway's, for hold() from threads

    @property
    def pending(self) -> int:
        return self._pending

    def _weighed(self, weight: int) -> int:
        # Light jobs (most requests) are not weighed, so they never wait behind a heavy
        # one; their memory is bounded by workers x budget/8 anyway.
        return min(weight, self.weight_budget) if weight > self.weight_budget // 8 else 0

    @contextlib.contextmanager
    def hold(self, weight: int) -> Iterator[None]:
        """Called from inside a job (a pool thread) that learns its weight only part-way:
        a chat render, whose prompt is known once the template has run and which may be
        refused then, before its heavy step (tokenizing).  Such a job enters the pool
        light, so that its refusal does not queue behind heavy jobs (an over-long 8 MB chat
        waited 100 s behind six 7 MB /tokenize calls for its 400), and takes the weight
        here, waiting as a job admitted with it would."""
        weight = self._weighed(weight)
        if weight == 0 or self._loop is None:
            yield
            return
        asyncio.run_coroutine_threadsafe(self._admit(weight), self._loop).result()
        try:
            yield
        finally:
            self._loop.call_soon_threadsafe(self._release, weight)

    def _release(self, weight: int) -> None:
        self._weight -= weight
        self._wake()

    async def run(self, fn: Callable[..., Any], *args, weight: int = 0, **kwargs) -> Any:
        if self._pending >= self.workers + self.queue:
            raise Overloaded(f"The gateway's render queue is full ({self.workers} workers, {self.queue} queued: "
                             f"--render-workers, --render-queue); retry later.")
        self._loop = asyncio.get_running_loop()
        weight = self._weighed(weight)
        self._pending += 1
        try:
            await self._admit(weight)
        except BaseException:
            self._pending -= 1
            raise
        loop = asyncio.get_running_loop()
        try:
            future = self._executor.submit(functools.partial(fn, *args, **kwargs))
        except BaseException:
            self._finished(weight)
            raise
        # Released when the thread is done with it, not when the awaiting request goes
        # away: a cancelled request's job may still be running.
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._finished, weight))
        return await asyncio.wrap_future(future)

    async def _admit(self, weight: int) -> None:
        if weight == 0:
            return
        if not self._waiters and self._weight + weight <= self.weight_budget:
            self._weight += weight
            return
        granted = asyncio.get_running_loop().create_future()
        self._waiters.append((weight, granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self._weight -= weight  # granted just as the request went away
            self._wake()  # a cancelled waiter at the head no longer holds the others back
            raise

    def _wake(self) -> None:
        while self._waiters:
            weight, granted = self._waiters[0]
            if granted.done():
                self._waiters.popleft()
                continue
            if self._weight + weight > self.weight_budget:
                break
            self._waiters.popleft()
            self._weight += weight
            granted.set_result(None)

    def _finished(self, weight: int) -> None:
        self._pending -= 1
        self._weight -= weight
        self._wake()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class MemoryTrimmer:
    """glibc keeps freed memory in the process: after a 20 MiB body the gateway stayed at
    3.1 GB.  ``request()`` after a big request has finished runs ``malloc_trim(0)``
    (which returns free heap pages to the kernel) in a thread, at most once per
    ``min_interval_s``; a request during that interval gets one trim at its end, so the
    last big request is always followed by a trim, and by one more ``followup_s``
    later: a big answer may still sit in the socket's write buffer at the first one
    (measured: after a 7 MB /tokenize, 100 MB resident instead of the idle 65 MB until
    the next trim).  The gateway's other half of this is common/malloc_tuning.py's
    ``return_large_allocations`` (set once at start-up); the CPU worker tunes malloc the
    other way, in another process."""

    def __init__(self, min_interval_s: float = 1.0, followup_s: float = 2.0):
        self.min_interval_s = min_interval_s
        self.followup_s = followup_s
        self._enabled = malloc_tuning.can_trim()
        self._last = 0.0
        self._scheduled = False
        self._followup = False
        self.trims = 0

    def request(self) -> None:
        self._followup = True
        if not self._enabled or self._scheduled:
            return
        self._scheduled = True
        delay = max(0.0, self._last + self.min_interval_s - time.monotonic())
        asyncio.get_running_loop().call_later(delay, self._fire)

    def _fire(self) -> None:
        self._scheduled = False
        self._last = time.monotonic()
        loop = asyncio.get_running_loop()
        # ctypes drops the GIL for the call; a trim of a big heap takes milliseconds.
        loop.run_in_executor(None, self._run)
        if self._followup:
            self._followup = False
            self._scheduled = True
            loop.call_later(self.followup_s, self._fire)

    def _run(self) -> None:
        # A refused request's objects (millions of ints for a long token list) can sit in
        # reference cycles (an exception's traceback frames) that only a collection
        # frees: measured, without this collect the RSS stayed 100+ MB up.
        gc.collect()
        malloc_tuning.trim_freed_memory()
        self.trims += 1
