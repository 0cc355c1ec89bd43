"""Structured outputs through the real stack's front half: broker, gateways (Qwen3 chat template,
``--structured-outputs-config``) and a fake worker that records the ``structured_outputs`` each
request brought and answers text requests with a scripted reply (tests/support/fake_worker.py).

What reaches the worker for ``/inference/v1/generate``, ``response_format`` (openai client),
``tool_choice="required"`` / named (the schema, and the reply parsed into ``tool_calls``,
stream and non-stream), completions, render -> generate, the Responses / Messages render
routes, the reasoning markers of a ``--reasoning-parser`` gateway; and the 400s (vLLM's error
shape, with the reason) for constraints that are bad, doubled or missing, none of which reaches
the worker."""
from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.test_openai_http import TOOLS, build_chat_model
from tests.support.gateway_helpers import GENERATE, start_gateway
from tests.support.procs import ProcGroup, wait_for_workers

WEATHER = TOOLS[0]["function"]["parameters"]
CONFIG = '{"backend": "xgrammar", "disable_any_whitespace": true}'


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, qwen3_dir) -> Path:
    return build_chat_model(qwen3_dir, tmp_path_factory.mktemp("qwen-chat") / "model")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, chat_model):
    root = tmp_path_factory.mktemp("so-stack")
    records, reply = root / "records", root / "reply.json"
    records.mkdir()
    reply.write_text(json.dumps({"text": "hello", "chunk": 4}))
    with ProcGroup(root / "logs") as procs:
        broker = procs.broker()
        procs.fake_worker(broker, 0, "--has-tokenizer", "--reply-file", str(reply), "--record-dir", str(records))
        wait_for_workers(broker.frontend, 1, timeout=60)
        plain = start_gateway(procs, broker.frontend, "--tokenizer", str(chat_model),
                              "--structured-outputs-config", CONFIG)
        reasoning = start_gateway(procs, broker.frontend, "--tokenizer", str(chat_model),
                                  "--reasoning-parser", "qwen3")
        yield {"plain": plain, "reasoning": reasoning, "records": records, "reply": reply}


def _reply(stack, text: str, chunk: int = 4) -> None:
    stack["reply"].write_text(json.dumps({"text": text, "chunk": chunk}))


def _record(stack, request_id: str):
    path = stack["records"] / f"{request_id}.json"
    return json.loads(path.read_text())["structured_outputs"] if path.exists() else "absent"


def _client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _rid() -> str:
    return uuid.uuid4().hex


MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


# ---------------------------------------------------------------- /inference/v1/generate
def test_generate_sends_the_constraint_to_the_worker(stack):
    rid = _rid()
    r = httpx.post(stack["plain"].url + GENERATE, headers={"X-Request-Id": rid}, timeout=60, json={
        "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "structured_outputs": {"json": WEATHER}}})
    assert r.status_code == 200, r.text
    got = _record(stack, f"generate-tokens-{rid}")
    assert json.loads(got["json"]) == WEATHER
    # the server config's whitespace default; no reasoning parser here, so no markers
    assert got["disable_any_whitespace"] is True and got.get("reasoning_end") is None
    rid = _rid()
    r = httpx.post(stack["plain"].url + GENERATE, headers={"X-Request-Id": rid}, timeout=60, json={
        "token_ids": [1], "sampling_params": {"max_tokens": 1, "structured_outputs": {"choice": ["yes", "no"]}}})
    assert r.status_code == 200 and _record(stack, f"generate-tokens-{rid}")["choice"] == ["yes", "no"]


BAD = [
    ({"regex": "(abc"}, "Failed to transform regex into a grammar: Regex parsing error"),
    ({"json": {"type": "foo"}}, "Failed to transform json schema into a grammar"),
    ({"json": "{oops"}, "Invalid JSON grammar specification."),
    ({"grammar": 'root ::= "a'}, "Invalid grammar specification. EBNF lexer error"),
    ({"regex": "a", "json_object": True}, "You can only use one kind of structured outputs constraint"),
    ({}, "You must use one kind of structured outputs constraint but none are specified"),
    ({"choice": []}, "Choice '[]' cannot be an empty list"),
    ({"choice": ["x"] * 2000}, "more than the limit of 1024"),
]


@pytest.mark.parametrize("constraint, message", BAD)
def test_generate_refuses_bad_constraints_before_admission(stack, constraint, message):
    for _ in range(2):  # the second answer comes from the gateway's cache, the same
        rid = _rid()
        r = httpx.post(stack["plain"].url + GENERATE, headers={"X-Request-Id": rid}, timeout=60, json={
            "token_ids": [1, 2], "sampling_params": {"structured_outputs": constraint}})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "BadRequestError" and error["code"] == 400
        assert message in error["message"], error
        assert _record(stack, f"generate-tokens-{rid}") == "absent"  # never dispatched


# ---------------------------------------------------------------- OpenAI facade
def test_response_format_json_schema_with_the_openai_client(stack):
    _reply(stack, '{"city": "Paris"}')
    rid = _rid()
    out = _client(stack["plain"]).chat.completions.create(
        model="", messages=MESSAGES, extra_headers={"X-Request-Id": rid},
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}})
    assert json.loads(out.choices[0].message.content) == {"city": "Paris"}
    assert json.loads(_record(stack, f"chatcmpl-{rid}")["json"]) == WEATHER
    rid = _rid()
    _client(stack["plain"]).completions.create(model="", prompt="x", extra_headers={"X-Request-Id": rid},
                                               extra_body={"response_format": {"type": "json_object"}})
    assert _record(stack, f"cmpl-{rid}")["json_object"] is True


