"""Who may use the KV / encoder-output transfer machinery (issue 33), through real
processes: a broker, a plain worker (rank 0, no P/D or E/P/D configuration), a worker
with vLLM's --kv-transfer-config (rank 1, a fixed transfer address) and a --role prefill
worker that may hold its whole cache with a short transfer timeout (rank 2), a gateway.

* client transfer parameters are refused (400, naming the flag) where no role enables them;
* prefill legs cannot pin the KV cache: past --kv-transfer-max-held they get 503s and
  ordinary requests are still served; a request stuck behind held blocks waits for them
  instead of failing with a 500;
* a transfer peer the broker does not know is a 400 that echoes no host or port, and
  nothing connects to it; a client cannot forge the broker's vouching;
* a PULL with a wrong engine id does not learn the real one; deeply nested parameters are
  a 400 at the broker, never a crash."""
from __future__ import annotations

import json
import socket

import httpx
import msgspec
import pytest
import zmq

from common import framing
from common.protocol import MAGIC, ErrorMsg, GenerateRequest, MsgType, Outputs, SamplingParams
from common.transfer_peers import TRUST_EC, TRUST_KV, TRUST_PEERS
from tests.support.gateway_helpers import GENERATE, start_gateway
from tests.support.procs import ProcGroup, cluster_info, free_port, wait_for, wait_for_workers
from worker.engine.disagg import transfer_auth
WORKER_ARGS = ("--max-num-seqs", "4", "--num-kv-blocks", "64", "--threads", "1", "--max-model-len", "256")
BLOCK = 16
KV_CONFIG = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
           "remote_block_ids": None, "remote_host": None, "remote_port": None}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, llama_dir):
    with ProcGroup(tmp_path_factory.mktemp("sec-transfer")) as procs:
        broker = procs.broker()
        transfer_port = free_port()
        procs.worker(broker, 0, "--model", str(llama_dir), *WORKER_ARGS)
        procs.worker(broker, 1, "--model", str(llama_dir), *WORKER_ARGS, "--kv-transfer-config", KV_CONFIG,
                     "--kv-transfer-address", f"tcp://127.0.0.1:{transfer_port}")
        procs.worker(broker, 2, "--model", str(llama_dir), *WORKER_ARGS, "--role", "prefill",
                     "--kv-transfer-max-held", "1", "--kv-transfer-timeout", "6")
        wait_for_workers(broker.frontend, 3, timeout=120)
        gw = start_gateway(procs, broker.frontend, "--enable-prompt-tokens-details")  # cached_tokens, as vLLM's flag
        with httpx.Client(base_url=gw.url, timeout=60) as http:
            yield broker, http, transfer_port


def _prompt(seed: int, n: int = 7 * BLOCK) -> list[int]:
    return [3 + (seed * 37 + i * 11) % 250 for i in range(n)]


def _gen(http, rank: int, prompt, kv=None, ec=None, **params):
    params = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, **params}
    body = {"token_ids": prompt, "sampling_params": params}
    if kv is not None:
        body["kv_transfer_params"] = kv
    if ec is not None:
        body["ec_transfer_params"] = ec
    return http.post(GENERATE, json=body, headers={"X-data-parallel-rank": str(rank)})


def _error(r, status: int, param: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param, err
    return err["message"]


def _free(broker) -> dict[int, int]:
    return {w.rank: w.load.free_kv_blocks for w in cluster_info(broker.frontend).workers}


def _decode_params(host: str, port: int) -> dict:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e" * 32,
            "remote_request_id": "r", "remote_host": host, "remote_port": port,
            "remote_block_ids": [[0, 1]], "tp_size": 1}


def _ec_params(host: str, port: int) -> dict:
    return {"img": {"item_indices": [0], "metadata": {"image_grid_thw": [1, 4, 4]}, "peer_host": host,
                    "peer_port": port, "size_bytes": 64, "shape": [4, 4], "remote_key": "k"}}


