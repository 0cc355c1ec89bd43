"""The HTTP gateway end to end: real uvicorn gateway, real broker and worker processes
on the tiny Qwen2 checkpoint (generation_config: max_new_tokens=32), started once.

Gateway ``plain``: defaults.  Gateway ``locked``: --tokens-only --api-key
--served-model-name --max-body-bytes, on the same broker.
"""
from __future__ import annotations

import base64
import io
import json
import threading
import time

import httpx
import numpy as np
import pytest

from tests.support.gateway_helpers import (ABORT, GENERATE, gen_body, iter_sse, metric_value, post, sse_payloads,
                                   start_gateway, wait_metric)
from tests.support.procs import ProcGroup, wait_for_workers

API_KEY = "sesame-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SERVED = "tiny-qwen"
WORKER_ARGS = ("--max-num-seqs", "8", "--num-kv-blocks", "256", "--threads", "1")
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]

RESPONSE_KEYS = ["request_id", "model", "created", "usage", "prompt_logprobs", "prompt_token_id_logprobs",
                 "prompt_token_ids", "mm_placeholders", "metrics", "kv_transfer_params", "ec_transfer_params",
                 "output_mode", "choices"]
CHOICE_KEYS = ["index", "finish_reason", "stop_reason", "token_ids", "routed_experts", "sampling_mask",
               "weight_versions", "logprobs"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, qwen2_dir):
    with ProcGroup(tmp_path_factory.mktemp("gateway-stack")) as procs:
        broker = procs.broker()
        procs.worker(broker, 0, "--model", str(qwen2_dir), *WORKER_ARGS)
        wait_for_workers(broker.frontend, 1, timeout=120)
        plain = start_gateway(procs, broker.frontend, "--enable-prompt-tokens-details")  # vLLM's flag: usage.prompt_tokens_details
        locked = start_gateway(procs, broker.frontend, "--tokens-only", "--api-key", API_KEY,
                               "--served-model-name", SERVED, "--max-body-bytes", "4096")
        yield dict(plain=plain, locked=locked, model_dir=qwen2_dir, procs=procs)


@pytest.fixture(scope="module")
def gw(stack):
    return stack["plain"]


@pytest.fixture(scope="module")
def locked(stack):
    return stack["locked"]


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == status
    return body["error"]


