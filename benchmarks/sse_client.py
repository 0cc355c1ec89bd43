"""A lean asyncio HTTP/1.1 client for SSE benchmarks (keep-alive, chunked bodies).

httpx costs far more CPU per chunk than the server it measures on a 2-core box, which
would skew the numbers; this client parses only what ``POST /inference/v1/generate``
returns.  Not a general HTTP client.
"""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Optional
from urllib.parse import urlsplit


class HttpError(Exception):
    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body[:300]!r}")
        self.status = status
        self.body = body


class SseConnection:
    """One keep-alive connection; requests on it run one after another."""

    def __init__(self, base_url: str, headers: Optional[dict[str, str]] = None):
        u = urlsplit(base_url)
        if u.scheme != "http":
            raise ValueError(f"only http:// is supported, got {base_url!r}")
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.prefix = u.path.rstrip("/")
        self.extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.reader: Optional[asyncio.StreamReader] = None
        self.writer: Optional[asyncio.StreamWriter] = None

    async def _ensure(self) -> None:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 24)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    async def _request(self, path: str, body: bytes) -> tuple[int, dict[str, str]]:
        await self._ensure()
        head = (f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{self.extra}\r\n")
        self.writer.write(head.encode() + body)
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("server closed the connection")
        status = int(status_line.split()[1])
        headers = {}
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        return status, headers

    async def _body_chunks(self, headers: dict[str, str]) -> AsyncIterator[bytes]:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await self.reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readline()
                    return
                data = await self.reader.readexactly(size)
                await self.reader.readexactly(2)
                yield data
        else:
            length = int(headers.get("content-length", "0"))
            if length:
                yield await self.reader.readexactly(length)
        if headers.get("connection", "").lower() == "close":
            await self.close()

    async def post_json(self, path: str, body: bytes) -> tuple[int, bytes]:
        status, headers = await self._request(path, body)
        data = b"".join([c async for c in self._body_chunks(headers)])
        return status, data

    async def post_sse(self, path: str, body: bytes) -> AsyncIterator[tuple[float, bytes]]:
        """Yield (arrival perf_counter, payload) for every ``data:`` event, ``[DONE]`` excluded."""
        status, headers = await self._request(path, body)
        if status != 200:
            data = b"".join([c async for c in self._body_chunks(headers)])
            raise HttpError(status, data)
        buf = b""
        async for chunk in self._body_chunks(headers):
            now = time.perf_counter()
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if event.startswith(b"data: "):
                    payload = event[6:]
                    if payload != b"[DONE]":
                        yield now, payload