def _transfer(port: int, msg: dict, answer: bool = True, auth: bool = True):
    """One message to a worker's transfer server (as a decode side would send it: with
    the cluster's worker token, which the test session's runtime directory holds)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(msgspec.msgpack.encode(transfer_auth.current().stamp(msg) if auth else msg))
        if not answer:
            return None
        assert sock.poll(5000), "the transfer server did not answer"
        return msgspec.msgpack.decode(sock.recv_multipart()[0])
    finally:
        sock.close()


def _direct(frontend: str, body) -> tuple[str, object]:
    """A direct ZeroMQ client's GENERATE through the broker: ("error", ErrorMsg) or
    ("done", the deltas) once the request finished."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    deltas = []
    try:
        sock.connect(frontend)
        sock.send_multipart(framing.message(MsgType.GENERATE, body))
        while True:
            assert sock.poll(30000), "no answer from the broker"
            frames = sock.recv_multipart()
            assert frames[0] == MAGIC
            if frames[1] == MsgType.ERROR:
                return "error", framing.decode(frames[2], ErrorMsg)
            if frames[1] == MsgType.OUTPUTS:
                deltas += framing.decode(frames[2], Outputs).deltas
                if any(d.finish_reason for d in deltas):
                    return "done", deltas
    finally:
        sock.close(0)


def test_client_transfer_params_need_a_role(stack):
    broker, http, transfer_port = stack
    prompt = _prompt(1)
    msg = _error(_gen(http, 0, prompt, dict(PREFILL), max_tokens=1), 400, "kv_transfer_params")
    assert "--kv-transfer-config" in msg and "--role prefill|decode" in msg
    # A decode leg naming a real (registered) transfer server: still not on this worker.
    msg = _error(_gen(http, 0, prompt, _decode_params("127.0.0.1", transfer_port)), 400, "kv_transfer_params")
    assert "--kv-transfer-config" in msg
    msg = _error(_gen(http, 0, prompt, ec=_ec_params("127.0.0.1", transfer_port)), 400, "ec_transfer_params")
    assert "--ec-transfer-config" in msg
    # Parameters that ask for nothing are still just passed through, as before.
    r = _gen(http, 0, prompt, {"k": 1})
    assert r.status_code == 200 and r.json()["kv_transfer_params"] == {"k": 1}, r.text
    # The configured worker takes the same prefill leg.
    before = _free(broker)[1]
    kv = _gen(http, 1, prompt, dict(PREFILL), max_tokens=1).json()["kv_transfer_params"]
    assert kv["remote_port"] == transfer_port
    _transfer(transfer_port, {"op": "free", "engine_id": kv["remote_engine_id"],
                              "request_id": kv["remote_request_id"]}, answer=False)
    wait_for(lambda: _free(broker)[1] == before, 10, "held blocks released")


def test_a_client_cannot_forge_the_brokers_vouching(stack):
    broker, _, transfer_port = stack
    for kv, ec in ((dict(PREFILL), None), (None, _ec_params("127.0.0.1", transfer_port))):
        req = GenerateRequest(request_id=f"forged-{kv is None}", prompt_token_ids=_prompt(2),
                              params=SamplingParams(max_tokens=1, temperature=0.0), data_parallel_rank=0,
                              kv_transfer_params=kv, ec_transfer_params=ec,
                              transfer_trust=TRUST_KV | TRUST_EC | TRUST_PEERS)
        kind, err = _direct(broker.frontend, req)
        assert kind == "error" and err.status == 400, err
        assert ("--kv-transfer-config" if kv else "--ec-transfer-config") in err.message