# ----------------------------------------------------------------------------- shapes
def test_non_stream_response_has_every_field(gw):
    r = post(gw, {**gen_body(PROMPT, max_tokens=5, temperature=0, ignore_eos=True), "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert list(body) == RESPONSE_KEYS
    assert body["request_id"].startswith("generate-tokens-")
    assert isinstance(body["created"], int) and body["output_mode"] == "tokens"
    assert body["prompt_token_ids"] == PROMPT
    assert body["prompt_logprobs"] is None and body["prompt_token_id_logprobs"] is None
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(PROMPT) and usage["completion_tokens"] == 5
    assert usage["total_tokens"] == len(PROMPT) + 5
    assert "cached_tokens" in usage["prompt_tokens_details"]
    (choice,) = body["choices"]
    assert list(choice) == CHOICE_KEYS
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert len(choice["token_ids"]) == 5 and choice["logprobs"] is None


def test_greedy_output_equals_in_process_engine(gw, stack):
    from common.protocol import GenerateRequest, SamplingParams
    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(stack["model_dir"]), max_num_seqs=8, num_kv_blocks=256, dtype="float32"))
    prompts = [PROMPT, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] * 3, [200, 17]]
    reqs = [GenerateRequest(request_id=f"ref{i}", prompt_token_ids=p,
                            params=SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
            for i, p in enumerate(prompts)]
    reference = engine.generate(reqs)
    for i, p in enumerate(prompts):
        expected = reference[f"ref{i}"][0].token_ids
        r = post(gw, gen_body(p, max_tokens=16, temperature=0, ignore_eos=True))
        assert r.json()["choices"][0]["token_ids"] == expected
        s = post(gw, gen_body(p, stream=True, max_tokens=16, temperature=0, ignore_eos=True))
        streamed = [t for pl in sse_payloads(s)[:-1] for c in json.loads(pl)["choices"] for t in c["token_ids"]]
        assert streamed == expected


def test_stream_chunks_usage_and_done(gw):
    body = {**gen_body(PROMPT, stream=True, max_tokens=4, temperature=1.0, seed=7, ignore_eos=True, n=2),
            "return_token_ids": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    r = post(gw, body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(r)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    *token_chunks, usage_chunk = chunks
    assert "prompt_token_ids" in token_chunks[0] and token_chunks[0]["prompt_token_ids"] == PROMPT
    assert all("prompt_token_ids" not in c for c in token_chunks[1:])
    per_choice = {0: [], 1: []}
    for c in token_chunks:
        assert list(c)[:2] == ["request_id", "usage"] and c["output_mode"] == "tokens"
        (choice,) = c["choices"]  # exactly one choice delta per chunk
        assert list(choice) == CHOICE_KEYS
        per_choice[choice["index"]] += choice["token_ids"]
        assert c["usage"]["completion_tokens"] == len(per_choice[choice["index"]])
    assert [len(v) for v in per_choice.values()] == [4, 4]
    finals = [c["choices"][0] for c in token_chunks if c["choices"][0]["finish_reason"]]
    assert sorted(f["index"] for f in finals) == [0, 1] and {f["finish_reason"] for f in finals} == {"length"}
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 8
    assert usage_chunk["usage"]["prompt_tokens"] == len(PROMPT)
    assert "completion_tokens_details" not in usage_chunk["usage"]  # None fields dropped


def test_stream_without_usage_has_null_usage_and_no_usage_chunk(gw):
    payloads = sse_payloads(post(gw, gen_body(PROMPT, stream=True, max_tokens=3, temperature=0, ignore_eos=True)))
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in chunks)
    assert all("prompt_token_ids" not in c for c in chunks)
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 3


def test_request_id_header_wins_over_body(gw):
    body = {**gen_body(PROMPT, max_tokens=1), "request_id": "from-body"}
    assert post(gw, body).json()["request_id"] == "generate-tokens-from-body"
    r = post(gw, body, headers={"X-Request-Id": "from-header"})
    assert r.json()["request_id"] == "generate-tokens-from-header"


def test_max_tokens_defaulting(gw):
    # Omitted: capped by generation_config.json's max_new_tokens (32), never vLLM's silent 16.
    omitted = post(gw, gen_body(PROMPT, temperature=0, ignore_eos=True)).json()
    assert omitted["usage"]["completion_tokens"] == 32
    # Explicit null: up to max_model_len - prompt_len (1024 - 1000).
    long_prompt = [7] * 1000
    explicit = post(gw, gen_body(long_prompt, temperature=0, ignore_eos=True, max_tokens=None)).json()
    assert explicit["usage"]["completion_tokens"] == 24
    assert explicit["choices"][0]["finish_reason"] == "length"


def test_token_logprobs_and_prompt_logprobs(gw):
    body = gen_body(PROMPT, max_tokens=3, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    r = post(gw, body).json()
    choice = r["choices"][0]
    content = choice["logprobs"]["content"]
    assert [e["token_id"] for e in content] == choice["token_ids"]
    for e in content:
        assert set(e) == {"token_id", "logprob", "rank", "top_logprobs"}
        assert e["rank"] == 1  # greedy picks the top token
        assert len(e["top_logprobs"]) == 2
        assert e["top_logprobs"][0]["token_id"] == e["token_id"]
        assert e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
    prompt_lp = r["prompt_logprobs"]
    assert len(prompt_lp) == len(PROMPT) and prompt_lp[0] is None
    for pos, entry in enumerate(prompt_lp[1:], start=1):
        assert str(PROMPT[pos]) in entry
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())


@pytest.mark.parametrize("prompt", [[PROMPT[0]], PROMPT[:2]])
def test_prompt_logprobs_at_the_edge_lengths(gw, prompt):
    """vLLM's list starts at [null]: a one-token prompt (nothing to score) answers [null],
    not null; two tokens answer [null, {...}]; prompt_logprobs=0 keeps the prompt token only."""
    r = post(gw, gen_body(prompt, max_tokens=1, prompt_logprobs=0))
    assert r.status_code == 200, r.text
    plp = r.json()["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(prompt)
    assert all(list(entry) == [str(t)] for entry, t in zip(plp[1:], prompt[1:]))
    assert post(gw, gen_body(prompt, max_tokens=1)).json()["prompt_logprobs"] is None  # not asked for


def test_prompt_token_id_logprobs_npy(gw):
    rows = [[1, 2], [3, -1], [4, 5]] + [[6, 7]] * (len(PROMPT) - 4)
    r = post(gw, gen_body(PROMPT, max_tokens=1, prompt_logprob_token_ids=rows))
    assert r.status_code == 200, r.text
    array = np.load(io.BytesIO(base64.b64decode(r.json()["prompt_token_id_logprobs"])), allow_pickle=False)
    assert array.dtype == np.float32 and array.shape == (len(rows), 2)
    assert np.isneginf(array[1, 1]) and np.all(array[0] < 0)


def test_text_mode_text_logprobs_and_stop_string(gw):
    base = post(gw, {**gen_body(PROMPT, max_tokens=12, temperature=0, ignore_eos=True, logprobs=1),
                     "output_mode": "text"}).json()
    assert base["output_mode"] == "text"
    choice = base["choices"][0]
    assert list(choice)[-2:] == ["text", "logprobs"]
    entry = choice["logprobs"]["content"][0]
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
    assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
    text = choice["text"]
    assert text
    # Stop on the first whole character after the first one (random byte tokens also
    # decode to U+FFFD, which can't be a stop string); the output is cut before it.
    at = next(i for i, ch in enumerate(text) if i and ch != "\ufffd")
    stop = text[at]
    cut = post(gw, {**gen_body(PROMPT, max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]),
                    "output_mode": "text"}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert cut["text"] == text[:text.index(stop)]
    assert len(cut["token_ids"]) < 12


def test_integral_floats_are_ints_as_in_vllm(gw):
    """vLLM's pydantic models take 1e18 for an int field (10**18, then capped by the context
    like any int) and 2.0 for 2; a fractional number stays a 400."""
    prompt = [3 + i % 200 for i in range(1020)]  # max_model_len 1024: room for 4
    r = post(gw, json.dumps(gen_body(prompt, max_tokens=1e18, n=1.0, ignore_eos=True, temperature=0)))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length"
    r = post(gw, {"token_ids": [5.0, 6.0, 7e0], "sampling_params": {"max_tokens": 2.0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {**r.json()["usage"], "prompt_tokens": 3, "completion_tokens": 2}
    err = error_of(post(gw, gen_body(PROMPT, max_tokens=2.5)), 400)
    assert "fractional part" in err["message"] and err["param"] == "body.sampling_params.max_tokens", err
    err = error_of(post(gw, {"token_ids": [5, 6.5], "sampling_params": {}}), 400)
    assert "fractional part" in err["message"] and err["param"] == "body.token_ids.1", err


@pytest.mark.parametrize("body, param", [
    ({"token_ids": [1, "x"], "sampling_params": {}}, "body.token_ids.1"),
    ({"sampling_params": {}}, "body.token_ids"),
    ({"token_ids": [1], "sampling_params": {"n": "two"}}, "body.sampling_params.n"),
    ({"token_ids": [1], "sampling_params": {}, "stream": "yes"}, "body.stream"),
])
def test_mistyped_fields_are_named_in_vllms_location_form(gw, body, param):
    """vLLM's validation handler joins pydantic's loc: ``body.sampling_params.n``."""
    err = error_of(post(gw, body), 400)
    assert err["param"] == param and err["type"] == "BadRequestError", err


def test_prefix_cache_reports_cached_tokens(gw):
    prompt = list(range(40, 40 + 64))
    post(gw, gen_body(prompt, max_tokens=1))
    second = post(gw, gen_body(prompt, max_tokens=1)).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_kv_transfer_params_pass_through_and_ec_ones_answer_none(gw):
    body = {**gen_body(PROMPT, max_tokens=1), "kv_transfer_params": {"remote": "x", "n": 1},
            "ec_transfer_params": {"e": [1]}, "priority": -3, "cache_salt": "salty"}
    r = post(gw, body, headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                                "X-Session-ID": "sess-1"}).json()
    assert r["kv_transfer_params"] == {"remote": "x", "n": 1}
    assert r["ec_transfer_params"] is None  # only an encoder worker answers with any (as vLLM)


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("body, status, needle", [
    (b'{"token_ids": [1,', 400, "JSON"),
    ({"token_ids": [1]}, 400, "sampling_params"),
    ({"token_ids": [], "sampling_params": {}}, 400, "token_ids"),
    ({"token_ids": [1, -2], "sampling_params": {}}, 400, "token_ids must not contain negative values"),
    ({"token_ids": [1, 400], "sampling_params": {}}, 400, "Token id 400 is out of vocabulary"),
    ({"token_ids": ["a"], "sampling_params": {}}, 400, "token_ids"),
    ({"token_ids": [1], "sampling_params": {"temperature": None}}, 400, "temperature"),
    ({"token_ids": [1], "sampling_params": {"temperature": 3.0}}, 400, "temperature"),
    ({"token_ids": [1], "sampling_params": {"n": "2"}}, 400, "n"),
    ({"token_ids": [1], "sampling_params": {"n": 9}}, 400, "at most the server's max_num_seqs (8), got 9"),
    ({"token_ids": [1], "sampling_params": {"n": 2, "temperature": 0}}, 400, "n must be 1 when using greedy sampling, got 2."),
    ({"token_ids": [1], "sampling_params": {"max_tokens": 0}}, 400, "max_tokens"),
    ({"token_ids": [1], "sampling_params": {}, "output_mode": "words"}, 400, "output_mode"),
    ({"token_ids": [1], "sampling_params": {}, "output_mode": None}, 400, "output_mode"),
    ({"token_ids": [1], "sampling_params": {"detokenize": False}, "output_mode": "text"}, 400, "detokenize"),
    ({"token_ids": [1], "sampling_params": {"prompt_logprob_token_ids": [[1]]}, "stream": True}, 400,
     "not available when stream=true"),
    ({"token_ids": [1], "sampling_params": {}, "cache_salt": "a/b"}, 400, "cache_salt"),
    ({"token_ids": [1], "sampling_params": {"seed": 2 ** 70}}, 400, "seed"),
    ({"token_ids": [1], "sampling_params": {}, "model": "nope"}, 404, "The model `nope` does not exist."),
    # vLLM fields this server does not serve: refused by name, never silently dropped.
    ({"token_ids": [1], "sampling_params": {}, "features": {"mm_hashes": {"image": ["h"]}}}, 400,
     "`features` is not supported by this server."),
    ({"token_ids": [1], "sampling_params": {}, "content_parts": [{"type": "image_url"}]}, 400,
     "`content_parts` is not supported by this server."),
    # structured outputs are served: a constraint that does not convert is vLLM's 400
    ({"token_ids": [1], "sampling_params": {"structured_outputs": {"regex": "(a"}}}, 400,
     "Failed to transform regex into a grammar"),
    # ... and typed as vLLM types them
    ({"token_ids": [1], "sampling_params": {}, "features": "image"}, 400, "features"),
    ({"token_ids": [1], "sampling_params": {"output_kind": 3}}, 400, "sampling_params.output_kind"),
    ({"token_ids": [1], "sampling_params": {"logprob_token_ids": ["a"]}}, 400, "sampling_params.logprob_token_ids[0]"),
    ({"token_ids": [1], "sampling_params": {}, "reasoning_ended": "yes"}, 400, "reasoning_ended"),
    ({"token_ids": [1], "sampling_params": {}, "reasoning_parser_kwargs": {"enable_thinking": True}}, 400,
     "reasoning_parser_kwargs"),  # vLLM's model forbids extra keys
])
def test_bad_requests_get_vllm_errors(gw, body, status, needle):
    err = error_of(post(gw, body), status)
    assert needle in err["message"] or needle == err["param"], err
    assert err["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


# A value other than the default for every sampling field vLLM 0.32 has and this server
# does not serve; each must be a 400 naming it (one table, so a field added to
# unserved_fields.SAMPLING_FIELDS without a case here fails test_every_unserved_field_has_a_case).
UNSERVED_SAMPLING_VALUES = {
    "watermarking": True,
    "prompt_logprob_start": 2,
    "logprob_token_ids": [3, 4],
    "stream_interval": 4,
    "extra_args": {"x": 1},
    "skip_reading_prefix_cache": True,
    "thinking_token_budget": 8,
    "repetition_detection": {"max_pattern_size": 4},
    "trace_decode_token_ids": [5, 6],
}
# vLLM 0.32 SamplingParams' public fields (vllm/sampling_params.py), every one decoded here.
VLLM_SAMPLING_FIELDS = {
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "watermarking", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "prompt_logprob_token_ids", "prompt_logprob_start", "logprob_token_ids", "flat_logprobs",
    "detokenize", "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "output_kind", "stream_interval", "skip_clone", "output_text_buffer_length", "structured_outputs",
    "logit_bias", "allowed_token_ids", "extra_args", "bad_words", "skip_reading_prefix_cache",
    "thinking_token_budget", "repetition_detection", "routed_experts_prompt_start", "trace_decode_token_ids",
}
# vLLM GenerateRequest's fields (token_in_token_out/protocol.py; parse_context: 0.33).
VLLM_REQUEST_FIELDS = {
    "request_id", "token_ids", "token_offsets", "features", "content_parts", "sampling_params", "model",
    "reasoning_ended", "reasoning_parser_kwargs", "return_token_ids", "output_mode", "parse_context", "stream",
    "stream_options",
    "cache_salt", "priority", "kv_transfer_params", "ec_transfer_params",
}


def test_every_vllm_field_is_decoded_and_every_unserved_field_has_a_case():
    """A vLLM field msgspec did not know would be dropped without a word."""
    from gateway.generate_api import unserved_fields
    from gateway.generate_api.protocol import HttpGenerateRequest, HttpSamplingParams

    assert set(HttpSamplingParams.__struct_fields__) == VLLM_SAMPLING_FIELDS
    assert set(HttpGenerateRequest.__struct_fields__) == VLLM_REQUEST_FIELDS
    assert set(unserved_fields.SAMPLING_FIELDS) == set(UNSERVED_SAMPLING_VALUES)


@pytest.mark.parametrize("field", sorted(UNSERVED_SAMPLING_VALUES))
def test_unserved_sampling_fields_are_refused_by_name(gw, field):
    body = gen_body(PROMPT, max_tokens=2)
    body["sampling_params"][field] = UNSERVED_SAMPLING_VALUES[field]
    for stream in (False, True):
        err = error_of(post(gw, {**body, "stream": stream}), 400)
        assert err == {"message": f"`sampling_params.{field}` is not supported by this server.",
                       "type": "BadRequestError", "param": f"sampling_params.{field}", "code": 400}


def test_unserved_fields_at_their_defaults_are_accepted(gw):
    """Clients that serialise every field (vLLM's own model_dump) send the unserved ones as
    their defaults: the request is served and its output is the plain request's."""
    plain = post(gw, gen_body(PROMPT, max_tokens=4, temperature=0, ignore_eos=True))
    assert plain.status_code == 200, plain.text
    body = {**gen_body(PROMPT, max_tokens=4, temperature=0, ignore_eos=True), "features": None,
            "content_parts": [], "token_offsets": [[0, 1]] * len(PROMPT)}
    body["sampling_params"].update(watermarking=False, prompt_logprob_start=None, logprob_token_ids=None,
                                   stream_interval=None, output_text_buffer_length=0, structured_outputs=None,
                                   extra_args={}, skip_reading_prefix_cache=False, thinking_token_budget=None,
                                   repetition_detection=None, routed_experts_prompt_start=0,
                                   trace_decode_token_ids=None)
    r = post(gw, body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]
    # True/1 are not the defaults False/0 (bool is an int in Python)
    body["sampling_params"]["watermarking"] = 1
    error_of(post(gw, body), 400)


def test_inert_fields_and_render_reasoning_fields_are_accepted(gw):
    """What vLLM's /render sends for a reasoning model (reasoning_ended, reasoning_parser_kwargs:
    they only gate structured outputs, refused here) and sampling fields vLLM's generate
    endpoint overrides or that only shape its internals are served, output unchanged."""
    plain = post(gw, gen_body(PROMPT, max_tokens=4, temperature=0, ignore_eos=True, logprobs=1))
    assert plain.status_code == 200, plain.text
    body = {**gen_body(PROMPT, max_tokens=4, temperature=0, ignore_eos=True, logprobs=1,
                       output_kind=2, flat_logprobs=True, skip_clone=True),
            "reasoning_ended": True, "reasoning_parser_kwargs": {"chat_template_kwargs": {"enable_thinking": False}}}
    r = post(gw, body)
    assert r.status_code == 200, r.text
    got, want = r.json()["choices"][0], plain.json()["choices"][0]
    assert got["token_ids"] == want["token_ids"]
    assert [e["token_id"] for e in got["logprobs"]["content"]] == [e["token_id"] for e in want["logprobs"]["content"]]
    # Streaming still streams (output_kind=2, FINAL_ONLY, is overridden as in vLLM).
    payloads = sse_payloads(post(gw, {**body, "stream": True}))
    assert payloads[-1] == "[DONE]"
    assert [t for p in payloads[:-1] for t in json.loads(p)["choices"][0]["token_ids"]] == want["token_ids"]
    assert len(payloads) - 1 >= 2  # deltas, not one final output


def test_fields_vllm_does_not_have_are_ignored_as_vllm_ignores_them(gw):
    """vLLM's GenerateRequest has no LoRA field (an adapter is chosen by `model`, and an
    unknown name is a 404); pydantic ignores unknown keys, so does this server."""
    r = post(gw, {**gen_body(PROMPT, max_tokens=2), "lora_request": {"lora_name": "x"}, "lora_name": "x"})
    assert r.status_code == 200, r.text
    assert error_of(post(gw, {**gen_body(PROMPT, max_tokens=2), "model": "my-lora"}), 404)["param"] == "model"


def test_stream_errors_before_first_token_keep_http_status(gw):
    err = error_of(post(gw, gen_body([1, 400], stream=True)), 400)
    assert "out of vocabulary" in err["message"]


def test_content_type_and_data_parallel_rank(gw):
    r = httpx.post(gw.url + GENERATE, content=json.dumps(gen_body([1], max_tokens=1)),
                   headers={"content-type": "text/plain"})
    assert "application/json" in error_of(r, 400)["message"]
    err = error_of(post(gw, gen_body([1], max_tokens=1), headers={"X-data-parallel-rank": "5"}), 400)
    assert "data_parallel_rank 5" in err["message"]
    ok = post(gw, gen_body([1], max_tokens=1), headers={"X-data-parallel-rank": "0"})
    assert ok.status_code == 200


def test_unknown_route_and_method(gw):
    error_of(httpx.get(gw.url + "/nope"), 404)
    error_of(httpx.get(gw.url + GENERATE), 405)


# ----------------------------------------------------------------------------- abort
def _long_stream(gw, rid: str, headers=None):
    body = gen_body(PROMPT, stream=True, max_tokens=900, temperature=0, ignore_eos=True)
    return httpx.stream("POST", gw.url + GENERATE, json=body, timeout=60,
                        headers={"X-Request-Id": rid, **(headers or {})})


def test_abort_endpoint_ends_stream_with_abort_chunk(gw):
    with _long_stream(gw, "to-abort") as resp:
        payloads = iter_sse(resp.iter_lines())
        first = json.loads(next(payloads))
        assert first["request_id"] == "generate-tokens-to-abort"
        t0 = time.monotonic()
        assert httpx.post(gw.url + ABORT, json={"request_ids": ["to-abort"]}).status_code == 200
        rest = list(payloads)
    assert rest[-1] == "[DONE]"
    last = json.loads(rest[-2])["choices"][0]
    assert last["finish_reason"] == "abort"
    assert time.monotonic() - t0 < 5
    tokens = len(first["choices"][0]["token_ids"]) + sum(len(json.loads(p)["choices"][0]["token_ids"])
                                                         for p in rest[:-1])
    assert tokens < 900


def test_abort_endpoint_validation(gw):
    assert "request_ids" in error_of(post(gw, {}, path=ABORT), 400)["message"]
    error_of(post(gw, b"{oops", path=ABORT), 400)
    assert post(gw, {"request_ids": ["never-existed"]}, path=ABORT).status_code == 200


def test_client_disconnect_aborts_request(gw):
    before = metric_value(httpx.get(gw.url + "/metrics").text, "vllm:request_success_total", finished_reason="abort")
    with _long_stream(gw, "walk-away") as resp:
        next(iter_sse(resp.iter_lines()))
    # Leaving the block closed the connection mid-stream: the gateway must abort the request.
    # Well inside the gateway's 5 s grace: the worker's own abort delta ended the request.
    after = wait_metric(gw.url, "vllm:request_success_total", before + 1, timeout=3, finished_reason="abort")
    assert after >= before + 1


def test_client_disconnect_aborts_non_stream_request(gw):
    before = metric_value(httpx.get(gw.url + "/metrics").text, "vllm:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(gw.url + GENERATE, json=gen_body(PROMPT, max_tokens=900, ignore_eos=True), timeout=0.5)
    # Well inside the gateway's 5 s grace: the worker's own abort delta ended the request.
    after = wait_metric(gw.url, "vllm:request_success_total", before + 1, timeout=3, finished_reason="abort")
    assert after >= before + 1


# ----------------------------------------------------------------------------- ops routes
def test_health_models_version_and_metrics(gw):
    health = httpx.get(gw.url + "/health")
    assert health.status_code == 200
    # vLLM's bare Response(status_code=200): an empty body and no content-type.
    assert health.content == b"" and "content-type" not in health.headers
    assert health.headers["content-length"] == "0"
    models = httpx.get(gw.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["max_model_len"] == 1024
    assert "version" in httpx.get(gw.url + "/version").json()
    post(gw, gen_body(PROMPT, stream=True, max_tokens=3, ignore_eos=True))
    text = httpx.get(gw.url + "/metrics").text
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:kv_cache_usage_perc"):
        assert name in text, name
    assert metric_value(text, "vllm:generation_tokens_total") >= 3
    assert metric_value(text, "vllm:time_to_first_token_seconds_count") >= 1


def test_broker_metrics_and_the_dashboard_query_only_exported_names(gw):
    """deploy/grafana/tokserve.json: every metric it queries is one /metrics exports."""
    import json
    import re
    from pathlib import Path

    import time

    post(gw, gen_body(PROMPT, max_tokens=2))
    deadline = time.monotonic() + 5
    while True:  # the gateway caches the broker's answer for a second
        text = httpx.get(gw.url + "/metrics").text
        if metric_value(text, "tokserve:broker_requests_dispatched_total") >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert metric_value(text, "tokserve:broker_live_workers") == 1
    assert metric_value(text, "tokserve:broker_requests_dispatched_total") >= 1
    assert metric_value(text, "tokserve:broker_pending_requests") == 0
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    # Labelled series appear once observed; their family is declared from the start.
    declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}
    exported |= {f"{name}{suffix}" for name in declared for suffix in ("", "_total", "_bucket", "_count", "_sum")}
    dash = json.loads((Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "tokserve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    queried = {m for e in exprs for m in re.findall(r"\b((?:vllm|tokserve):[a-zA-Z0-9_:]+)", e)}
    assert len(queried) >= 15
    missing = sorted(queried - exported)
    assert not missing, missing


def test_concurrent_streams_are_independent(gw):
    results = {}

    def run(i: int) -> None:
        r = post(gw, gen_body([i + 1, i + 2, i + 3], stream=True, max_tokens=6, temperature=0, ignore_eos=True))
        chunks = [json.loads(p) for p in sse_payloads(r)[:-1]]
        results[i] = (chunks[0]["request_id"], [t for c in chunks for t in c["choices"][0]["token_ids"]],
                      {c["request_id"] for c in chunks})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 6
    for rid, tokens, ids in results.values():
        assert len(tokens) == 6 and ids == {rid}
    solo = post(gw, gen_body([3, 4, 5], max_tokens=6, temperature=0, ignore_eos=True)).json()
    assert solo["choices"][0]["token_ids"] == results[2][1]


# ----------------------------------------------------------------------------- --api-key, --tokens-only
def test_api_key_guards_v1_and_inference_paths(locked):
    for path in (GENERATE, ABORT):
        r = post(locked, gen_body([1], max_tokens=1), path=path)
        assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
        r = post(locked, gen_body([1], max_tokens=1), path=path, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
    assert httpx.get(locked.url + "/v1/models").status_code == 401
    assert httpx.get(locked.url + "/v1/models", headers=AUTH).json()["data"][0]["id"] == SERVED
    assert httpx.get(locked.url + "/health").status_code == 200
    assert httpx.get(locked.url + "/metrics").status_code == 200


def test_tokens_only_server(locked):
    ok = post(locked, {**gen_body(PROMPT, max_tokens=2, ignore_eos=True), "model": SERVED}, headers=AUTH)
    assert ok.status_code == 200 and ok.json()["model"] == SERVED
    err = error_of(post(locked, gen_body([1], stop=["x"]), headers=AUTH), 400)
    assert "stop strings" in err["message"]
    err = error_of(post(locked, {**gen_body([1]), "output_mode": "text"}, headers=AUTH), 400)
    assert "requires a tokenizer" in err["message"]
    error_of(post(locked, {**gen_body([1]), "model": "other"}, headers=AUTH), 404)


def test_oversized_body_gets_413(locked):
    r = post(locked, gen_body(list(range(300)) * 10), headers=AUTH)
    assert error_of(r, 413)["type"]


def test_health_is_503_without_workers(tmp_path):
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker()
        lonely = start_gateway(procs, broker.frontend, wait_healthy=False)
        health = httpx.get(lonely.url + "/health")
        assert health.status_code == 503
        assert health.content == b"" and "content-type" not in health.headers  # vLLM's Response(status_code=503)
        err = error_of(post(lonely, gen_body([1], max_tokens=1)), 503)
        assert err["type"] == "ServiceUnavailableError"
