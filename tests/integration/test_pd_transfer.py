"""Prefill/decode disaggregation through real processes (worker/engine/disagg/kv_transfer.py).

One broker, a prefill worker (rank 0, --kv-transfer-timeout 2) and a decode worker
(rank 1), a gateway; legs pinned with X-data-parallel-rank, as vLLM's toy proxy runs
them: the prefill leg (max_tokens 1, do_remote_decode) answers with NixlConnector's
kv_transfer_params, the decode leg pulls the prompt's full blocks instead of computing
them (cached_tokens), outputs equal plain decoding, every held block comes back
(FREE, timeout, decode-side abort, prefill worker killed), bad params are 400s, and
garbage on the transfer port hurts nobody."""
from __future__ import annotations

import socket
import time

import httpx
import msgspec
import pytest
import zmq

from tests.support.gateway_helpers import GENERATE, start_gateway
from tests.support.procs import ProcGroup, cluster_info, wait_for, wait_for_workers
from worker.engine.disagg import transfer_auth
WORKER_ARGS = ("--max-num-seqs", "4", "--num-kv-blocks", "64", "--threads", "1", "--max-model-len", "256")
BLOCK = 16
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
VLLM_KEYS = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
             "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
             "remote_blocks_expiry_time", "transfer_mode"}


def _stack(tmp_path_factory, llama_dir, *extra):
    with ProcGroup(tmp_path_factory.mktemp("pd-stack")) as procs:
        broker = procs.broker()
        prefill = procs.worker(broker, 0, "--model", str(llama_dir), *WORKER_ARGS, *extra, "--role", "prefill",
                               "--kv-transfer-timeout", "2")
        procs.worker(broker, 1, "--model", str(llama_dir), *WORKER_ARGS, *extra, "--role", "decode")
        wait_for_workers(broker.frontend, 2, timeout=120)
        gw = start_gateway(procs, broker.frontend, "--enable-prompt-tokens-details")  # cached_tokens, as vLLM's flag
        with httpx.Client(base_url=gw.url, timeout=60) as http:
            yield procs, broker, prefill, http


@pytest.fixture(scope="module")
def stack(tmp_path_factory, llama_dir):
    yield from _stack(tmp_path_factory, llama_dir)


@pytest.fixture(scope="module")
def async_stack(tmp_path_factory, llama_dir):
    """Both legs' workers with async scheduling (the CUDA default): their steps overlap."""
    yield from _stack(tmp_path_factory, llama_dir, "--async-scheduling")


def _prompt(seed: int, n: int = 40) -> list[int]:
    return [3 + (seed * 31 + i * 7) % 250 for i in range(n)]


def _gen(http, rank: int, prompt, kv=None, **params):
    params = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, **params}
    body = {"token_ids": prompt, "sampling_params": params, "kv_transfer_params": kv}
    return http.post(GENERATE, json=body, headers={"X-data-parallel-rank": str(rank)})


def _prefill(http, prompt) -> dict:
    r = _gen(http, 0, prompt, dict(PREFILL_PARAMS), max_tokens=1)
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def _free(broker) -> dict[int, int]:
    info = cluster_info(broker.frontend)
    return {w.rank: w.load.free_kv_blocks for w in info.workers if w.alive}


def _wait_free(broker, want: dict[int, int], timeout: float = 5.0) -> None:
    wait_for(lambda: all(_free(broker).get(r) == n for r, n in want.items()), timeout,
             f"free KV blocks back to {want} (now {_free(broker)})", interval=0.1)