def test_prefill_legs_cannot_pin_the_kv_cache(stack):
    broker, http, transfer_port = stack
    before = _free(broker)[1]
    statuses, held = [], []
    for k in range(12):  # 7 blocks each; the cap is half of 64
        r = _gen(http, 1, _prompt(100 + k), dict(PREFILL), max_tokens=1)
        statuses.append(r.status_code)
        if r.status_code == 200:
            held.append(r.json()["kv_transfer_params"])
        else:
            msg = _error(r, 503, "kv_transfer_params")
            assert "too many KV blocks are held for remote decode" in msg and "--kv-transfer-max-held" in msg
    assert statuses == [200] * 4 + [503] * 8, statuses
    assert _free(broker)[1] == before - 4 * 7
    # An ordinary request bigger than what is left after the cap is still served.
    r = _gen(http, 1, _prompt(200, 200), max_tokens=20)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 20, r.text
    # The decode side frees them: prefill legs are taken again.
    for kv in held:
        _transfer(transfer_port, {"op": "free", "engine_id": kv["remote_engine_id"],
                                  "request_id": kv["remote_request_id"]}, answer=False)
    wait_for(lambda: _free(broker)[1] == before, 10, "held blocks released")
    assert _gen(http, 1, _prompt(300), dict(PREFILL), max_tokens=1).status_code == 200


def test_a_request_behind_held_blocks_waits_for_them(stack):
    """Rank 2 lets prefill legs hold the whole cache (--kv-transfer-max-held 1): an ordinary
    request that does not fit next to them waits until they expire (6 s), no 500."""
    broker, http, _ = stack
    for k in range(9):  # 63 of 64 blocks held
        assert _gen(http, 2, _prompt(400 + k), dict(PREFILL), max_tokens=1).status_code == 200
    assert _free(broker)[2] <= 1
    r = _gen(http, 2, _prompt(500, 200), max_tokens=8)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 8, r.text


@pytest.mark.parametrize("host", ["127.0.0.1", "10.20.30.40"])
def test_unknown_transfer_peers_are_refused_and_never_contacted(stack, host):
    broker, http, _ = stack
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        for kv, ec, param in ((_decode_params(host, port), None, "kv_transfer_params"),
                              (None, _ec_params(host, port), "ec_transfer_params")):
            msg = _error(_gen(http, 1, _prompt(3), kv, ec), 400, param)
            assert "unknown transfer peer" in msg
            assert str(port) not in msg and host not in msg
        # A direct ZeroMQ client goes through the same check.
        req = GenerateRequest(request_id="direct-peer", prompt_token_ids=_prompt(3),
                              params=SamplingParams(max_tokens=1), kv_transfer_params=_decode_params(host, port))
        kind, err = _direct(broker.frontend, req)
        assert kind == "error" and err.status == 400 and "unknown transfer peer" in err.message
        with pytest.raises(BlockingIOError):  # nothing connected (the refusals came before any dispatch)
            listener.accept()
    finally:
        listener.close()


def test_a_wrong_engine_id_learns_nothing(stack):
    _, http, transfer_port = stack
    r = _gen(http, 1, _prompt(4), dict(PREFILL), max_tokens=1)
    kv = r.json()["kv_transfer_params"]
    real = kv["remote_engine_id"]
    reply = _transfer(transfer_port, {"op": "pull", "engine_id": "0" * 32, "request_id": kv["remote_request_id"],
                                      "block_ids": kv["remote_block_ids"][0]})
    assert reply["ok"] is False and "unknown engine id" in reply["error"]
    assert real not in msgspec.json.encode(reply).decode()
    # The request id alone (clients may choose those) does not name the transfer: its handle
    # carries a secret only the prefill leg's answer has.
    rid = r.json()["request_id"]
    assert kv["remote_request_id"].startswith(rid + ".") and len(kv["remote_request_id"]) >= len(rid) + 33
    reply = _transfer(transfer_port, {"op": "pull", "engine_id": real, "request_id": rid,
                                      "block_ids": kv["remote_block_ids"][0]})
    assert reply["ok"] is False and "unknown or expired transfer" in reply["error"]
    reply = _transfer(transfer_port, {"op": "pull", "engine_id": real, "request_id": kv["remote_request_id"],
                                      "block_ids": kv["remote_block_ids"][0]})
    assert reply["ok"] is True
    _transfer(transfer_port, {"op": "free", "engine_id": real, "request_id": kv["remote_request_id"]}, answer=False)


