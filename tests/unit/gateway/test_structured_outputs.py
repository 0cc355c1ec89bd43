"""Structured outputs at the gateway, in process: vLLM 0.33's StructuredOutputsParams checks and
messages, the xgrammar grammar check and its cache, ``response_format`` / ``tool_choice`` /
``text.format`` -> ``structured_outputs`` as vLLM's render emits it (the forced tool-choice
schema exactly as ``get_json_schema_from_tools`` builds it), the forced tool-call parsing
(non-stream and stream), ``--structured-outputs-config`` and the policy's reasoning markers."""
from __future__ import annotations

import json

import pytest

from common.errors import BadRequest
from common.structured_outputs_config import StructuredOutputsConfig, parse_structured_outputs_config
from gateway.openai_api.chat_output import ChatChoiceStream, ChatParsing, chat_message
from gateway.openai_api.protocol import chat_request_decoder, completion_request_decoder
from gateway.parsers import forced_tool_calls as forced
from gateway.structured_outputs import openai_mapping, params
from common.structured_outputs_spec import choice_as_grammar
from gateway.structured_outputs.grammar_check import GrammarChecker
from gateway.structured_outputs.policy import StructuredOutputsPolicy
from gateway.structured_outputs.tool_schema import json_schema_from_tools

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]


def _deep(levels: int) -> dict:
    node: dict = {"type": "string"}
    for _ in range(levels):
        node = {"type": "object", "properties": {"a": node}}
    return {"properties": {"x": node}}


def _refusal(raw) -> str:
    with pytest.raises(BadRequest) as info:
        GrammarChecker().check(params.parse_structured_outputs(raw))
    assert info.value.status == 400
    return info.value.message


# ---------------------------------------------------------------- vLLM's checks and messages
@pytest.mark.parametrize("raw, message", [
    ({"regex": "a", "json_object": True}, "You can only use one kind of structured outputs constraint but multiple "
                                          "are specified: {'json': None, 'regex': 'a'"),
    ({}, "You must use one kind of structured outputs constraint but none are specified: {'json': None"),
    ({"disable_any_whitespace": True}, "You must use one kind of structured outputs constraint"),
    ({"choice": []}, "Choice '[]' cannot be an empty list"),
    ({"grammar": "  "}, "structured_outputs.grammar cannot be an empty string"),
    ({"json": " "}, "structured_outputs.json cannot be an empty string"),
    ({"json_object": False}, "structured_outputs.json_object must be True if set; omit structured_outputs to "
                             "disable structured outputs"),
    ({"regex": "a\x00b"}, "structured_outputs.regex must not contain a NUL character ('\\x00')"),
    ({"structural_tag": " "}, "structured_outputs.structural_tag cannot be an empty string"),
    ({"regex": 5}, "structured_outputs.regex: Input should be a valid string"),
    ({"json": [1]}, "structured_outputs.json: Input should be a valid string or a valid dictionary"),
    ({"choice": ["a", 1]}, "structured_outputs.choice: Input should be a valid list of strings"),
])
def test_vllm_request_checks(raw, message):
    with pytest.raises(BadRequest) as info:
        params.parse_structured_outputs(raw)
    assert info.value.message.startswith(message), info.value.message


@pytest.mark.parametrize("raw, message", [
    ({"regex": "(abc"}, "Failed to transform regex into a grammar: Regex parsing error at position 5"),
    ({"json": {"type": "foo"}}, "Failed to transform json schema into a grammar: "),
    ({"json": "{not json"}, "Invalid JSON grammar specification."),
    ({"json": {"type": "integer", "multipleOf": 3}}, "The provided JSON schema contains features not supported by "
                                                     "xgrammar."),
    ({"grammar": 'root ::= "a'}, "Invalid grammar specification. EBNF lexer error"),
    ({"structural_tag": json.dumps({"type": "structural_tag", "format": {"type": "nope"}})},
     "Invalid structural tag specification."),
    ({"json": {"type": "object", **_deep(70)}},
     "The JSON schema is nested too deeply: objects and arrays may nest at most 64 levels"),
])
def test_grammar_refusals_carry_the_reason(raw, message):
    got = _refusal(raw)
    assert got.startswith(message), got
    assert "/project/cpp" not in got and not got.startswith("[")  # xgrammar's log prefix dropped