def _required_schema():
    from gateway.structured_outputs.tool_schema import json_schema_from_tools

    return json_schema_from_tools("required", TOOLS, None)


def test_tool_choice_required_non_stream_and_stream(stack):
    _reply(stack, '[{"name": "get_weather", "parameters": {"city": "Paris"}}]', chunk=5)
    client = _client(stack["plain"])
    rid = _rid()
    out = client.chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         extra_headers={"X-Request-Id": rid})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("chatcmpl-tool-")
    # what the worker was told: vLLM's tool-call array schema, exactly
    assert json.loads(_record(stack, f"chatcmpl-{rid}")["json"]) == _required_schema()

    stream = client.chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                            stream=True)
    name, arguments, reasons = None, "", []
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                name = tc.function.name or name
                arguments += tc.function.arguments or ""
            reasons.append(c.finish_reason)
    assert name == "get_weather" and json.loads(arguments) == {"city": "Paris"}
    assert reasons[-1] == "tool_calls"


def _stream_calls_and_content(client, **kwargs):
    names, arguments, content, reasons = [], "", "", []
    for chunk in client.chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, stream=True, **kwargs):
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                names += [tc.function.name] if tc.function.name else []
                arguments += tc.function.arguments or ""
            content += c.delta.content or ""
            reasons.append(c.finish_reason)
    return names, arguments, content, reasons[-1]


def test_tool_choice_required_with_raw_control_characters_in_a_string(stack):
    """What xgrammar admits in a JSON string (raw U+0000-U+001F) reaches the client as the
    call, strict JSON in both modes (issue 39: the calls vanished, content empty)."""
    city = "a\x1e*v\n\x17b"
    _reply(stack, '[{"name":"get_weather","parameters":{"city":"' + city + '"}}]', chunk=3)
    client = _client(stack["plain"])
    out = client.chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, tool_choice="required")
    choice = out.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": city}
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    names, arguments, content, reason = _stream_calls_and_content(client, tool_choice="required")
    assert names == ["get_weather"] and json.loads(arguments) == {"city": city}
    assert content == "" and reason == "tool_calls"


def test_tool_choice_required_output_that_is_no_call_is_returned_as_content(stack):
    """A reply that does not parse as calls (here a truncated array) is the model's
    output all the same: answered as content, where vLLM drops it."""
    text = '[{"name":"get_weather","para'
    _reply(stack, text, chunk=3)
    client = _client(stack["plain"])
    out = client.chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, tool_choice="required")
    assert out.choices[0].message.content == text and not out.choices[0].message.tool_calls
    names, arguments, content, _ = _stream_calls_and_content(client, tool_choice="required")
    assert names == [] and arguments == "" and content == text