def test_the_transfer_server_serves_only_this_clusters_workers(stack):
    """A process that reaches the port but lacks the worker token gets a bare 401 for
    every op, learns nothing, and its attempts change nothing: the real holder's pull
    still works afterwards."""
    _, http, transfer_port = stack
    r = _gen(http, 1, _prompt(5), dict(PREFILL), max_tokens=1)
    kv = r.json()["kv_transfer_params"]
    pull = {"op": "pull", "engine_id": kv["remote_engine_id"], "request_id": kv["remote_request_id"],
            "block_ids": kv["remote_block_ids"][0]}
    free = {"op": "free", "engine_id": kv["remote_engine_id"], "request_id": kv["remote_request_id"]}
    refused = {"ok": False, "status": 401, "error": "unauthorized"}
    assert _transfer(transfer_port, pull, auth=False) == refused
    assert _transfer(transfer_port, {**pull, "auth": "not-the-token"}, auth=False) == refused
    assert _transfer(transfer_port, {"op": "ec_pull", "key": "k"}, auth=False) == refused
    assert _transfer(transfer_port, free, auth=False) == refused  # and the blocks stay held
    reply = _transfer(transfer_port, pull)
    assert reply["ok"] is True
    _transfer(transfer_port, free, answer=False)


def test_the_transfer_link_beyond_loopback_is_curve_keyed_by_the_token(monkeypatch):
    """Across hosts the transfer server is a CURVE server whose key only token holders
    can derive: a plaintext peer, or one guessing another key, never gets an answer
    (not even a 401), while a worker's own pull goes through.  (Loopback stands in for a
    routable address: the test makes every host count as remote.)"""
    from worker.engine.disagg.kv_transfer import HeldTransfers, TransferError, TransferServer, ask

    monkeypatch.setattr(transfer_auth.TransferAuth, "encrypts", lambda self, host: True)
    ctx = zmq.Context.instance()
    server = TransferServer(ctx, "tcp://127.0.0.1:*", "e" * 32, HeldTransfers(), lambda: None)
    server.start()
    try:
        probe = {"op": "pull", "engine_id": "0" * 32, "request_id": "r", "block_ids": [0]}
        with pytest.raises(TransferError) as refused:  # a member: the server answers (unknown engine)
            ask(ctx, "127.0.0.1", server.port, probe, 5.0, "kv_transfer_params")
        assert refused.value.status == 400 and "unknown engine id" in refused.value.message
        for curve_key in (None, zmq.curve_keypair()[0]):  # plaintext; CURVE with a guessed key
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if curve_key is not None:
                public, secret = zmq.curve_keypair()
                sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve_key, public, secret
            sock.connect(f"tcp://127.0.0.1:{server.port}")
            sock.send(msgspec.msgpack.encode(transfer_auth.current().stamp(probe)))  # even with the token
            assert not sock.poll(1500), "an unencrypted or wrongly keyed peer got an answer"
            sock.close()
    finally:
        server.stop()
        server.join(5)


def test_deeply_nested_params_are_a_400_at_the_broker(stack):
    broker, http, _ = stack
    nested: dict = {}
    for _ in range(40):
        nested = {"a": nested}
    req = GenerateRequest(request_id="deep", prompt_token_ids=_prompt(5), params=SamplingParams(max_tokens=1),
                          data_parallel_rank=1, kv_transfer_params=nested)
    kind, err = _direct(broker.frontend, req)
    assert kind == "error" and err.status == 400 and "nested deeper" in err.message, err
    # Thousands deep (more than msgspec will even decode): a 400, and everyone keeps serving.
    body = msgspec.msgpack.encode(GenerateRequest(request_id="deeper", prompt_token_ids=[5, 6],
                                                  kv_transfer_params="PLACEHOLDER"))
    body = body.replace(msgspec.msgpack.encode("PLACEHOLDER"), b"\x81\xa1a" * 50000 + b"\xc0")
    kind, err = _direct(broker.frontend, body)
    assert kind == "error" and err.status == 400 and "nested too deeply" in err.message, err
    for rank in (0, 1):
        assert _gen(http, rank, _prompt(6), max_tokens=2).status_code == 200