@pytest.mark.parametrize("raw", [
    {"json": WEATHER}, {"json": json.dumps(WEATHER)}, {"regex": r"\d{3}"}, {"choice": ['a"b', "c\nd"]},
    {"grammar": 'root ::= "yes" | "no"'}, {"grammar": 'start: "a" | "b"'}, {"json_object": True},
    {"structural_tag": json.dumps({"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}})},
    {"structural_tag": json.dumps({"type": "structural_tag", "structures": [
        {"begin": "<f>", "schema": WEATHER, "end": "</f>"}], "triggers": ["<f>"]})},
])
def test_good_constraints_convert(raw):
    GrammarChecker().check(params.parse_structured_outputs(raw))


def test_bounds_are_refused_before_any_conversion():
    with pytest.raises(BadRequest, match="structured_outputs.choice has 1025 entries, more than the limit of 1024"):
        params.parse_structured_outputs({"choice": ["x"] * 1025})
    big = {"type": "object", "description": "x" * params.MAX_SPEC_CHARS}
    with pytest.raises(BadRequest, match="structured_outputs.json has .* characters, more than the limit"):
        params.parse_structured_outputs({"json": big})


def test_the_cache_answers_a_warm_spec_without_converting(monkeypatch):
    checker = GrammarChecker(cache_size=2)
    good, bad = params.parse_structured_outputs({"regex": "a+"}), params.parse_structured_outputs({"regex": "("})
    checker.check(good)
    with pytest.raises(BadRequest):
        checker.check(bad)
    from gateway.structured_outputs import grammar_check

    monkeypatch.setattr(grammar_check, "convert", lambda so: pytest.fail("converted again"))
    checker.check(good)
    with pytest.raises(BadRequest, match="Failed to transform regex"):
        checker.check(bad)  # the refusal is cached too
    assert (checker.hits, checker.misses) == (2, 2)
    monkeypatch.undo()
    for regex in ("b", "c", "d"):  # bounded: the oldest entries go
        checker.check(params.parse_structured_outputs({"regex": regex}))
    assert len(checker._cache) == 2 and checker.cached(good) == (False, None)


def test_json_travels_as_a_string_and_choice_grammar_is_vllms():
    so = params.parse_structured_outputs({"json": {"b": 1, "a": {"c": "é"}}})
    assert so.json == '{"b":1,"a":{"c":"é"}}'
    with pytest.raises(BadRequest, match="whitespace_pattern is not supported by the xgrammar backend"):
        params.parse_structured_outputs({"json": {}, "whitespace_pattern": " "})
    assert choice_as_grammar(['a"b', "x\\y\n", "\x01"]) == r'root ::= "a\"b" | "x\\y\n" | "\u0001"'


# ---------------------------------------------------------------- forced tool choice schema
def test_required_schema_is_vllms():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "g", "parameters": {}}}]
    schema = json_schema_from_tools("required", tools, parallel_tool_calls=False)
    assert schema == {
        "type": "array", "minItems": 1,
        "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["f"]},
                            "parameters": {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}}},
             "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["g"]},
                            "parameters": {"type": "object", "properties": {}}},
             "required": ["name", "parameters"]}]},
        "maxItems": 1, "$defs": {"P": {"type": "string"}}}
    assert "$defs" in tools[0]["function"]["parameters"]  # the request's tools are left alone
    assert "maxItems" not in json_schema_from_tools("required", tools, parallel_tool_calls=None)
    named = {"type": "function", "function": {"name": "f"}}
    assert json_schema_from_tools(named, tools) == tools[0]["function"]["parameters"]
    assert json_schema_from_tools({"type": "function", "function": {"name": "g"}}, tools) == \
        {"type": "object", "properties": {}}
    assert json_schema_from_tools("auto", tools) is None and json_schema_from_tools("none", tools) is None
    clash = tools + [{"type": "function", "function": {"name": "h", "parameters": {"$defs": {"P": {}}}}}]
    with pytest.raises(BadRequest, match="Tool definition 'P' has multiple schemas"):
        json_schema_from_tools("required", clash)


# ---------------------------------------------------------------- OpenAI fields -> render JSON
def _chat(**body):
    return chat_request_decoder.decode(json.dumps({"messages": [{"role": "user", "content": "hi"}], **body}))


def _render_json(**fields):
    out = {f: None for f in ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                             "disable_additional_properties", "whitespace_pattern", "structural_tag")}
    out.update({"disable_any_whitespace": False, "disable_additional_properties": False, **fields})
    return out