def test_named_tool_choice_non_stream_and_stream(stack):
    _reply(stack, '{"city": "Oslo"}', chunk=3)
    client = _client(stack["plain"])
    named = {"type": "function", "function": {"name": "get_weather"}}
    rid = _rid()
    out = client.chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                         extra_headers={"X-Request-Id": rid})
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    assert out.choices[0].finish_reason == "stop"  # OpenAI's (and vLLM's) answer for a named tool
    assert json.loads(_record(stack, f"chatcmpl-{rid}")["json"]) == WEATHER
    stream = client.chat.completions.create(model="", messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                            stream=True)
    names, arguments = [], ""
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                if tc.function.name:
                    names.append(tc.function.name)
                arguments += tc.function.arguments or ""
    assert names == ["get_weather"] and json.loads(arguments) == {"city": "Oslo"}


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "nope"}}}},
     "Failed to transform json schema into a grammar"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "nope"}}},
     "Invalid response_format structural_tag specification."),
    ({"structured_outputs": {"regex": "a", "json": {}}}, "You can only use one kind of constraints"),
    ({"response_format": {"type": "json_schema"}}, "the 'json_schema' field must be provided"),
])
def test_chat_refusals(stack, body, message):
    r = httpx.post(stack["plain"].url + "/v1/chat/completions", timeout=60,
                   json={"messages": MESSAGES, **body})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


# ---------------------------------------------------------------- render -> generate
def test_render_emits_vllms_structured_outputs_and_generate_takes_it(stack):
    gw = stack["plain"]
    rendered = httpx.post(gw.url + "/v1/chat/completions/render", timeout=60, json={
        "messages": MESSAGES, "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "w", "schema": WEATHER}}}).json()
    so = rendered["sampling_params"]["structured_outputs"]
    assert so == {"json": WEATHER, "regex": None, "choice": None, "grammar": None, "json_object": None,
                  "disable_any_whitespace": False, "disable_additional_properties": False,
                  "whitespace_pattern": None, "structural_tag": None}
    keys = list(rendered["sampling_params"])
    assert keys.index("structured_outputs") == keys.index("skip_clone") + 1  # vLLM's field order
    rid = _rid()
    rendered["request_id"] = rid
    r = httpx.post(gw.url + GENERATE, json=rendered, timeout=60)
    assert r.status_code == 200, r.text
    assert json.loads(_record(stack, f"generate-tokens-{rid}")["json"]) == WEATHER


def test_responses_and_messages_render(stack):
    gw = stack["plain"]
    r = httpx.post(gw.url + "/v1/responses/render", timeout=60, json={
        "input": "hi", "text": {"format": {"type": "json_schema", "name": "w", "schema": WEATHER}}})
    assert r.status_code == 200, r.text
    assert r.json()["sampling_params"]["structured_outputs"]["json"] == WEATHER
    tools = [{"name": "get_weather", "input_schema": WEATHER}]
    r = httpx.post(gw.url + "/v1/messages/render", timeout=60, json={
        "model": "fake-model", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tools": tools,
        "tool_choice": {"type": "tool", "name": "get_weather"}})
    assert r.status_code == 200, r.text
    assert r.json()["sampling_params"]["structured_outputs"]["json"] == WEATHER
    r = httpx.post(gw.url + "/v1/messages/render", timeout=60, json={
        "model": "fake-model", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tools": tools,
        "tool_choice": {"type": "any"}})
    assert r.json()["sampling_params"]["structured_outputs"]["json"]["type"] == "array"


# ---------------------------------------------------------------- reasoning
def test_reasoning_gateway_starts_the_grammar_after_reasoning(stack, chat_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(chat_model))
    _reply(stack, "<think>hmm</think>{}")
    client = _client(stack["reasoning"])
    rid = _rid()
    out = client.chat.completions.create(model="", messages=MESSAGES, extra_headers={"X-Request-Id": rid},
                                         response_format={"type": "json_object"})
    assert out.choices[0].message.content == "{}"
    got = _record(stack, f"chatcmpl-{rid}")
    assert got["reasoning_end"] == tok.encode("</think>", add_special_tokens=False)
    assert got["reasoning_start"] == tok.encode("<think>", add_special_tokens=False)
    assert got["disable_any_whitespace"] is False  # this gateway has the default config
    rid = _rid()  # thinking off: the prompt closes reasoning, the grammar applies from the start
    client.chat.completions.create(model="", messages=MESSAGES, extra_headers={"X-Request-Id": rid},
                                   response_format={"type": "json_object"},
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert _record(stack, f"chatcmpl-{rid}")["reasoning_end"] is None
