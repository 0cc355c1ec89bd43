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
from gateway.connection_limits import ConnectionLimiter, is_probe_path
from gateway.render_pool import MemoryTrimmer

log = logging.getLogger("tokserve.gateway")

# Seconds a refused connection (408, 431, 503) is read from and discarded before it is closed.
LINGER_S = 2.0
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


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a request refused mid-way (431, 503);
    httptools wraps it, uvicorn's data_received catches it and calls send_400_response,
    where the refusal is sent instead."""


def guarded_protocol(header_timeout_s: Optional[float], max_header_bytes: Optional[int],
                     idle_timeout_s: Optional[float] = None, limiter: Optional[ConnectionLimiter] = None):
    """uvicorn's HttpToolsProtocol with a header deadline and size cap (None: off), a
    deadline for a new connection's first byte (``idle_timeout_s``, the keep-alive
    timeout: a connection that never sends is as idle as a kept-alive one) and the
    open-connection caps of ``limiter`` (gateway/connection_limits.py)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer: Optional[asyncio.TimerHandle] = None
            self._header_bytes = 0  # raw bytes of the unfinished header section
            self._parsed_header_bytes = 0  # request line and headers parsed so far
            self._awaiting_headers = False
            self._begun = False  # a request's first byte has arrived, its headers have not
            self._refusal: Optional[tuple[int, str, str]] = None
            self._probe_only = False
            self._discarding = False
            if limiter is not None:
                verdict = limiter.admit(self, self.client[0] if self.client else None)
                if verdict == "refuse":
                    # Once per 1000: a flood of refused connections must not flood the log too.
                    log_refusal = log.warning if limiter.refused % 1000 == 1 else log.debug
                    log_refusal("connection from %s refused: %d connections open (--limit-concurrency %d, "
                                "--limit-concurrency-per-peer %d; %d refused so far)", self.client, limiter.open_connections,
                                limiter.max_connections, limiter.max_per_peer, limiter.refused)
                    transport.close()
                    return
                self._probe_only = verdict == "probe"
            # A connection that never sends a byte is held to a deadline too: uvicorn
            # arms its keep-alive timer only after a first response.
            self._await_headers(idle_timeout_s or header_timeout_s)

        def _await_headers(self, timeout_s: Optional[float]) -> None:
            if not self._awaiting_headers:
                self._awaiting_headers = True
                self._header_bytes = 0
                self._parsed_header_bytes = 0
            if timeout_s and self._header_timer is None:
                self._header_timer = self.loop.call_later(timeout_s, self._headers_too_slow)

        def _headers_arrived(self) -> None:
            self._awaiting_headers = False
            self._begun = False
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def on_message_begin(self) -> None:
            # The next request's first byte; between requests the connection is idle
            # and uvicorn's keep-alive timer is what closes it.  The headers' deadline
            # runs from here (a first request's replaces the first-byte deadline).
            super().on_message_begin()
            if not self._begun and self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            self._await_headers(header_timeout_s)
            self._begun = True

        def on_url(self, url: bytes) -> None:
            self._count_header_bytes(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            # Counted as parsed, ": " and CRLF included: a header section that arrives
            # in one write is complete before data_received could look at its size.
            self._count_header_bytes(len(name) + len(value) + 4)
            super().on_header(name, value)

        def _count_header_bytes(self, n: int) -> None:
            self._parsed_header_bytes += n
            if max_header_bytes and self._parsed_header_bytes > max_header_bytes:
                self._refusal = (431, "Request Header Fields Too Large",
                                 f"request headers over {max_header_bytes} bytes (--max-header-bytes)")
                raise _Refused

        def on_headers_complete(self) -> None:
            self._headers_arrived()
            if self._probe_only and not is_probe_path(self.url):
                self._refusal = (503, "Service Unavailable",
                                 "too many open connections: only /health, /metrics and /version are served "
                                 "on this one (--limit-concurrency, --limit-concurrency-per-peer)")
                raise _Refused
            if limiter is not None:
                limiter.busy(self)
            super().on_headers_complete()
            if self._probe_only and self.cycle is not None:
                self.cycle.keep_alive = False  # one probe, then the headroom is free again

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()
            if cycle is not None and cycle.more_body and not self.transport.is_closing():
                # Answered before its body was read (a 404, a 405): the rest of the body
                # may trickle in forever, each byte resetting uvicorn's keep-alive timer.
                self.transport.close()
            if limiter is not None and not self.pipeline and not self.transport.is_closing():
                limiter.idle(self)  # waits for its next request: evictable again

        def send_400_response(self, msg: str) -> None:
            if self._refusal is not None:
                self._refuse(*self._refusal)
            else:
                super().send_400_response(msg)

        def data_received(self, data: bytes) -> None:
            if self._discarding:
                return  # refused: the rest of the request is read and dropped (_refuse)
            if self._awaiting_headers:
                self._header_bytes += len(data)
                if limiter is not None:
                    limiter.idle(self)  # still idle, but active: the last to be evicted
            super().data_received(data)
            if (self._awaiting_headers and max_header_bytes and self._header_bytes > max_header_bytes
                    and not self.transport.is_closing()):
                self._refuse(431, "Request Header Fields Too Large",
                             f"request headers over {max_header_bytes} bytes (--max-header-bytes)")

        def connection_lost(self, exc) -> None:
            self._headers_arrived()
            if limiter is not None:
                limiter.release(self)
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
            # A lingering close: closing with the rest of the request unread would send
            # a reset, which can destroy the answer before the client reads it.  The
            # write side is shut, what still comes is discarded, and the connection is
            # closed when the client closes it or LINGER_S later.
            self._discarding = True
            try:
                self.transport.write_eof()
            except (NotImplementedError, RuntimeError, OSError):
                self.transport.close()
                return
            self.loop.call_later(LINGER_S, self.transport.close)

    return GuardedHttpToolsProtocol


def close_evicted(protocol) -> None:
    """ConnectionLimiter's ``close`` for the protocol above: quietly, as an idle timeout."""
    protocol.transport.close()