def _close(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return b == pytest.approx(a, rel=1e-4, abs=1e-4)
    return a == b


def _error(r, status: int) -> str:
    assert r.status_code == status, r.text
    return r.text


@pytest.mark.parametrize("which", ["stack", "async_stack"])
def test_decode_pulls_the_prompt_and_matches_plain_decoding(which, request):
    _, broker, _, http = request.getfixturevalue(which)
    prompt = _prompt(1)
    # The reference on the decode worker itself, in another cache namespace (no shared blocks).
    ref = _gen(http, 1, prompt, logprobs=2, cache_salt="reference")
    assert ref.status_code == 200, ref.text
    before = _free(broker)
    kv = _prefill(http, prompt)
    assert set(kv) == VLLM_KEYS
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False and kv["tp_size"] == 1
    assert len(kv["remote_block_ids"]) == 1 and len(kv["remote_block_ids"][0]) == len(prompt) // BLOCK
    assert kv["remote_request_id"] and kv["remote_engine_id"] and kv["remote_host"] == "127.0.0.1"
    assert kv["transfer_mode"] == "pull" and kv["remote_num_tokens"] == len(prompt)
    assert _free(broker)[0] == before[0] - 2  # held for the decode side
    r = _gen(http, 1, prompt, kv, logprobs=2)
    assert r.status_code == 200, r.text
    got, want = r.json(), ref.json()
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    assert _close(want["choices"][0]["logprobs"], got["choices"][0]["logprobs"])
    pulled = len(kv["remote_block_ids"][0]) * BLOCK
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == pulled
    assert want["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert got.get("kv_transfer_params") is None
    _wait_free(broker, before)  # FREE released the prefill side; the decode side's are cached-free


def test_unpulled_blocks_expire_and_the_transfer_is_gone(stack):
    _, broker, _, http = stack
    prompt = _prompt(2)
    before = _free(broker)
    kv = _prefill(http, prompt)
    assert _free(broker)[0] == before[0] - 2
    _wait_free(broker, before, timeout=6)  # --kv-transfer-timeout 2
    msg = _error(_gen(http, 1, prompt, kv), 400)
    assert "unknown or expired transfer" in msg
    _wait_free(broker, before)


def test_unknown_engine_or_request_and_malformed_params_are_400(stack):
    _, broker, _, http = stack
    prompt = _prompt(3)
    before = _free(broker)
    kv = _prefill(http, prompt)
    msg = _error(_gen(http, 1, prompt, {**kv, "remote_engine_id": "0" * 32}), 400)
    assert "unknown or expired transfer" in msg and "unknown engine id" in msg
    msg = _error(_gen(http, 1, prompt, {**kv, "remote_request_id": "nobody"}), 400)
    assert "unknown or expired transfer" in msg
    for bad in ({"remote_block_ids": ["a"]}, {"remote_port": "x"}, {"remote_engine_id": 5},
                {"do_remote_prefill": "yes"}, {"tp_size": 2}):
        msg = _error(_gen(http, 1, prompt, {**kv, **bad}), 400)
        assert "kv_transfer_params" in msg
    assert _error(_gen(http, 1, prompt, [1, 2]), 400)
    # The transfer is still there: the real decode leg pulls it.
    r = _gen(http, 1, prompt, kv)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * BLOCK
    _wait_free(broker, before)


def test_decode_side_abort_leaks_nothing(stack):
    _, broker, _, http = stack
    prompt = _prompt(4)
    before = _free(broker)
    kv = _prefill(http, prompt)
    body = {"token_ids": prompt, "stream": True, "kv_transfer_params": kv,
            "sampling_params": {"max_tokens": 200, "temperature": 0, "ignore_eos": True}}
    with http.stream("POST", GENERATE, json=body, headers={"X-data-parallel-rank": "1"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # the decode leg runs: abort it by leaving
    _wait_free(broker, before, timeout=10)


def test_decode_leg_with_n_choices(stack):
    _, broker, _, http = stack
    prompt = _prompt(8)
    before = _free(broker)
    kv = _prefill(http, prompt)
    r = _gen(http, 1, prompt, kv, max_tokens=4, n=2, temperature=0.8, seed=3)
    assert r.status_code == 200, r.text
    body = r.json()
    assert sorted(c["index"] for c in body["choices"]) == [0, 1]
    assert all(len(c["token_ids"]) == 4 for c in body["choices"])
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * BLOCK
    _wait_free(broker, before)


def test_garbage_on_the_transfer_port_hurts_nobody(stack):
    _, broker, _, http = stack
    prompt = _prompt(5)
    before = _free(broker)
    kv = _prefill(http, prompt)
    host, port = kv["remote_host"], kv["remote_port"]
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{host}:{port}")
    enc = msgspec.msgpack.encode
    for frames in ([b""], [b"\xff\x00garbage"], [b"a", b"b", b"c"], [enc([1, 2])], [enc({"op": "pull"})],
                   [enc({"op": "pull", "engine_id": kv["remote_engine_id"], "request_id": 7})],
                   [enc({"op": "pull", "engine_id": kv["remote_engine_id"], "request_id": "x",
                         "block_ids": ["z"]})],
                   [enc({"op": "free", "engine_id": 3, "request_id": None})]):
        sock.send_multipart(frames)
    big = ctx.socket(zmq.DEALER)  # over the size limit: the server drops that connection
    big.setsockopt(zmq.LINGER, 0)
    big.connect(f"tcp://{host}:{port}")
    big.send(b"x" * (2 << 20))
    sock.close(0)
    # A wrong block list from a member (a worker: it holds the worker token) is answered
    # with an error, not served.
    member = ctx.socket(zmq.DEALER)
    member.setsockopt(zmq.LINGER, 0)
    member.connect(f"tcp://{host}:{port}")
    member.send(enc(transfer_auth.current().stamp(
        {"op": "pull", "engine_id": kv["remote_engine_id"], "request_id": kv["remote_request_id"],
         "block_ids": [0]})))
    assert member.poll(3000)
    reply = msgspec.msgpack.decode(member.recv_multipart()[0])
    assert reply["ok"] is False and "not those held" in reply["error"]
    member.close(0)
    big.close(0)
    with socket.create_connection((host, port), timeout=2) as raw:  # not even ZMTP
        raw.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)))
    r = _gen(http, 1, prompt, kv)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * BLOCK
    assert _gen(http, 0, _prompt(6), max_tokens=2).status_code == 200
    _wait_free(broker, before)


def test_prefill_worker_killed_decode_leg_fails_fast_and_decode_keeps_serving(stack):
    procs, broker, prefill, http = stack
    prompt = _prompt(7)
    kv = _prefill(http, prompt)
    before = _free(broker)[1]
    prefill.kill9()
    t0 = time.monotonic()
    r = _gen(http, 1, prompt, kv)
    elapsed = time.monotonic() - t0
    assert r.status_code == 503, r.text
    assert "did not answer" in r.text and elapsed < 5
    _wait_free(broker, {1: before})
    ok = _gen(http, 1, prompt, max_tokens=3)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 3
