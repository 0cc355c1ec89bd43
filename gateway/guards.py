"""Connection and request guards around the ASGI app: slow clients and big requests.

uvicorn closes idle keep-alive connections but has no deadline for a request's headers
or body: 20 slow-loris connections trickling a byte at a time were held for as long as
they trickled.  Here

- ``guarded_protocol``: uvicorn's httptools protocol with a deadline for a request's
  headers (from its first byte, or from the connection's start) and a cap on their
  size; past either the client gets 408 / 431 and the connection is closed;
- ``guard_requests``: an ASGI wrapper with a deadline for the body (408, connection
  closed; gateway/body.py turns the timeout into the response), which also asks the
  ``MemoryTrimmer`` for a trim once a big request has been answered.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Optional

from common.errors import ServingError
from gateway.render_pool import MemoryTrimmer

log = logging.getLogger("tokserve.gateway")

# A request with a body at least this big is followed by a malloc_trim (rate-limited).
TRIM_AFTER_BODY_BYTES = 1 << 20


class RequestTimeout(ServingError):
    """The body did not arrive in time: 408, and the connection is closed (errors.py)."""

    status = 408
    type = "RequestTimeoutError"


def guard_requests(app, body_timeout_s: Optional[float], trimmer: Optional[MemoryTrimmer]):
    async def asgi(scope, receive, send):
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + body_timeout_s if body_timeout_s else None
        state = {"done": False, "bytes": 0}

        async def guarded_receive():
            if state["done"] or deadline is None:
                message = await receive()
            else:
                remaining = deadline - loop.time()
                try:
                    if remaining <= 0:
                        raise asyncio.TimeoutError
                    message = await asyncio.wait_for(receive(), remaining)
                except asyncio.TimeoutError:
                    state["done"] = True  # the watcher of a disconnect may still read on
                    raise RequestTimeout(f"The request body did not arrive within {body_timeout_s:g} s "
                                         f"(--body-read-timeout).") from None
            if message.get("type") == "http.request":
                state["bytes"] += len(message.get("body", b""))
                if not message.get("more_body", False):
                    state["done"] = True
            else:
                state["done"] = True
            return message

        try:
            await app(scope, guarded_receive, send)
        finally:
            # The request's objects are gone now: a trim gives their pages back.
            if trimmer is not None and state["bytes"] >= TRIM_AFTER_BODY_BYTES:
                trimmer.request()

    return asgi


def guarded_protocol(header_timeout_s: Optional[float], max_header_bytes: Optional[int]):
    """uvicorn's HttpToolsProtocol with a header deadline and size cap (None: off)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer: Optional[asyncio.TimerHandle] = None
            self._header_bytes = 0
            self._awaiting_headers = False
            self._begun = False  # a request's first byte has arrived, its headers have not
            # A connection that never sends a byte is held to the same deadline:
            # uvicorn arms its keep-alive timer only after a first response.
            self._await_headers()

        def _await_headers(self) -> None:
            if not self._awaiting_headers:
                self._awaiting_headers = True
                self._header_bytes = 0
            if header_timeout_s and self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _headers_arrived(self) -> None:
            self._awaiting_headers = False
            self._begun = False
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def on_message_begin(self) -> None:
            # The next request's first byte; between requests the connection is idle
            # and uvicorn's keep-alive timer is what closes it.
            super().on_message_begin()
            self._await_headers()
            self._begun = True

        def on_headers_complete(self) -> None:
            self._headers_arrived()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()
            if cycle is not None and cycle.more_body and not self.transport.is_closing():
                # Answered before its body was read (a 404, a 405): the rest of the body
                # may trickle in forever, each byte resetting uvicorn's keep-alive timer.
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._awaiting_headers:
                self._header_bytes += len(data)
            super().data_received(data)
            if (self._awaiting_headers and max_header_bytes and self._header_bytes > max_header_bytes
                    and not self.transport.is_closing()):
                self._refuse(431, "Request Header Fields Too Large",
                             f"request headers over {max_header_bytes} bytes (--max-header-bytes)")

        def connection_lost(self, exc) -> None:
            self._headers_arrived()
            super().connection_lost(exc)

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self._awaiting_headers or self.transport.is_closing():
                return
            if not self._begun:
                # Never sent a byte (a pre-opened pooled connection): close quietly, as the
                # keep-alive timeout does; an unasked-for 408 could be read as the answer
                # to the request a client sends on it next.
                self.transport.close()
            else:
                self._refuse(408, "Request Timeout",
                             f"request headers not received within {header_timeout_s:g} s (--header-read-timeout)")

        def _refuse(self, status: int, phrase: str, message: str) -> None:
            from gateway.errors import error_json

            log.info("closing connection from %s: %s", self.client, message)
            body = error_json(message, phrase.replace(" ", "") + "Error", status)
            head = (f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode("ascii")
            self._awaiting_headers = False
            self.transport.write(head + body)
            self.transport.close()

    return GuardedHttpToolsProtocol
