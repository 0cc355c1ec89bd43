"""Pure pieces of the gateway: request mapping (headers, sent keys) and logprob shaping."""
from __future__ import annotations

import math

import msgspec
import pytest

from common.errors import BadRequest, NotFound
from common.protocol import ClusterInfo, ModelInfo, TokenLogprobs, WorkerLoad, WorkerStatus
from gateway.generate_api import logprobs_format
from gateway.generate_api.protocol import generate_request_decoder
from gateway.generate_api.request_mapping import check_model, map_request

MODEL = ModelInfo(name="m", vocab_size=100, max_model_len=64, max_num_seqs=4)
CLUSTER = ClusterInfo(workers=[WorkerStatus(rank=0, load=WorkerLoad()), WorkerStatus(rank=1, load=WorkerLoad()),
                               WorkerStatus(rank=2, load=WorkerLoad(), alive=False)], model=MODEL)


def mapped(body: dict, headers: dict | None = None, names=()):
    http = generate_request_decoder.decode(msgspec.json.encode(body))
    return map_request(http, headers or {}, CLUSTER, MODEL, served_model_names=list(names), arrival_time=1.0)


def test_headers_are_forwarded_to_the_wire_request():
    m = mapped({"token_ids": [1], "sampling_params": {}, "priority": -2, "cache_salt": "s",
                "kv_transfer_params": {"k": 1}},
               {"traceparent": "00-abc-def-01", "tracestate": "x=1", "x-session-id": "sess",
                "x-data-parallel-rank": "1", "x-request-id": "rid", "other": "no"})
    w = m.wire
    assert w.trace_headers == {"traceparent": "00-abc-def-01", "tracestate": "x=1"}
    assert (w.session_id, w.data_parallel_rank, w.request_id) == ("sess", 1, "generate-tokens-rid")
    assert (w.priority, w.cache_salt, w.kv_transfer_params, w.arrival_time) == (-2, "s", {"k": 1}, 1.0)


def test_max_tokens_sent_keys():
    assert mapped({"token_ids": [1], "sampling_params": {}}).wire.params.max_tokens_is_default
    explicit_null = mapped({"token_ids": [1], "sampling_params": {"max_tokens": None}}).wire.params
    assert explicit_null.max_tokens is None and not explicit_null.max_tokens_is_default
    assert mapped({"token_ids": [1], "sampling_params": {"max_tokens": 7}}).wire.params.max_tokens == 7