def test_broker_runs_a_request_whole_when_its_prefill_worker_is_at_the_cap(tmp_path, llama_dir):
    """--pd auto: a prefill worker that may hold nothing for remote decode (cap 0) answers
    every prefill leg with 503; the broker then runs the request whole on the decode worker."""
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker("--pd", "auto")
        procs.worker(broker, 0, "--model", str(llama_dir), *WORKER_ARGS, "--role", "prefill",
                     "--kv-transfer-max-held", "0")
        procs.worker(broker, 1, "--model", str(llama_dir), *WORKER_ARGS, "--role", "decode")
        wait_for_workers(broker.frontend, 2, timeout=120)
        gw = start_gateway(procs, broker.frontend, "--enable-prompt-tokens-details")  # cached_tokens, as vLLM's flag
        with httpx.Client(base_url=gw.url, timeout=60) as http:
            r = http.post(GENERATE, json={"token_ids": _prompt(7), "sampling_params": {"max_tokens": 5,
                                                                                       "temperature": 0}})
            assert r.status_code == 200, r.text
            body = r.json()
            assert len(body["choices"][0]["token_ids"]) == 5
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed whole, not pulled


# --- units ---------------------------------------------------------------------------------
def test_kv_transfer_config_and_max_held_are_checked_at_start_up():
    from worker.engine.config import EngineConfig
    from worker.engine.disagg.kv_transfer import parse_kv_transfer_config

    assert parse_kv_transfer_config(None) is None
    assert parse_kv_transfer_config(KV_CONFIG) == "kv_both"
    for bad, words in (('{"kv_connector": "LMCacheConnectorV1"}', "not supported"), ("[1]", "JSON object"),
                       ('{"kv_connector": "NixlConnector", "kv_role": "x"}', "kv_role must be"), ("{", "not JSON")):
        with pytest.raises(ValueError, match=words):
            parse_kv_transfer_config(bad)
    with pytest.raises(ValueError, match="kv_transfer_max_held"):
        EngineConfig(model="m", kv_transfer_max_held=1.5)


def test_transfer_param_shapes_are_bounded_without_recursion():
    from common.errors import BadRequest
    from common.transfer_peers import check_shape, ec_peers, kv_peer, parse_address

    deep: list = []
    for _ in range(100000):  # far past Python's recursion limit: checked iteratively
        deep = [deep]
    for bad, words in (({"a": deep}, "nested deeper"), ([1], "JSON object"), ({"a": list(range(70000))}, "too large"),
                       ({1: 2}, "keys must be strings"), ({"a": b"x"}, "unsupported value")):
        with pytest.raises(BadRequest, match=words):
            check_shape(bad, "kv_transfer_params")
    check_shape({"remote_block_ids": [[1, 2]], "x": {"y": None}}, "kv_transfer_params")
    assert kv_peer({"do_remote_prefill": True, "remote_host": "h", "remote_port": 5}) == ("h", 5)
    assert kv_peer({"do_remote_decode": True, "remote_host": "h"}) is None
    with pytest.raises(BadRequest, match="remote_port"):
        kv_peer({"do_remote_prefill": True, "remote_host": "h", "remote_port": True})
    assert ec_peers({"a": {"peer_host": "h", "peer_port": 7}, "b": {"k": 1}, "c": [1]}) == [("h", 7)]
    assert parse_address("127.0.0.1:5555") == ("127.0.0.1", 5555) and parse_address("[::1]:80") == ("::1", 80)
    assert parse_address("nope") is None and parse_address(None) is None and parse_address("h:0") is None
