"""A raw asyncio HTTP/1.1 client for many concurrent SSE streams in tests.

httpx's connection pool scans every connection for every request (httpcore
``_assign_requests_to_connections``): with 500 concurrent streams the test process
spends ~13 s of CPU on bookkeeping alone, against ~1.5 s with this client.  Unlike
benchmarks/sse_client.py it keeps everything a test asserts on: the status, every
``data:`` payload including ``[DONE]``, arrival times, and whether the server ended
the body cleanly.  One connection per request (``Connection: close``).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Callable, Optional
from urllib.parse import urlsplit


@dataclass
class SseResult:
    status: int = 0
    headers: dict = field(default_factory=dict)
    payloads: list = field(default_factory=list)  # every ``data:`` payload as str, [DONE] included
    times: list = field(default_factory=list)  # time.monotonic() at the arrival of each payload
    body: bytes = b""  # the raw body of a non-SSE answer (errors)
    complete: bool = False  # the body ended with the terminating zero-size chunk
    hung_up: bool = False  # we closed the connection early (``stop`` said so)

    def chunks(self) -> list[dict]:
        return [json.loads(p) for p in self.payloads if p != "[DONE]"]

    def tokens(self, index: int = 0) -> list[int]:
        return [t for c in self.chunks() for ch in c.get("choices", ()) if ch["index"] == index
                for t in ch["token_ids"]]


async def post_sse(base_url: str, path: str, body, headers: Optional[dict] = None,
                   stop: Optional[Callable[[SseResult], bool]] = None) -> SseResult:
    """POST ``body`` (dict -> JSON) and read the whole answer.

    ``stop(result)`` is called after each payload; returning True hangs up at once
    (a client walking away mid-stream)."""
    u = urlsplit(base_url)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (f"POST {path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n{extra}\r\n")
    reader, writer = await asyncio.open_connection(u.hostname, u.port, limit=1 << 24)
    result = SseResult()
    try:
        writer.write(head.encode() + data)
        await writer.drain()
        result.status = int((await reader.readline()).split()[1])
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            result.headers[k.strip().lower()] = v.strip()
        if result.headers.get("transfer-encoding", "").lower() != "chunked":
            result.body = await reader.read()
            result.complete = True
            return result
        buf = b""
        while True:
            size_line = await reader.readline()
            if not size_line:
                return result  # connection cut without the terminating chunk
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                result.complete = True
                return result
            buf += await reader.readexactly(size)
            await reader.readexactly(2)
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if event.startswith(b"data: "):
                    result.payloads.append(event[6:].decode())
                    result.times.append(time.monotonic())
                    if stop is not None and stop(result):
                        result.hung_up = True
                        return result
    finally:
        writer.close()
