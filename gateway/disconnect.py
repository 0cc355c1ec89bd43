"""Notice a client that goes away while its request is still generating.

Falcon only looks at ``http.disconnect`` between SSE events (and not at all for plain
streams), so a request whose client left would keep generating until its next token.
A watcher task reads the ASGI ``receive`` channel once the body has been consumed; on
``http.disconnect`` it aborts the request at once (the engine frees its KV blocks) and,
should the terminal delta not arrive within a grace period, cancels the task relaying it.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Optional

log = logging.getLogger("tokserve.gateway")

RECEIVE_SCOPE_KEY = "tokserve.receive"


def keep_receive_in_scope(app):
    """ASGI wrapper exposing the raw ``receive`` callable to resources via ``req.scope``."""

    async def asgi(scope, receive, send):
        if scope["type"] == "http":
            scope[RECEIVE_SCOPE_KEY] = receive
        await app(scope, receive, send)

    return asgi


class DisconnectWatcher:
    def __init__(self, receive: Optional[Callable[[], Awaitable[dict]]], on_disconnect: Callable[[], Awaitable[None]],
                 grace_s: float = 5.0):
        self._receive = receive
        self._on_disconnect = on_disconnect
        self._grace = grace_s
        self._task: Optional[asyncio.Task] = None
        self._relay: Optional[asyncio.Task] = None
        self.disconnected = False
        self.cancelled_relay = False

    def start(self, relay_task: Optional[asyncio.Task] = None) -> "DisconnectWatcher":
        """Start watching; ``relay_task`` is cancelled if the abort does not end it in time."""
        self._relay = relay_task or asyncio.current_task()
        if self._receive is not None and self._task is None:
            self._task = asyncio.ensure_future(self._watch())
        return self

    async def _watch(self) -> None:
        while True:
            message = await self._receive()
            if message.get("type") == "http.disconnect":
                break
        self.disconnected = True
        try:
            await self._on_disconnect()
        except Exception:  # the broker may be gone as well; the relay still gets cancelled below
            log.warning("abort after client disconnect failed", exc_info=True)
        await asyncio.sleep(self._grace)
        if self._relay is not None and not self._relay.done():
            self.cancelled_relay = True
            self._relay.cancel()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
