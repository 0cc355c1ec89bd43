"""Hypothesis fuzz of the OpenAI facade, render, derender and tokenize routes against a
real gateway, broker and worker (tiny Llama, byte tokenizer, the demo chat template,
qwen3 reasoning + hermes tool parsing on, max_model_len 64 so accepted requests finish
quickly).  Wild values in every field may only get 2xx or 4xx (never 5xx); a 200
stream ends with [DONE]; the stack serves normal requests afterwards."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.gateway_helpers import start_gateway
from tests.support.procs import ProcGroup, wait_for_workers
from tests.fuzz.test_fuzz_http import json_values, junk_text, numbers
from worker.engine.loading.demo_model import DEMO_CHAT_TEMPLATE

pytestmark = pytest.mark.timeout(300)

WORKER_ARGS = ("--max-model-len", "64", "--max-num-seqs", "16", "--num-kv-blocks", "128", "--threads", "1")


@pytest.fixture(scope="module")
def gw(tmp_path_factory, llama_dir):
    with ProcGroup(tmp_path_factory.mktemp("fuzz-openai")) as procs:
        broker = procs.broker()
        procs.worker(broker, 0, "--model", str(llama_dir), *WORKER_ARGS)
        wait_for_workers(broker.frontend, 1, timeout=120)
        gateway = start_gateway(procs, broker.frontend, "--tokenizer", str(llama_dir), "--chat-template",
                                DEMO_CHAT_TEMPLATE, "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                                "--enable-auto-tool-choice", "--enable-tokenizer-info-endpoint")
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            yield client


def anything(plausible):
    return plausible | json_values


roles = st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard", ""]) | junk_text
contents = st.text(max_size=30) | st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "refusal"]) | junk_text, "text": junk_text}), max_size=3)
messages = st.lists(anything(st.fixed_dictionaries({"role": roles}, optional={
    "content": anything(contents), "tool_calls": json_values, "name": junk_text,
    "reasoning_content": junk_text})), max_size=4)
tools = st.lists(anything(st.fixed_dictionaries({"type": st.just("function") | junk_text, "function": anything(
    st.fixed_dictionaries({"name": junk_text}, optional={"parameters": json_values, "description": junk_text}))})),
    max_size=3)
SHARED = {
    "n": anything(st.integers(-1, 4)), "temperature": anything(st.floats(-1, 3)), "top_p": numbers,
    "max_tokens": anything(st.integers(-2, 80)), "seed": numbers, "stop": anything(st.lists(junk_text, max_size=3)),
    "stream": anything(st.booleans()), "stream_options": json_values, "logit_bias": json_values,
    "top_k": numbers, "min_p": numbers, "presence_penalty": numbers, "stop_token_ids": json_values,
    "response_format": json_values, "model": junk_text | st.none(), "ignore_eos": st.booleans(),
    "prompt_logprobs": numbers, "truncate_prompt_tokens": numbers, "allowed_token_ids": json_values,
    "cache_salt": junk_text, "priority": numbers, "structured_outputs": json_values,
}
chat_bodies = st.fixed_dictionaries({"messages": anything(messages)}, optional={
    **SHARED, "tools": anything(tools), "tool_choice": json_values | st.sampled_from(["auto", "none", "required"]),
    "logprobs": anything(st.booleans()), "top_logprobs": numbers, "max_completion_tokens": numbers,
    "chat_template_kwargs": json_values, "add_generation_prompt": anything(st.booleans()),
    "continue_final_message": anything(st.booleans()), "echo": anything(st.booleans()),
    "documents": json_values, "include_reasoning": anything(st.booleans()),
    "parallel_tool_calls": anything(st.booleans()), "return_token_ids": anything(st.booleans())})
completion_bodies = st.fixed_dictionaries({"prompt": anything(
    st.text(max_size=30) | st.lists(st.integers(-2, 330), max_size=8) | st.lists(st.text(max_size=5), max_size=3))},
    optional={**SHARED, "logprobs": numbers, "echo": anything(st.booleans()), "suffix": junk_text,
              "add_special_tokens": anything(st.booleans())})
chunks = st.fixed_dictionaries({"request_id": junk_text, "choices": anything(st.lists(st.fixed_dictionaries(
    {"index": numbers, "token_ids": anything(st.lists(st.integers(-2, 330), max_size=6))},
    optional={"finish_reason": junk_text | st.none(), "logprobs": json_values, "stop_reason": json_values}),
    max_size=2))}, optional={"output_mode": st.sampled_from(["tokens", "text"]) | junk_text, "usage": json_values})
derender_bodies = st.fixed_dictionaries({}, optional={
    "stream": anything(st.booleans()), "generate_response": anything(chunks), "generate_responses": anything(
        st.lists(chunks, max_size=2)), "generate_chunk": anything(chunks), "stream_state": json_values,
    "prompt_token_ids": json_values, "prompt_tokens": json_values, "chat_request": anything(chat_bodies),
    "completion_request": json_values})


def _settings(examples: int):
    return settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)


def _check(client: httpx.Client, path: str, body) -> None:
    # NaN / Infinity as Python's json writes them: invalid JSON the server must refuse cleanly.
    r = client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (path, body, r.text[:500])
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n"), r.text[-300:]


@_settings(60)
@given(body=chat_bodies, render=st.booleans())
def test_chat_bodies(gw, body, render):
    _check(gw, "/v1/chat/completions/render" if render else "/v1/chat/completions", body)


@_settings(40)
@given(body=completion_bodies, render=st.booleans())
def test_completion_bodies(gw, body, render):
    _check(gw, "/v1/completions/render" if render else "/v1/completions", body)


@_settings(60)
@given(body=derender_bodies, chat=st.booleans())
def test_derender_bodies(gw, body, chat):
    _check(gw, "/v1/chat/completions/derender" if chat else "/v1/completions/derender", body)


@_settings(30)
@given(body=json_values | st.fixed_dictionaries({}, optional={
    "prompt": junk_text | json_values, "messages": anything(messages), "tokens": anything(
        st.lists(st.integers(-2, 400), max_size=6)), "add_special_tokens": json_values,
    "return_token_strs": json_values, "tools": anything(tools)}), path=st.sampled_from(["/tokenize", "/detokenize"]))
def test_tokenize_bodies(gw, body, path):
    _check(gw, path, body)


def test_still_serving_after_fuzz(gw):
    r = gw.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