def test_response_format_kinds():
    schema_fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}
    assert openai_mapping.chat_structured_outputs(_chat(response_format=schema_fmt)) == _render_json(json=WEATHER)
    assert openai_mapping.chat_structured_outputs(_chat(response_format={"type": "json_object"})) == \
        _render_json(json_object=True)
    assert openai_mapping.chat_structured_outputs(_chat(response_format={"type": "text"})) is None
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}
    assert openai_mapping.chat_structured_outputs(_chat(response_format=tag)) == \
        _render_json(structural_tag=json.dumps(tag))
    legacy = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": WEATHER, "end": "</f>"}],
              "triggers": ["<f>"]}
    assert json.loads(openai_mapping.chat_structured_outputs(_chat(response_format=legacy))["structural_tag"]) == legacy
    # structured_outputs passes through, its options kept; response_format overrides the constraint
    both = _chat(structured_outputs={"regex": "a", "disable_any_whitespace": True}, response_format={"type": "text"})
    assert openai_mapping.chat_structured_outputs(both) == _render_json(regex="a", disable_any_whitespace=True)
    comp = completion_request_decoder.decode(json.dumps({"prompt": "x", "response_format": {"type": "json_object"}}))
    assert openai_mapping.completion_structured_outputs(comp) == _render_json(json_object=True)


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema"}},
     "When response_format type is 'json_schema', the 'json_schema' field must be provided."),
    ({"response_format": {"type": "yaml"}}, "response_format.type: Input should be"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "nope"}}},
     "Invalid response_format structural_tag specification."),
    ({"response_format": {"type": "structural_tag"}}, "Invalid response_format structural_tag specification."),
    ({"structured_outputs": {"structural_tag": "{]"}}, "Invalid structured_outputs structural_tag specification."),
    ({"structured_outputs": {"json": {}, "regex": "a"}},
     "You can only use one kind of constraints for structured outputs ('json', 'regex' or 'choice')."),
    ({"structured_outputs": {"regex": "a"}, "tools": TOOLS, "tool_choice": {"type": "function",
                                                                             "function": {"name": "now"}}},
     "You can only either use constraints for structured outputs or tools, not both."),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "You can only use one kind of structured outputs constraint but multiple are specified"),
])
def test_openai_refusals(body, message):
    with pytest.raises(BadRequest) as info:
        openai_mapping.chat_structured_outputs(_chat(**body))
    assert info.value.message.startswith(message), info.value.message


def test_forced_tool_choice_replaces_response_format():
    request = _chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert openai_mapping.chat_structured_outputs(request) == \
        _render_json(json=json_schema_from_tools("required", TOOLS))
    assert request.response_format is None
    named = _chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert openai_mapping.chat_structured_outputs(named) == _render_json(json=WEATHER)
    assert openai_mapping.chat_structured_outputs(_chat(tools=TOOLS, tool_choice="auto")) is None


def test_responses_text_format():
    assert openai_mapping.responses_structured_outputs({"format": {"type": "json_schema", "name": "w",
                                                                   "schema": WEATHER}}, None) == {"json": WEATHER}
    assert openai_mapping.responses_structured_outputs({"format": {"type": "json_object"}}, None) == \
        {"json_object": True}
    assert openai_mapping.responses_structured_outputs({"format": {"type": "text"}}, None) is None
    with pytest.raises(BadRequest, match="Cannot specify both structured_outputs and text.format"):
        openai_mapping.responses_structured_outputs({"format": {"type": "json_object"}}, {"regex": "a"})


# ---------------------------------------------------------------- forced tool calls parsed
CALLS = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]'


def test_required_and_named_messages():
    required = ChatParsing(forced_tool_choice="required")
    message = chat_message(CALLS, required)
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == \
        [("get_weather", '{"city": "Paris"}'), ("now", "{}")]
    assert message.content == "" and all(c.id.startswith("chatcmpl-tool-") for c in message.tool_calls)
    assert required.finish_reason("stop", True) == "tool_calls"
    assert required.finish_reason("length", True) == "length"
    assert chat_message('[{"name": 3}]', required).tool_calls == []  # does not validate: no calls, content ""
    single = ChatParsing(forced_tool_choice="required", parallel_tool_calls=False)
    assert len(chat_message(CALLS, single).tool_calls) == 1
    named = ChatParsing(forced_tool_choice="named", named_tool="get_weather")
    message = chat_message('{"city": "Oslo"}', named)
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("get_weather", '{"city": "Oslo"}')]
    assert named.finish_reason("stop", True) == "stop"  # OpenAI's answer for a named tool
    assert chat_message("  ", named).tool_calls == [] and chat_message("  ", named).content == ""


