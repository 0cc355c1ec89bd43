"""Structured outputs end to end: the openai client -> gateway (mapping, grammar check) ->
broker -> a real `tokserve worker` (xgrammar bitmask) on the tiny random-weight Qwen3 chat
model, whose unconstrained output is noise: every answer here is valid only because the
constraint reached the engine and the gateway parsed the result (``response_format``,
``tool_choice`` "required" and named, stream and non-stream, ``/inference/v1/generate``,
completions; a ``--reasoning-parser`` gateway with thinking disabled).

Needs the engine side (branch so-engine: ``worker/engine/structured_output``); skipped
without it.  Verified passing (4 tests) on so-gateway merged with so-engine at bc234bc."""
from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from tests.integration.test_openai_http import WORKER_ARGS, build_chat_model
from tests.support.gateway_helpers import GENERATE, start_gateway
from tests.support.procs import ProcGroup, wait_for_workers

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.timeout(600)

CONFIG = '{"backend": "xgrammar", "disable_any_whitespace": true}'
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "Weather?"}]
ARGS = {"model": "", "messages": MESSAGES, "temperature": 0, "max_tokens": 64}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, qwen3_dir):
    return build_chat_model(qwen3_dir, tmp_path_factory.mktemp("qwen-chat") / "model")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, chat_model):
    with ProcGroup(tmp_path_factory.mktemp("so-e2e")) as procs:
        broker = procs.broker()
        procs.worker(broker, 0, "--model", str(chat_model), *WORKER_ARGS, "--structured-outputs-config", CONFIG)
        wait_for_workers(broker.frontend, 1, timeout=180)
        plain = start_gateway(procs, broker.frontend, "--tokenizer", str(chat_model),
                              "--structured-outputs-config", CONFIG)
        reasoning = start_gateway(procs, broker.frontend, "--tokenizer", str(chat_model),
                                  "--structured-outputs-config", CONFIG, "--reasoning-parser", "qwen3")
        yield plain, reasoning


def _client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_response_format_json_schema(stack):
    plain, _ = stack
    out = _client(plain).chat.completions.create(
        **ARGS, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}})
    assert json.loads(out.choices[0].message.content)["city"] in ("Paris", "Oslo")
    assert out.choices[0].finish_reason == "stop"


def test_tool_choice_required_and_named(stack):
    plain, _ = stack
    client = _client(plain)
    out = client.chat.completions.create(**ARGS, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    (call,) = out.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert (call.function.name, set(args)) in (("get_weather", {"city"}), ("get_time", {"zone"}))
    assert out.choices[0].finish_reason == "tool_calls"
    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(**ARGS, tools=TOOLS, tool_choice=named)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    # streamed: the same call, its arguments in pieces
    name, arguments = None, ""
    for chunk in client.chat.completions.create(**ARGS, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False, stream=True):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                name = tc.function.name or name
                arguments += tc.function.arguments or ""
    assert name in ("get_weather", "get_time") and json.loads(arguments)


def test_generate_regex_and_completion_choice(stack):
    plain, _ = stack
    r = httpx.post(plain.url + GENERATE, timeout=300, json={
        "token_ids": [1, 2, 3], "output_mode": "text",
        "sampling_params": {"max_tokens": 16, "temperature": 0, "structured_outputs": {"regex": "[ab]{3}x"}}})
    assert r.status_code == 200, r.text
    assert re.fullmatch("[ab]{3}x", r.json()["choices"][0]["text"]) and r.json()["choices"][0]["finish_reason"] == "stop"
    out = _client(plain).completions.create(model="", prompt="Pick:", max_tokens=16, temperature=0,
                                            extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert out.choices[0].text in ("yes", "no")


def test_reasoning_gateway_with_thinking_disabled_constrains_from_the_start(stack):
    _, reasoning = stack
    out = _client(reasoning).chat.completions.create(
        **ARGS, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": CITY}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert json.loads(out.choices[0].message.content)["city"] in ("Paris", "Oslo")


FREE_CITY = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}}]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tool_choice_required_with_a_free_string_never_loses_the_calls(stack, seed):
    """Issue 39: the grammar finished ("stop") but the message had neither content nor calls --
    the random model's free string held raw control characters, which xgrammar admits and a
    strict JSON parse refused.  The calls reach the client, strict JSON, in both modes."""
    plain, _ = stack
    client = _client(plain)
    args = {**ARGS, "max_tokens": 400, "temperature": 1.0, "seed": seed, "tools": FREE_CITY,
            "tool_choice": "required"}
    out = client.chat.completions.create(**args)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls, choice.message
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    calls: dict[int, list] = {}
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                calls.setdefault(tc.index, [None, ""])
                calls[tc.index][0] = tc.function.name or calls[tc.index][0]
                calls[tc.index][1] += tc.function.arguments or ""
    assert calls and all(name == "get_weather" and set(json.loads(arguments)) == {"city"}
                         for name, arguments in calls.values())


def test_a_grammar_that_admits_nothing_is_a_400_never_free_sampling(stack):
    """``root ::= root`` compiles in xgrammar but allows no token: refused (vLLM would sample
    from an all -inf row and end the request with finish_reason "error")."""
    plain, _ = stack
    with pytest.raises(openai.BadRequestError) as err:
        _client(plain).completions.create(model="", prompt="Hi", max_tokens=20,
                                          extra_body={"structured_outputs": {"grammar": "root ::= root"}})
    assert err.value.status_code == 400 and "admits no output" in err.value.message
    r = httpx.post(plain.url + GENERATE, timeout=300, json={
        "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 8, "structured_outputs": {"grammar": "root ::= root"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text


def test_a_grammar_dead_end_ends_the_request_with_an_error(stack):
    """A state whose mask allows no token (``x ::= x`` after "ab"): the request ends with a 400
    (non-stream) or an error event (stream), and what the model was constrained to ("ab") is
    all it produced -- nothing is sampled from the dead state."""
    plain, _ = stack
    client = _client(plain)
    body = {"model": "", "prompt": "Hi", "max_tokens": 20, "temperature": 0,
            "extra_body": {"structured_outputs": {"grammar": 'root ::= "ab" x\nx ::= x'}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**body)
    assert "allows no token after the output so far" in err.value.message
    text = ""
    with pytest.raises(openai.APIError) as err:
        for chunk in client.completions.create(**body, stream=True):
            text += chunk.choices[0].text or ""
    assert "allows no token after the output so far" in str(err.value.message)
    assert "ab".startswith(text)
