"""benchmarks/routing.py without a stack: the workload, the ideal-cache computation, the
conversation driver against a fake SSE server, metrics parsing and the report."""
from __future__ import annotations

import asyncio
import json

from benchmarks import routing
from benchmarks.routing import Turn, ideal_cached, make_workload


def test_workload_is_seeded_and_shaped():
    a = make_workload(3, 4, 40, 8, 256, seed=1)
    assert a == make_workload(3, 4, 40, 8, 256, seed=1)
    assert a != make_workload(3, 4, 40, 8, 256, seed=2)
    assert len(a.system) == 40 and a.conversations == 3 and a.turns == 4
    assert all(len(u) == 8 and all(0 <= x < 256 for x in u) for conv in a.users for u in conv)


def test_ideal_cached_counts_blocks_computed_by_earlier_requests():
    sys_ = list(range(40))  # 2 full blocks + 8
    first = Turn(0, 0, sys_ + [1] * 8, output=[7] * 16, start=1.0)  # 48 prompt tokens
    other = Turn(1, 0, sys_ + [2] * 8, output=[9] * 4, start=2.0)
    follow = Turn(0, 1, first.prompt + first.output + [3] * 5, start=3.0)  # 69 tokens
    assert ideal_cached([follow, other, first]) == [48, 32, 0]  # order of the list is kept
    # output's last token is never computed: 48 + 15 = 63 tokens -> 3 full blocks
    # a prompt that is exactly a cached prefix recomputes its last token
    again = Turn(2, 0, list(first.prompt), start=4.0)
    assert ideal_cached([first, again]) == [0, 32]


async def _fake_server(log: list):
    """/inference/v1/generate answering SSE: the request's last two prompt tokens as output,
    one token per chunk, then a usage chunk with cached_tokens = prompt // 2."""
    async def handle(reader, writer):
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()
                return
            lines = head.decode().split("\r\n")
            headers = {k.lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:] if l)}
            body = json.loads(await reader.readexactly(int(headers["content-length"])))
            log.append((headers.get("x-session-id"), body))
            ids = body["token_ids"]
            events = [{"choices": [{"index": 0, "token_ids": [t]}]} for t in ids[-2:]]
            events.append({"choices": [], "usage": {"prompt_tokens": len(ids), "completion_tokens": 2,
                                                     "prompt_tokens_details": {"cached_tokens": len(ids) // 2}}})
            payload = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + f"{len(payload):x}\r\n".encode() + payload + b"\r\n0\r\n\r\n")
            await writer.drain()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_conversations_against_fake_server():
    wl = make_workload(3, 3, 20, 4, 256, seed=0)
    log: list = []

    async def go():
        server = await _fake_server(log)
        port = server.sockets[0].getsockname()[1]
        try:
            return await routing.run_conversations(f"http://127.0.0.1:{port}", wl, 2, 2, True, None)
        finally:
            server.close()

    turns, duration = asyncio.run(go())
    assert len(turns) == 9 and duration > 0 and all(t.error is None for t in turns)
    by = {(t.conversation, t.turn): t for t in turns}
    for c in range(3):
        assert by[c, 0].prompt == wl.system + wl.users[c][0]
        for k in (1, 2):  # history + reply + new user message
            prev = by[c, k - 1]
            assert by[c, k].prompt == prev.prompt + prev.output + wl.users[c][k]
            assert prev.output == prev.prompt[-2:]
    sids = {sid for sid, _ in log}
    assert len(sids) == 3 and None not in sids  # one X-Session-ID per conversation
    assert all(b["stream_options"]["include_usage"] and b["sampling_params"]["ignore_eos"] for _, b in log)
    row = routing.policy_row("x", turns, ideal_cached(turns), duration, {0: 6, 1: 3}, 4.0)
    assert row["requests"] == 9 and row["spread"] == 2.0
    assert row["hit_rate"] == sum(len(t.prompt) // 2 for t in turns) / sum(len(t.prompt) for t in turns)
    assert 0 < row["ideal_hit_rate"] < 1 and row["ttft_p50_ms"] > 0


def test_metrics_parsing_and_report(capsys):
    text = ("# HELP tokserve:worker_requests_received_total x\n"
            'tokserve:worker_requests_received_total{engine="0"} 12.0\n'
            'tokserve:worker_requests_received_total{engine="1"} 8.0\n'
            "tokserve:broker_live_workers 2.0\n"
            "tokserve:broker_requests_prefix_routed_total 5.0\n")
    m = routing.parse_metrics(text)
    assert routing.per_worker_received(m) == {0: 12.0, 1: 8.0}
    assert routing.metric(m, "tokserve:broker_live_workers") == 2.0
    assert routing.metric(m, "tokserve:broker_requests_prefix_routed") == 5.0
    t = [Turn(0, 0, [1] * 40, output=[2] * 4, ttft=0.01, prompt_tokens=40, cached_tokens=32)]
    rows = {name: routing.policy_row(name, t, [32], 1.0, {0: 3, 1: 2}, 1.0)
            for name in ("cache-aware", "least-loaded", "1 worker")}
    routing.print_table(list(rows.values()))
    lines = routing.target_lines(rows)
    out = capsys.readouterr().out
    assert "cache-aware" in out and "3/2" in out
    assert any("target >= 0.9" in x and "1.000" in x for x in lines)
    assert any("target <= 1.5" in x and "1.50" in x for x in lines)