@pytest.mark.parametrize("chunk", [1, 3, 7, 50])
def test_required_stream_rebuilds_the_calls(chunk):
    stream = ChatChoiceStream(ChatParsing(forced_tool_choice="required"))
    calls: dict[int, dict] = {}
    for i in range(0, len(CALLS), chunk):
        delta = stream.delta(CALLS[i:i + chunk], i + chunk >= len(CALLS))
        for call in (delta.tool_calls if delta is not None and delta.tool_calls else []):
            entry = calls.setdefault(call.index, {"name": None, "arguments": "", "id": None})
            if call.function.name is not None:
                assert entry["name"] is None  # announced once
                entry.update(name=call.function.name, id=call.id)
            entry["arguments"] += call.function.arguments
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", '{"city": "Paris"}'),
                                                                     ("now", "{}")]
    assert all(c["id"] for c in calls.values()) and stream.tools_streamed


def test_named_stream_sends_the_arguments_as_they_grow():
    stream = ChatChoiceStream(ChatParsing(forced_tool_choice="named", named_tool="now"))
    first = stream.delta('{"a"', False)
    second = stream.delta(": 1}", True)
    assert first.tool_calls[0].function.name == "now" and first.tool_calls[0].id
    assert first.tool_calls[0].function.arguments + second.tool_calls[0].function.arguments == '{"a": 1}'
    assert second.tool_calls[0].function.name is None


def test_scan_ignores_braces_inside_strings():
    text = '[{"name": "f", "parameters": {"s": "}]{[\\""}}]'
    (span,) = forced.scan_required(text)
    assert span.name == "f" and text[span.args_start:span.args_end] == '{"s": "}]{[\\""}'


# ---------------------------------------------------------------- server config and policy
def test_structured_outputs_config():
    assert parse_structured_outputs_config(None) == StructuredOutputsConfig()
    cfg = parse_structured_outputs_config('{"backend": "xgrammar", "disable_any_whitespace": true, '
                                          '"reasoning_parser": "qwen3", "enable_in_reasoning": true}')
    assert cfg.disable_any_whitespace and cfg.enable_in_reasoning and cfg.reasoning_parser == "qwen3"
    assert parse_structured_outputs_config(cfg.to_json()) == cfg
    for text, message in [
        ('{"backend": "guidance"}', "backend 'guidance' is not served by tokserve"),
        ('{"backend": "outlines"}', "xgrammar only"),
        ('{"backend": "nope"}', "backend must be one of"),
        ('{"disable_any_whitespace": true}', "disable_any_whitespace is only supported for xgrammar and guidance"),
        ('{"backend": "xgrammar", "disable_additional_properties": true}',
         "disable_additional_properties is only supported for the guidance backend."),
        ('{"bogus": 1}', "unknown field(s) ['bogus']"),
        ('{"enable_in_reasoning": "yes"}', "enable_in_reasoning must be a bool"),
        ("[1]", "must be a JSON object"),
    ]:
        with pytest.raises(ValueError) as info:
            parse_structured_outputs_config(text)
        assert message in str(info.value), (text, str(info.value))


