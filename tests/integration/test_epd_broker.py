"""Broker-native encoder disaggregation (``--epd auto``, broker/disagg.py): a plain worker
(rank 0) and an encoder-only worker (rank 1); unpinned image requests run their vision
encoder on rank 1 first and then on rank 0 with the pulled encodings, giving what rank 0
alone gives; text requests never see rank 1; and when rank 1 dies image requests still
run (rank 0 encodes their pixels)."""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import httpx
import pytest

pytest.importorskip("transformers")

from tests.support.gateway_helpers import GENERATE, metric_value, start_gateway, wait_metric  # noqa: E402
from tests.support.procs import ProcGroup, cluster_info, wait_for, wait_for_workers  # noqa: E402
from tests.integration.test_mm_chat import WORKER_ARGS, model_dir  # noqa: E402,F401
from tests.integration.test_mm_http import _body, _data_url, _part, _png, _prompt  # noqa: E402

PRODUCER = json.dumps({"ec_connector": "ECCPUConnector", "ec_role": "ec_producer"})
QUERIES = "vllm:mm_cache_queries_total"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dir):
    with ProcGroup(tmp_path_factory.mktemp("epd-broker")) as procs:
        broker = procs.broker("--epd", "auto")
        procs.worker(broker, 0, "--model", str(model_dir), *WORKER_ARGS)
        encoder = procs.worker(broker, 1, "--model", str(model_dir), *WORKER_ARGS, "--ec-transfer-config",
                               PRODUCER, "--mm-encoder-only")
        wait_for_workers(broker.frontend, 2, timeout=120)
        gw = start_gateway(procs, broker.frontend, "--tokenizer", str(model_dir))
        with httpx.Client(base_url=gw.url, timeout=60) as http:
            yield broker, encoder, http


def _queries(http, engine: str) -> float:
    return metric_value(http.get("/metrics").text, QUERIES, engine=engine)


