"""Load: 500 concurrent SSE streams through one gateway and one broker.

Real processes (broker, one real worker on the tiny Llama, one gateway) and real HTTP.
Every stream must end with ``[DONE]``, carry no error, and its tokens must equal a
non-stream run of the same greedy request: a dropped, duplicated or misrouted chunk
anywhere on the relay path (worker -> broker -> gateway -> SSE) changes the token list.
"""
from __future__ import annotations

import asyncio
import json
import random

import pytest

from tests.support.gateway_helpers import GENERATE, start_gateway
from tests.support.procs import ProcGroup, cluster_info, wait_for, wait_for_workers
from tests.support.raw_sse import post_sse

pytestmark = pytest.mark.timeout(180)

STREAMS = 500
DISTINCT_PROMPTS = 100  # each prompt is streamed STREAMS / DISTINCT_PROMPTS times
MAX_TOKENS = 6
# Every stream fits in the batch at once (no queueing in the broker), one CPU thread.
WORKER_ARGS = ("--max-num-seqs", "512", "--num-kv-blocks", "1100", "--block-size", "16",
               "--max-num-batched-tokens", "8192", "--threads", "1")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, llama_dir):
    with ProcGroup(tmp_path_factory.mktemp("load-stack")) as procs:
        broker = procs.broker()
        procs.worker(broker, 0, "--model", str(llama_dir), *WORKER_ARGS)
        wait_for_workers(broker.frontend, 1, timeout=120)
        gw = start_gateway(procs, broker.frontend)
        yield dict(broker=broker, gw=gw, procs=procs)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(256) for _ in range(rng.randint(2, 12))] for _ in range(DISTINCT_PROMPTS)]


def _body(prompt: list[int], stream: bool) -> dict:
    return {"token_ids": prompt, "stream": stream,
            "sampling_params": {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}}


async def _stream(url: str, prompt: list[int], rid: str) -> tuple[list[int], list[dict]]:
    """Tokens of one SSE stream, and its parsed chunks; asserts the SSE framing."""
    res = await post_sse(url, GENERATE, _body(prompt, True), {"X-Request-Id": rid})
    assert res.status == 200, res.body[:300]
    assert res.headers["content-type"].startswith("text/event-stream")
    assert res.complete and res.payloads and res.payloads[-1] == "[DONE]", (rid, res.payloads[-3:])
    assert res.payloads.count("[DONE]") == 1
    chunks = res.chunks()
    assert not any("error" in c for c in chunks), (rid, chunks)
    return res.tokens(), chunks


async def _reference(url: str, prompt: list[int]) -> list[int]:
    res = await post_sse(url, GENERATE, _body(prompt, False))
    assert res.status == 200, res.body[:300]
    tokens = json.loads(res.body)["choices"][0]["token_ids"]
    assert len(tokens) == MAX_TOKENS
    return tokens


async def _run_all(url: str, prompts: list[list[int]]):
    # Raw asyncio connections: httpx's pool costs seconds of client CPU at 500 streams (tests/support/raw_sse.py).
    expected = await asyncio.gather(*(_reference(url, p) for p in prompts))
    streams = await asyncio.gather(*(_stream(url, prompts[i % len(prompts)], f"load-{i}") for i in range(STREAMS)),
                                   return_exceptions=True)
    return expected, streams


def test_500_concurrent_sse_streams_lose_no_chunk(stack):
    prompts = _prompts()
    expected, streams = asyncio.run(_run_all(stack["gw"].url, prompts))
    failures = [(i, s) for i, s in enumerate(streams) if isinstance(s, BaseException)]
    assert not failures, f"{len(failures)} stream(s) failed, first: {failures[0]!r}\n" + stack["procs"].tails()
    for i, (tokens, chunks) in enumerate(streams):
        assert tokens == expected[i % DISTINCT_PROMPTS], f"stream {i}"
        assert {c["request_id"] for c in chunks} == {f"generate-tokens-load-{i}"}
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["choices"][0]["token_ids"] for c in chunks)  # a chunk only when it carries tokens

    # Nothing left behind: every request finished on the worker and gave its KV blocks back.
    def idle():
        load = cluster_info(stack["broker"].frontend).workers[0].load
        return load.running == 0 and load.waiting == 0 and load.free_kv_blocks == load.total_kv_blocks
    wait_for(idle, 10, "worker idle with every KV block free")