def test_gateway_flag_refuses_other_backends_and_feeds_the_reasoning_parser(tmp_path):
    from gateway.main import build_parser, settings_from_args

    with pytest.raises(SystemExit, match="not served by tokserve"):
        settings_from_args(build_parser().parse_args(["--structured-outputs-config", '{"backend": "guidance"}']))
    with pytest.raises(SystemExit, match="need --tokenizer"):  # the config's reasoning parser is --reasoning-parser's
        settings_from_args(build_parser().parse_args(["--structured-outputs-config", '{"reasoning_parser": "qwen3"}']))
    s = settings_from_args(build_parser().parse_args(
        ["--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}']))
    assert s.structured_outputs_config.disable_any_whitespace


class _Tok:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_policy_whitespace_default_and_reasoning_markers():
    policy = StructuredOutputsPolicy.build(parse_structured_outputs_config('{"backend": "xgrammar", '
                                                                           '"disable_any_whitespace": true}'),
                                           "qwen3", _Tok())
    so = policy.wire({"json_object": True}, reasoning_ended=None, has_tokenizer=True)
    assert so.disable_any_whitespace and so.reasoning_end == [ord(c) for c in "</think>"]
    assert so.reasoning_start == [ord(c) for c in "<think>"]
    assert policy.wire({"json_object": True}, reasoning_ended=True, has_tokenizer=True).reasoning_end is None
    assert policy.wire(None, reasoning_ended=None, has_tokenizer=True) is None
    in_reasoning = StructuredOutputsPolicy.build(parse_structured_outputs_config('{"enable_in_reasoning": true}'),
                                                 "qwen3", _Tok())
    assert in_reasoning.wire({"regex": "a"}, reasoning_ended=None, has_tokenizer=True).reasoning_end is None
    assert StructuredOutputsPolicy.build(StructuredOutputsConfig(), None, _Tok()).reasoning_end is None
    with pytest.raises(BadRequest, match="Structured outputs requires a tokenizer"):
        policy.wire({"regex": "a"}, reasoning_ended=None, has_tokenizer=False)


def test_derender_parses_a_forced_tool_choice_from_the_parse_context():
    """/generate's output_mode "derender" with the parse_context render returned for a
    tool_choice "required" request: the calls as the chat facade parses them."""
    from types import SimpleNamespace

    from gateway.generate_api import parse_context
    from gateway.openai_api import generate_derender

    context = parse_context.read({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": True,
                                  "include_reasoning": True, "chat_template_kwargs": {},
                                  "history_tool_call_cnt": 0}, "derender")
    generate_derender.check(False, context, SimpleNamespace(parser=None))
    setup = generate_derender.setup(context, SimpleNamespace(parser=None), [1, 2], 64)
    fields = {"index": 0, "finish_reason": "stop", "stop_reason": None, "token_ids": [3], "sampling_mask": None,
              "routed_experts": None}
    got = generate_derender.choice(fields, CALLS, None, setup)
    assert [c.function.name for c in got.message.tool_calls] == ["get_weather", "now"]
    assert got.finish_reason == "tool_calls" and got.message.content == ""


def test_policy_converts_new_specs_on_the_pool_and_answers_warm_ones_on_the_loop():
    import asyncio

    class Pool:
        def __init__(self):
            self.jobs = 0

        async def run(self, fn, *args):
            self.jobs += 1
            return fn(*args)

    policy, pool = StructuredOutputsPolicy(), Pool()
    good = policy.wire({"regex": "a+"}, reasoning_ended=None, has_tokenizer=True)
    bad = policy.wire({"regex": "(a"}, reasoning_ended=None, has_tokenizer=True)

    async def run():
        for _ in range(3):
            await policy.check(good, pool)
            with pytest.raises(BadRequest, match="Failed to transform regex"):
                await policy.check(bad, pool)
        await policy.check(None, pool)

    asyncio.run(run())
    assert pool.jobs == 2  # one conversion per spec; the rest from the cache


def test_fuzzed_constraints_are_served_or_refused_with_400():
    """Whatever a client puts in structured_outputs / response_format / tool_choice: a wire
    struct whose grammar converts, or a BadRequest -- never another exception."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    text = st.text(max_size=40) | st.sampled_from(['{"type": "object"}', "[ab]+", 'root ::= "a"', "{", "(", "\x00",
                                                   json.dumps({"type": "structural_tag", "format": {}})])
    leaf = st.none() | st.booleans() | st.integers() | text
    values = st.recursive(leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                          max_leaves=12)
    schema_like = st.dictionaries(st.sampled_from(["type", "properties", "items", "enum", "required", "$ref",
                                                   "anyOf", "minItems", "pattern", "format"]), values, max_size=4)
    constraint = st.dictionaries(
        st.sampled_from(["json", "regex", "choice", "grammar", "json_object", "structural_tag",
                         "disable_any_whitespace", "whitespace_pattern"]),
        values | schema_like | text, max_size=3)
    checker = GrammarChecker()

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(constraint, values | schema_like, st.sampled_from([None, "auto", "required", {"type": "function",
                                                                                         "function": {"name": "now"}}]))
    def check(raw, fmt, tool_choice):
        try:
            checker.check(params.parse_structured_outputs(raw))
        except BadRequest:
            pass
        body = {"response_format": fmt if isinstance(fmt, dict) else None, "tools": TOOLS, "tool_choice": tool_choice}
        if isinstance(raw, dict) and raw:
            body["structured_outputs"] = raw
        try:
            openai_mapping.chat_structured_outputs(_chat(**{k: v for k, v in body.items() if v is not None}))
        except BadRequest:
            pass

    check()
