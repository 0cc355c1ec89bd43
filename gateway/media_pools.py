"""The gateway's image work, off the event loop and out of the default thread pool.

Two pools, sized by flags, so that neither can starve the other or the rest of the
gateway (asyncio's default pool serves everything else ``to_thread`` runs):

* fetch (``--media-fetch-threads``): http(s) downloads.  Each fetch has one deadline
  (``--image-fetch-timeout``) that counts from submission, so time spent queued behind
  slow servers counts too and a saturated pool fails fetches fast instead of piling them up.
* decode (``--image-decode-threads``): reading data:/file: images, the header checks and
  the pixel work (decode + resize).  At most ``--image-decode-queue`` requests wait for a
  thread; past that the request gets a 503 at once rather than queueing unbounded memory
  (each waiting request holds its encoded images).

After a job that decoded many pixels the freed memory goes back to the kernel
(``malloc_trim``), when no other large decode is running (it would only grow the arenas
again) or at most every ``TRIM_INTERVAL_S`` under steady load.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Callable
from urllib.parse import urlsplit

from common.errors import BadRequest, Overloaded
from common.malloc_tuning import trim_freed_memory
from common.multimodal import FetchPolicy, parse_networks, read_image_bytes

# A decode job of at least this many pixels trims afterwards: smaller ones free memory
# that glibc reuses for the next request anyway.
TRIM_MIN_PIXELS = 4_000_000
TRIM_INTERVAL_S = 5.0
# The asyncio side waits this much past the fetch deadline for the thread's own timeout
# to report, before answering without it.
FETCH_GRACE_S = 1.0


class MediaPools:
    def __init__(self, settings):
        self.settings = settings
        self.decode_threads = settings.image_decode_threads
        self.decode_queue = settings.image_decode_queue
        self.decoder = concurrent.futures.ThreadPoolExecutor(self.decode_threads, thread_name_prefix="image-decode")
        self.fetcher = concurrent.futures.ThreadPoolExecutor(settings.media_fetch_threads,
                                                             thread_name_prefix="media-fetch")
        self.policy = FetchPolicy(allow_remote=settings.allow_remote_media,
                                  allowed_domains=tuple(settings.allowed_media_domains),
                                  private_networks=parse_networks(settings.media_private_networks),
                                  timeout_s=settings.image_fetch_timeout_s)
        self.max_bytes = settings.max_image_bytes
        # --max-image-decoded-pixels replaces Pillow's own bomb check (a warning past 89 M
        # pixels, an error past 179 M with Pillow's numbers): ours runs on the header before
        # any decode and names the flag, whatever the operator set it to.
        from PIL import Image

        Image.MAX_IMAGE_PIXELS = None
        self._lock = threading.Lock()
        self._decode_jobs = 0  # submitted and not finished (running or queued)
        self._running = 0  # decode jobs running now
        self._last_trim = 0.0

    # ------------------------------------------------------------------ fetch

    async def fetch_remote(self, urls: list[str], where: str) -> dict[int, bytes]:
        """The http(s) URLs' bytes, fetched concurrently: ``{index: bytes}`` (400 on the
        first failure, the others cancelled)."""
        remote = [i for i, url in enumerate(urls) if is_remote(url)]
        if not remote or not self.policy.allow_remote:
            return {}  # without --allow-remote-media read_image_bytes refuses them by name
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.policy.timeout_s
        futures = [loop.run_in_executor(self.fetcher, self._fetch, i, urls[i], deadline) for i in remote]
        try:
            done = await asyncio.wait_for(asyncio.gather(*futures), self.policy.timeout_s + FETCH_GRACE_S)
        except asyncio.TimeoutError:
            raise BadRequest(f"{where}: fetching the image URLs timed out after {self.policy.timeout_s:g} s "
                             "(--image-fetch-timeout)", where) from None
        except _IndexedError as exc:
            raise BadRequest(f"{where}[{exc.index}]: {exc.error}", f"{where}[{exc.index}]") from None
        finally:
            for fut in futures:
                fut.cancel()  # queued ones never start; running ones end by their deadline
        return dict(zip(remote, done))

    def _fetch(self, index: int, url: str, deadline: float) -> bytes:
        try:
            return read_image_bytes(url, allowed_local_media_path=None, policy=self.policy,
                                    max_bytes=self.max_bytes, deadline=deadline)
        except ValueError as exc:  # MediaError, or urlsplit's on a malformed URL
            raise _IndexedError(index, exc) from None

    # ------------------------------------------------------------------ decode

    async def decode(self, job: Callable[[], tuple[list, int]]):
        """Run ``job`` (returns ``(result, pixels decoded)``) on the decode pool."""
        with self._lock:
            if self._decode_jobs >= self.decode_threads + self.decode_queue:
                raise Overloaded(f"Image decoding is at capacity ({self.decode_threads} thread(s) busy and "
                                 f"{self.decode_queue} request(s) waiting: --image-decode-threads, "
                                 "--image-decode-queue); retry later.")
            self._decode_jobs += 1
        try:
            future = self.decoder.submit(self._run, job)
        except BaseException:
            self._job_done()
            raise
        future.add_done_callback(lambda _f: self._job_done())
        return await asyncio.wrap_future(future)  # cancelled while queued: the job never runs

    def _job_done(self) -> None:
        with self._lock:
            self._decode_jobs -= 1

    def _run(self, job):
        with self._lock:
            self._running += 1
        pixels = 0
        try:
            result, pixels = job()
            return result
        finally:
            with self._lock:
                self._running -= 1
                now = time.monotonic()
                trim = pixels >= TRIM_MIN_PIXELS and (self._running == 0
                                                     or now - self._last_trim >= TRIM_INTERVAL_S)
                if trim:
                    self._last_trim = now
            if trim:
                trim_freed_memory()


class _IndexedError(Exception):
    def __init__(self, index, error):
        super().__init__(str(error))
        self.index, self.error = index, error


def is_remote(url) -> bool:
    """An http(s) URL, as media.read_image_bytes tells them apart (vLLM: scheme starts with http)."""
    if not isinstance(url, str) or url[:5].lower() == "data:":
        return False
    try:
        return urlsplit(url).scheme.lower().startswith("http")
    except ValueError:  # malformed: read_image_bytes says why, in the decode job
        return False


_POOLS: dict[int, MediaPools] = {}
_POOLS_LOCK = threading.Lock()


def media_pools(settings) -> MediaPools:
    """The pools of this settings object (one per gateway process; tests build several)."""
    with _POOLS_LOCK:
        pools = _POOLS.get(id(settings))
        if pools is None or pools.settings is not settings:
            pools = MediaPools(settings)
            _POOLS[id(settings)] = pools
        return pools