def test_stop_string_becomes_list_and_stream_options():
    m = mapped({"token_ids": [1], "sampling_params": {"stop": "x"}, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert m.wire.params.stop == ["x"] and m.stream and m.include_usage and m.continuous_usage
    m = mapped({"token_ids": [1], "sampling_params": {}, "stream_options": {"continuous_usage_stats": True}})
    assert not m.continuous_usage  # only together with include_usage, as in vLLM


def test_rank_pinning_and_model_names():
    with pytest.raises(BadRequest, match="data_parallel_rank 2"):
        mapped({"token_ids": [1], "sampling_params": {}}, {"x-data-parallel-rank": "2"})  # dead rank
    assert mapped({"token_ids": [1], "sampling_params": {}}, {"x-data-parallel-rank": "x"}).wire.data_parallel_rank \
        is None
    with pytest.raises(NotFound, match="The model `m` does not exist."):
        mapped({"token_ids": [1], "sampling_params": {}, "model": "m"}, names=["alias"])
    assert mapped({"token_ids": [1], "sampling_params": {}, "model": "alias"}, names=["alias"]).model_name == "alias"


def test_one_model_check_for_every_api():
    """request_mapping.check_model is the only model check (/generate calls it, the OpenAI
    and agent routes through TextRoutes.resolve_model): vLLM's 404 message, pinned."""
    assert check_model(None, ["a", "b"]) is None and check_model("b", ["a", "b"]) is None
    assert check_model("lora1", ["a"], {"lora1": "/p"}) == "lora1"
    with pytest.raises(NotFound) as err:
        check_model("x", ["a", "b"], {"lora1": "/p"})
    assert err.value.message == "The model `x` does not exist. Valid aliases: a, b." and err.value.param == "model"
    assert err.value.status == 404


def _lp(sampled, lp, rank, tops):
    return TokenLogprobs(token_ids=[sampled], logprobs=[lp], ranks=[rank], top_ids=[[t for t, _ in tops]],
                         top_logprobs=[[v for _, v in tops]])


def test_token_logprobs_sampled_first_and_truncated_like_vllm():
    lp = _lp(9, -3.0, 5, [(1, -0.1), (2, -0.2), (3, -0.3)])
    (entry,) = logprobs_format.token_logprobs(lp, 2)
    assert (entry.token_id, entry.rank) == (9, 5)
    assert [(t.token_id, t.rank) for t in entry.top_logprobs] == [(9, 5), (1, 1)]
    (entry,) = logprobs_format.token_logprobs(lp, 0)
    assert [t.token_id for t in entry.top_logprobs] == [9]  # max(k, 1)
    (entry,) = logprobs_format.token_logprobs(lp, -1)
    assert [t.token_id for t in entry.top_logprobs] == [9, 1, 2, 3]
    (entry,) = logprobs_format.token_logprobs(_lp(1, -0.1, 1, [(1, -0.1), (2, -0.2)]), 2)
    assert [t.token_id for t in entry.top_logprobs] == [1, 2]  # no duplicate of the sampled token


def test_logprob_clamping_and_null_rank():
    (entry,) = logprobs_format.token_logprobs(_lp(4, float("nan"), 0, [(4, float("-inf"))]), 1)
    assert entry.logprob == -9999.0 and entry.rank is None
    assert entry.top_logprobs[0].logprob == -9999.0
    assert logprobs_format.clamp(-1e6) == -9999.0 and logprobs_format.clamp(-1.5) == -1.5
    assert not math.isnan(logprobs_format.clamp(float("nan")))


def test_text_logprobs_placeholder_without_text():
    (entry,) = logprobs_format.text_logprobs(_lp(65, -1.0, 1, [(65, -1.0)]), 1)
    assert entry.token == "token_id:65" and entry.bytes is None
    lp = _lp(65, -1.0, 1, [(65, -1.0)])
    lp.token_texts, lp.top_texts = ["é"], [["é"]]
    (entry,) = logprobs_format.text_logprobs(lp, 1)
    assert entry.token == "é" and entry.bytes == [0xC3, 0xA9]


def test_text_logprobs_as_token_ids():
    """return_tokens_as_token_ids: vLLM's _create_chat_logprobs keeps the sampled entry's
    bytes (its decoded text's) and gives the top entries their placeholder's bytes."""
    lp = _lp(65, -1.0, 1, [(65, -1.0), (66, -2.0)])
    lp.token_texts, lp.top_texts = ["é"], [["é", "x"]]
    (entry,) = logprobs_format.text_logprobs(lp, 2, as_token_ids=True)
    assert entry.token == "token_id:65" and entry.bytes == [0xC3, 0xA9]
    assert [(t.token, t.bytes) for t in entry.top_logprobs] == [
        ("token_id:65", list(b"token_id:65")), ("token_id:66", list(b"token_id:66"))]


def test_collective_rpc_allow_list():
    from gateway.resources.dev import map_collective_rpc

    assert map_collective_rpc({"method": "skyrl_sleep_for_weight_sync", "kwargs": {"offload_kv": False}}) == (
        "sleep", {"level": 2, "mode": "keep"})
    assert map_collective_rpc({"method": "skyrl_wake_for_weight_sync", "kwargs": {"tags": ["weights"]}}) == (
        "wake_up", {"tags": ["weights"]})
    assert map_collective_rpc({"method": "update_weights", "args": [{"path": "/x"}]}) == (
        "update_weights", {"update_info": {"path": "/x"}})
    assert map_collective_rpc({"method": "skyrl_finish_weight_update"}) == ("finish_weight_update", {})
    for body, words in [({"method": "exec"}, "'exec'"), ({}, "Missing 'method'"),
                        ({"method": "sleep", "args": [1, 2]}, "takes 1"),
                        ({"method": "sleep", "kwargs": {"level": 3}}, "level"),
                        ({"method": "wake_up", "kwargs": {"tags": "weights"}}, "tags"),
                        ({"method": "sleep", "args": [1], "kwargs": {"level": 1}}, "twice")]:
        with pytest.raises(BadRequest, match=words):
            map_collective_rpc(body)


def test_cluster_info_cache_keeps_answers_but_not_the_absence_of_a_model():
    """A gateway that asked before the first worker registered must see it on the next
    request, not a cached 'no worker yet' for up to ttl (two gateways behind one port
    made the launcher's first request 503 that way)."""
    import asyncio

    from gateway.cluster_info import ClusterInfoCache

    model = ModelInfo(name="m", vocab_size=10, max_model_len=8, max_num_seqs=2, max_logprobs=1)
    answers = [ClusterInfo(model=None, workers=[]), ClusterInfo(model=model, workers=[])]

    class Broker:
        calls = 0

        async def info(self, timeout):
            Broker.calls += 1
            return answers[min(Broker.calls, len(answers)) - 1]

    async def run():
        cache = ClusterInfoCache(Broker(), ttl=60.0)
        assert (await cache.get()).model is None
        assert (await cache.model()) == model  # refetched at once despite the long ttl
        await cache.get()
        await cache.model()
        assert Broker.calls == 2  # a model answer is kept for ttl

    asyncio.run(run())


def test_lora_requests_info_metric_per_lora_worker():
    from gateway.metrics import GatewayMetrics

    m = GatewayMetrics()
    lora = WorkerLoad(max_loras=2, running_loras=["a", "b"], waiting_loras=["c"])
    m.update_cluster(ClusterInfo(workers=[WorkerStatus(rank=0, load=lora), WorkerStatus(rank=1, load=WorkerLoad())],
                                 model=MODEL), "m")
    text = m.render()[0].decode()
    lines = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(lines) == 1  # rank 1 serves no LoRA
    for label in ('engine="0"', 'max_lora="2"', 'running_lora_adapters="a,b"', 'waiting_lora_adapters="c"'):
        assert label in lines[0]
    assert float(lines[0].rsplit(" ", 1)[1]) > 1.6e9  # when it was reported, as vLLM's set_to_current_time


@pytest.mark.parametrize("level, want", [(-1, (1, 0, 0)), (0, (0, 0, 0)), (1, (0, 1, 0)), (2, (0, 0, 1))])
def test_engine_sleep_state_as_vllm_records_it(level, want):
    """vLLM's record_sleep_state: awake until a sleep; level 1 weights_offloaded, level 2
    discard_all, level 0 (a paused scheduler) neither; per engine, with model_name."""
    from gateway.metrics import GatewayMetrics

    m = GatewayMetrics()
    m.update_cluster(ClusterInfo(workers=[WorkerStatus(rank=3, load=WorkerLoad(sleep_level=level))], model=MODEL),
                     "served")
    text = m.render()[0].decode()
    assert "# TYPE vllm:engine_sleep_state gauge" in text
    got = tuple(float(next(line for line in text.splitlines() if line.startswith("vllm:engine_sleep_state{")
                           and f'sleep_state="{state}"' in line).rsplit(" ", 1)[1])
                for state in ("awake", "weights_offloaded", "discard_all"))
    assert got == want
    assert 'vllm:engine_sleep_state{engine="3",model_name="served",sleep_state="awake"}' in text


def test_num_preemptions_per_engine_as_vllm_counts_them():
    from gateway.metrics import GatewayMetrics

    m = GatewayMetrics()
    workers = [WorkerStatus(rank=0, load=WorkerLoad(num_preemptions=7)), WorkerStatus(rank=1, load=WorkerLoad())]
    m.update_cluster(ClusterInfo(workers=workers, model=MODEL), "served")
    text = m.render()[0].decode()
    assert "counter" in next(line for line in text.splitlines() if line.startswith("# TYPE vllm:num_preemptions"))
    assert 'vllm:num_preemptions_total{engine="0",model_name="served"} 7.0' in text
    assert 'vllm:num_preemptions_total{engine="1",model_name="served"} 0.0' in text


def test_stream_errors_keep_their_status_or_become_a_logged_500(caplog):
    """After an SSE stream began, the last event carries the error in vLLM's shape: a
    broker/worker/validation error keeps its status; anything else is logged as a 500."""
    import json

    from common.client import RequestError
    from gateway.errors import stream_error_json

    status, body = stream_error_json(RequestError("worker lost", 503), "r1")
    assert status == 503 and json.loads(body)["error"] == {"message": "worker lost", "type": "ServiceUnavailableError",
                                                           "param": None, "code": 503}
    status, body = stream_error_json(BadRequest("bad", "x"), "r2")
    assert status == 400 and json.loads(body)["error"]["param"] == "x"
    with caplog.at_level("ERROR", logger="tokserve.gateway"):
        status, body = stream_error_json(KeyError("k"), "r3")
    assert status == 500 and json.loads(body)["error"]["message"] == "Internal server error: KeyError"
    assert "r3" in caplog.text and "KeyError" in caplog.text


def test_limit_mm_per_prompt_parsing():
    from gateway.multimodal import parse_mm_limits

    assert parse_mm_limits(None) == {}
    assert parse_mm_limits('{"image": 2, "video": {"count": 0, "num_frames": 8}}') == {"image": 2, "video": 0}
    for bad in ("[1]", "{", '{"image": -1}', '{"image": "2"}', '{"image": true}'):
        with pytest.raises(ValueError):
            parse_mm_limits(bad)
