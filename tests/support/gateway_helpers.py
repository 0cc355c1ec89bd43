"""Helpers for the gateway tests: start gateway processes, read SSE, scrape metrics."""
from __future__ import annotations

import json
import re
import time
from typing import Optional

import httpx

from tests.support.procs import ProcGroup, free_port, wait_for

GENERATE = "/inference/v1/generate"
ABORT = "/inference/v1/abort_requests"


class Gateway:
    def __init__(self, proc, port: int):
        self.proc = proc
        self.port = port
        self.url = f"http://127.0.0.1:{port}"


def start_gateway(procs: ProcGroup, frontend: str, *extra: str, wait_healthy: bool = True,
                  prefix: Optional[list[str]] = None, env: Optional[dict] = None) -> Gateway:
    """``prefix``: a command that execs the gateway in another context (``prlimit ...``);
    ``env``: variables added to its environment."""
    port = free_port()
    proc = procs.spawn(f"gateway{port}", ["-m", "common.cli", "gateway", "--port", str(port), "--broker", frontend,
                                          "--info-ttl", "0.2", *extra], prefix=prefix, env=env)
    gw = Gateway(proc, port)
    want = (200,) if wait_healthy else (200, 503)

    def ready() -> bool:
        if not proc.alive():
            raise RuntimeError("gateway exited\n" + proc.tail())
        try:
            return httpx.get(gw.url + "/health", timeout=2).status_code in want
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, 90, "gateway /health", interval=0.2)
    except TimeoutError:
        raise TimeoutError(procs.tails()) from None
    return gw


def sse_payloads(response: httpx.Response) -> list[str]:
    """Every ``data:`` payload of a finished SSE response, in order ([DONE] included)."""
    body = response.text
    assert body.endswith("\n\n"), body[-200:]
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


def iter_sse(lines) -> "iter[str]":
    """Payloads from ``Response.iter_lines()`` of a streaming response, as they arrive."""
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: "):]


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r'^([^{\s]+)(\{[^}]*\})?\s+(\S+)$', line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def wait_metric(url: str, name: str, minimum: float, timeout: float = 10.0, **labels: str) -> float:
    deadline = time.monotonic() + timeout
    value = 0.0
    while time.monotonic() < deadline:
        value = metric_value(httpx.get(url + "/metrics").text, name, **labels)
        if value >= minimum:
            return value
        time.sleep(0.1)
    return value


def gen_body(token_ids: list[int], stream: bool = False, **params) -> dict:
    return {"token_ids": token_ids, "sampling_params": params, "stream": stream}


def post(gw: Gateway, body, headers: Optional[dict] = None, path: str = GENERATE) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    h = {"content-type": "application/json", **(headers or {})}
    return httpx.post(gw.url + path, content=content, headers=h, timeout=60)


def stream_chat(client, **kw):
    """A streamed chat completion read with the openai SDK ``client``: (reasoning, content,
    tool-call deltas, finish reason), each accumulated over the chunks."""
    reasoning, content, calls, finish = "", "", [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning", None) or ""
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    return reasoning, content, calls, finish
