"""Cache-aware dispatch through the real stack: two workers publish KV events, the
gateway sends each prompt's block keys, and the broker sends every next turn of a
conversation to the worker that cached its history (no session ids), so the turn's
prompt is served from the prefix cache; the broker logs no error."""
from __future__ import annotations

import random
import time

import httpx
from tests.support.gateway_helpers import GENERATE, metric_value, start_gateway
from tests.support.procs import ProcGroup, wait_for_workers

WORKER_ARGS = ("--max-num-seqs", "8", "--num-kv-blocks", "256", "--threads", "1", "--max-model-len", "512")
BLOCK = 16


def _stack(tmp_path_factory, llama_dir, routing: str):
    procs = ProcGroup(tmp_path_factory.mktemp(f"routing-{routing}"))
    broker = procs.broker("--routing", routing)
    for rank in range(2):
        procs.worker(broker, rank, "--model", str(llama_dir), *WORKER_ARGS)
    wait_for_workers(broker.frontend, 2, timeout=120)
    gw = start_gateway(procs, broker.frontend, "--enable-prompt-tokens-details")  # cached_tokens, as vLLM's flag
    return procs, broker, gw


def _turns(http: httpx.Client, conversations: int, turns: int, seed: int) -> list[int]:
    """Cached prompt tokens of every turn after the first."""
    rng = random.Random(seed)
    histories = [[rng.randrange(1, 250) for _ in range(40)] for _ in range(conversations)]
    cached = []
    for turn in range(turns):
        for history in histories:
            r = http.post(GENERATE, json={"token_ids": history, "sampling_params": {
                "max_tokens": 8, "temperature": 0, "ignore_eos": True}})
            assert r.status_code == 200, r.text
            body = r.json()
            if turn:
                cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
            history += body["choices"][0]["token_ids"] + [rng.randrange(1, 250) for _ in range(20)]
        time.sleep(0.3)  # the workers' KV events reach the broker
    return cached


def test_conversations_follow_their_cache(tmp_path_factory, llama_dir):
    procs, broker, gw = _stack(tmp_path_factory, llama_dir, "cache-aware")
    with procs, httpx.Client(base_url=gw.url, timeout=120) as http:
        cached = _turns(http, conversations=6, turns=3, seed=4)
        # Every later turn's history (previous prompt + output, all full blocks but the
        # tail) is on one worker only: cache-aware finds it every time.
        hits = sum(1 for c in cached if c >= 2 * BLOCK)
        time.sleep(0.5)  # past the gateway's cluster-info cache
        routed = metric_value(http.get("/metrics").text, "tokserve:broker_requests_prefix_routed_total")
        log = broker.log_path.read_text(errors="replace")
        assert "Traceback" not in log and "dropped" not in log, log[-2000:]
        assert hits == len(cached), cached
        assert routed >= len(cached)
