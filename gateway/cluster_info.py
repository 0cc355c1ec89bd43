"""Cached view of the cluster (model limits, live workers) taken from the broker.

Every request needs the model limits and the live worker ranks; asking the broker on
each request would add a round trip, so the answer is kept ``ttl`` seconds and
concurrent refreshes share one in-flight query.  An answer without a model (no
worker registered yet) is not kept: the first worker must be usable at once from
every gateway, not up to ``ttl`` later from the ones that asked before it came.
"""
from __future__ import annotations

import asyncio
import time
from typing import Optional

from common.errors import Overloaded
from common.protocol import ClusterInfo, ModelInfo


def _consume_exception(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # waiters re-raise it; this keeps asyncio from logging it as lost


class ClusterInfoCache:
    def __init__(self, client, ttl: float = 1.0, timeout: float = 2.0):
        self._client = client
        self._ttl = ttl
        self._timeout = timeout
        self._info: Optional[ClusterInfo] = None
        self._fetched_at = -1e9
        self._inflight: Optional[asyncio.Future] = None
        self._inflight_started = -1e9

    async def get(self) -> ClusterInfo:
        """The cached ClusterInfo; raises Overloaded (503) when the broker does not answer."""
        info = self._info
        if info is not None and info.model is not None and time.monotonic() - self._fetched_at < self._ttl:
            return info
        if self._inflight is None or self._inflight.done():  # a failed refresh is retried
            self._start_refresh()
        # shield: a waiter that gets cancelled must not cancel the query the others share.
        return await asyncio.shield(self._inflight)

    def _start_refresh(self) -> None:
        self._inflight = asyncio.ensure_future(self._refresh())
        self._inflight.add_done_callback(_consume_exception)
        self._inflight_started = time.monotonic()

    async def _refresh(self) -> ClusterInfo:
        try:
            info = await self._client.info(timeout=self._timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # timeout or broker error: the cluster is unreachable
            raise Overloaded(f"The inference cluster is not reachable: {exc or type(exc).__name__}") from exc
        self._info, self._fetched_at = info, time.monotonic()
        return info

    async def fresh(self) -> ClusterInfo:
        """An answer the broker gave after this call began: callers that arrive while
        such a query is in flight share it."""
        asked = time.monotonic()
        if self._inflight is None or self._inflight.done() or self._inflight_started < asked:
            self._start_refresh()
        return await asyncio.shield(self._inflight)

    def invalidate(self) -> None:
        """The next get() asks the broker (after a change made through this gateway)."""
        self._fetched_at = -1e9

    async def model(self) -> ModelInfo:
        """Model limits; 503 while no worker has registered a model yet."""
        info = await self.get()
        if info.model is None:
            raise Overloaded("No inference worker is available yet.")
        return info.model