def test_image_requests_encode_on_the_encoder_worker(stack):
    _, _, http = stack
    for k, counts in enumerate(([4], [4, 6])):
        pngs = [_png(90 + 10 * k + j, 56 if n == 4 else 84, 56) for j, n in enumerate(counts)]
        ids = _prompt(counts)
        body = _body(ids, [_part(_data_url(p)) for p in pngs], return_token_ids=True)
        body["sampling_params"]["logprobs"] = 1
        before = _queries(http, "1")
        r = http.post(GENERATE, json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert len(out["choices"][0]["token_ids"]) == 6
        assert out.get("ec_transfer_params") is None  # the legs' parameters stay in the broker
        # rank 1 ran the vision tower on every image
        assert wait_metric(http.base_url.__str__().rstrip("/"), QUERIES, before + len(pngs), engine="1") >= \
            before + len(pngs)
        # the same request on rank 0 alone (its own encoder, no prefix-cache sharing)
        ref = http.post(GENERATE, json={**body, "cache_salt": f"ref{k}"}, headers={"X-data-parallel-rank": "0"})
        assert ref.status_code == 200, ref.text
        assert ref.json()["choices"][0]["token_ids"] == out["choices"][0]["token_ids"]
        got = [e["logprob"] for e in out["choices"][0]["logprobs"]["content"]]
        want = [e["logprob"] for e in ref.json()["choices"][0]["logprobs"]["content"]]
        assert got == pytest.approx(want, abs=1e-4)


def test_text_and_streamed_requests(stack):
    _, _, http = stack
    for k in range(8):  # never the encoder-only worker (it would answer with no tokens)
        r = http.post(GENERATE, json={"token_ids": [5, 6, 7 + k], "sampling_params": {"max_tokens": 3}})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3, r.text
    body = _body(_prompt([4]), [_part(_data_url(_png(120, 56, 56)))])
    with http.stream("POST", GENERATE, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    assert sum(len(c["choices"][0].get("token_ids") or []) for c in chunks if c.get("choices")) == 6


def test_requests_run_without_the_encoder_worker(stack):
    """The encoder worker hangs with an encode leg on it, then dies: the request runs on
    rank 0 (which encodes its pixels); later image requests too."""
    broker, encoder, http = stack
    body = _body(_prompt([6]), [_part(_data_url(_png(130, 84, 56)))])
    ref = http.post(GENERATE, json={**body, "cache_salt": "ref"}, headers={"X-data-parallel-rank": "0"})
    assert ref.status_code == 200, ref.text
    os.kill(encoder.pid, signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(http.post, GENERATE, json=body)
            time.sleep(1.0)  # dispatched to the stopped encoder worker
            assert not pending.done()
            encoder.kill9()
            r = pending.result(timeout=60)
    finally:
        encoder.kill9()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == ref.json()["choices"][0]["token_ids"]
    wait_for(lambda: len([w for w in cluster_info(broker.frontend).workers if w.alive]) == 1, 30,
             "the broker to drop the encoder worker")
    r = http.post(GENERATE, json=_body(_prompt([4]), [_part(_data_url(_png(131, 56, 56)))]))
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 6, r.text


def _in_process_broker():
    from broker.broker import Broker, BrokerConfig
    from broker.workers import Worker
    from common.protocol import ModelInfo, WorkerLoad

    b = Broker(BrokerConfig(frontend="tcp://127.0.0.1:0", backend="tcp://127.0.0.1:0", epd="auto",
                            max_inflight_per_worker=1, routing="least-loaded", allow_unauthenticated_tcp_frontend=True))
    sent: list = []
    b.links.to_worker = lambda w, frames: (sent.append((w.rank, frames)), True)[1]
    b.links.to_client = lambda c, frames: True
    info = ModelInfo(name="m", vocab_size=10, max_model_len=100, max_num_seqs=4)
    lm, enc = Worker(b"lm", 0, info, WorkerLoad(max_num_seqs=4)), Worker(b"enc", 1, info, WorkerLoad(max_num_seqs=4),
                                                                        role="encode")
    b.workers.add(lm)
    b.workers.add(enc)
    return b, lm, enc, sent


def _image_request(rid: str):
    from common import framing
    from common.protocol import GenerateRequest, MultiModalItem, SamplingParams

    item = MultiModalItem("image", "h" + rid, 1, 1, [1, 2, 2], b"\0" * (28 * 28 * 3), [28, 28, 3], "uint8_hwc")
    return framing.encode(GenerateRequest(request_id=rid, prompt_token_ids=[1, 5, 2], mm_items=[item],
                                          params=SamplingParams(max_tokens=3)))


def test_queued_encode_legs_run_without_them_once_no_encoder_is_left():
    b, lm, enc, _ = _in_process_broker()
    for rid in ("r1", "r2"):
        b.admission.on_generate(b"client", _image_request(rid))
    assert b.table.requests["r1"].worker is enc and b.table.requests["r2"].queued  # one in flight per worker
    b.membership.worker_gone(enc, "died")  # r1's leg falls back to the language-model worker
    r1 = b.table.requests["r1"]
    assert r1.leg is None and r1.worker is lm
    b.table.finish(r1)  # capacity again: r2 must not wait for an encoder that will not come
    b.router.dispatch_pending()
    r2 = b.table.requests["r2"]
    assert r2.leg is None and r2.roles == () and r2.worker is lm


def test_an_encode_leg_error_runs_the_request_without_it():
    from common import framing
    from common.protocol import ErrorMsg, MsgType

    b, lm, enc, sent = _in_process_broker()
    b.admission.on_generate(b"client", _image_request("r1"))
    assert b.table.requests["r1"].worker is enc
    err = framing.encode(ErrorMsg(request_id="r1", status=500, message="boom", type="InternalServerError"))
    b._on_backend([enc.identity, *framing.message(MsgType.ERROR, err, b"client")])
    e = b.table.requests["r1"]  # not failed: sent on to the language-model worker, pixels and all
    assert e.leg is None and e.worker is lm and sent[-1][0] == lm.rank
