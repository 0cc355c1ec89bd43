"""gateway.parsers: vLLM 0.32's reasoning (deepseek_r1, qwen3) and tool-call (hermes, llama3_json)
parsing of chat output, and the streaming contract: parsing every prefix (char by char, so tags
are cut everywhere) with final=False only ever grows the fields, and stays a prefix of the final
(non-streaming) result -- except in the documented cases, which are asserted as such here.

The expected final values were cross-checked against vLLM 0.32's own DelegatingParser.parse
(the real parser classes, run on the same texts)."""
from __future__ import annotations

import json
import random
import re

import pytest

from gateway.parsers import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    OutputParser,
    ParsedOutput,
    ParsedToolCall,
    final_finish_reason,
    make_tool_call_id,
)


def call(name: str, **args) -> ParsedToolCall:
    return ParsedToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


def H(name: str, args: dict, *, pad: str = "\n") -> str:  # a hermes block as Qwen/Hermes templates write it
    return f"<tool_call>{pad}{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}{pad}</tool_call>"


def _s(x: str | None) -> str:
    return x or ""


def is_prefix(a: ParsedOutput, b: ParsedOutput, fields=("reasoning", "content", "tool_calls")) -> bool:
    ok = True
    if "reasoning" in fields:
        ok &= _s(b.reasoning).startswith(_s(a.reasoning))
    if "content" in fields:
        ok &= _s(b.content).startswith(_s(a.content))
    if "tool_calls" in fields:
        ok &= b.tool_calls[:len(a.tool_calls)] == a.tool_calls
    return ok


def stream(parser: OutputParser, text: str, *, reasoning_open=True, tools=True) -> list[ParsedOutput]:
    return [parser.parse(text[:i], reasoning_open=reasoning_open, tools_enabled=tools, final=False)
            for i in range(len(text) + 1)]


def check_stream(parser: OutputParser, text: str, *, reasoning_open=True, tools=True,
                 final_fields=("reasoning", "content", "tool_calls")) -> ParsedOutput:
    """Successive streaming parses only grow; each is a prefix of the final parse (in ``final_fields``)."""
    final = parser.parse(text, reasoning_open=reasoning_open, tools_enabled=tools, final=True)
    parses = stream(parser, text, reasoning_open=reasoning_open, tools=tools)
    for i, (a, b) in enumerate(zip(parses, parses[1:])):
        assert is_prefix(a, b), (text[:i], a, b)
    for i, a in enumerate(parses):
        assert is_prefix(a, final, final_fields), (text[:i], a, final)
    return final


def P(r=None, t=None) -> OutputParser:
    return OutputParser(r, t)


# ------------------------------------------------------------------------------------------ plain

# Harmony's two parsers read a message grammar, not plain text (tests/unit/gateway/test_harmony_parser.py).
TEXT_REASONING_PARSERS = [r for r in REASONING_PARSERS if r != "openai_gptoss"]
TEXT_TOOL_CALL_PARSERS = [t for t in TOOL_CALL_PARSERS if t != "openai"]


@pytest.mark.parametrize("r", [None, *TEXT_REASONING_PARSERS])
@pytest.mark.parametrize("t", [None, *TEXT_TOOL_CALL_PARSERS])
def test_plain_text_without_reasoning_open_is_content(r, t):
    text = "Hello! <b>bold</b> {not json} <tool_ca"
    out = check_stream(P(r, t), text, reasoning_open=False, tools=False)
    assert out == ParsedOutput(reasoning=None, content=text, tool_calls=[])
    assert P(r, t).parse("", reasoning_open=False, tools_enabled=False, final=True).content == ""


def test_no_parsers_everything_is_content_and_nothing_is_held():
    p = P()
    assert p.parse("abc<thi", reasoning_open=True, tools_enabled=True, final=False).content == "abc<thi"


# ------------------------------------------------------------------------------------ deepseek_r1

@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>\nLet me think.\n</think>\n\nThe answer is 4.", "\nLet me think.\n", "\n\nThe answer is 4."),
    ("Let me think.</think>The answer.", "Let me think.", "The answer."),  # template pre-opened <think>
    ("Still thinking when cut off", "Still thinking when cut off", None),  # no </think>: all reasoning
    ("<think>abc</think>", "abc", None),  # nothing after </think>: content None
    ("</think>x", "", "x"),  # empty reasoning is "" (vLLM returns the str)
    ("", "", None),
    ("\n<think>a</think>b", "a", "b"),  # text before <think> is dropped
    ("a</think>b</think>c", "a", "b</think>c"),  # only the first </think> splits
])
def test_deepseek_r1(text, reasoning, content):
    out = check_stream(P("deepseek_r1"), text)
    assert (out.reasoning, out.content, out.tool_calls) == (reasoning, content, [])


def test_deepseek_r1_late_think_tag_is_the_documented_exception():
    # vLLM's non-stream partitions at the FIRST <think> wherever it is: what came before vanishes.
    p = P("deepseek_r1")
    text = "abc</think>Use the <think> tag."
    final = p.parse(text, reasoning_open=True, tools_enabled=False, final=True)
    assert (final.reasoning, final.content) == (" tag.", None)
    streamed = p.parse(text, reasoning_open=True, tools_enabled=False, final=False)
    assert (streamed.reasoning, streamed.content) == ("abc", "Use the <think> tag.")
    check_stream(p, text, final_fields=())  # the stream itself still only grows


def test_deepseek_r1_holds_a_partial_tag():
    p = P("deepseek_r1")
    parse = lambda s: p.parse(s, reasoning_open=True, tools_enabled=False, final=False)  # noqa: E731
    assert parse("  <thi").reasoning is None  # could still be "<think>"
    assert parse("abc</thi").reasoning == "abc"
    assert parse("abc</thx").reasoning == "abc</thx"
    assert p.parse("abc</thi", reasoning_open=True, tools_enabled=False, final=True).reasoning == "abc</thi"


# ------------------------------------------------------------------------------------------ qwen3

@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>\nHmm.\n</think>\n\nHi!", "\nHmm.\n", "\n\nHi!"),
    ("Hmm.</think>Hi!", "Hmm.", "Hi!"),
    ("no end tag at all", "no end tag at all", None),  # 0.32's engine: all reasoning
    ("</think>Hi", None, "Hi"),  # empty reasoning is None for qwen3
    ("", None, None),
    ("a<think>b</think>c</think>d<think>e", "ab", "cd<think>e"),  # stray </think> dropped, <think> kept
    ("a</tool_call><function=x>b", "a</tool_call><function=x>b", None),
    ("think<tool_call>{...}", "think", "<tool_call>{...}"),  # <tool_call> ends reasoning implicitly
])
def test_qwen3(text, reasoning, content):
    out = check_stream(P("qwen3"), text, tools=False)
    assert (out.reasoning, out.content) == (reasoning, content)


def test_qwen3_drops_the_tokenizers_other_special_tokens():
    p = OutputParser("qwen3", None, special_tokens=["<|im_end|>", "<|endoftext|>", "<think>"])
    text = "a<|im_end|>b</think>c<|endoftext|>d<think>"
    out = check_stream(p, text, tools=False)
    assert (out.reasoning, out.content) == ("ab", "cd<think>")
    assert p.parse("a<|im_e", reasoning_open=True, tools_enabled=False, final=False).reasoning == "a"
    # only when the reasoning parser runs: thinking disabled returns the text untouched (as vLLM)
    assert p.parse(text, reasoning_open=False, tools_enabled=False, final=True).content == text


def test_qwen3_thinking_disabled_returns_the_output_as_content():
    p = P("qwen3", "hermes")
    assert not p.reasoning_open_at_start("<|im_start|>assistant\n", {"enable_thinking": False})
    text = "<think>x</think> Hi"
    out = check_stream(p, text, reasoning_open=False)
    assert out == ParsedOutput(reasoning=None, content=text, tool_calls=[])


# ----------------------------------------------------------------------------------------- hermes

def test_hermes_single_and_multiple_calls():
    p = P(None, "hermes")
    text = "Let me check." + H("get_weather", {"city": "Zürich"}) + "\n" + H("get_time", {"tz": "CET"})
    out = check_stream(p, text)
    assert out.content == "Let me check."
    assert out.tool_calls == [call("get_weather", city="Zürich"), call("get_time", tz="CET")]
    assert out.tool_calls[0].arguments == '{"city": "Zürich"}'  # ensure_ascii=False, default separators
    # a call is reported whole once its </tool_call> arrives, never as a partial
    cut = text.index("</tool_call>") + len("</tool_call>")
    assert p.parse(text[:cut - 1], reasoning_open=False, tools_enabled=True, final=False).tool_calls == []
    assert p.parse(text[:cut], reasoning_open=False, tools_enabled=True, final=False).tool_calls == out.tool_calls[:1]


@pytest.mark.parametrize("prefix, content", [("", None), ("\n\n", None), ("Sure.\n\n", "Sure.\n\n")])
def test_hermes_content_before_the_call(prefix, content):
    # whitespace-only content is None when tools are called (and never streamed); otherwise unstripped
    out = check_stream(P(None, "hermes"), prefix + H("f", {}) + " trailing text is dropped")
    assert (out.content, out.tool_calls) == (content, [call("f")])


def test_hermes_whitespace_only_output_without_calls_stays_content():
    out = check_stream(P(None, "hermes"), "\n \n")
    assert (out.content, out.tool_calls) == ("\n \n", [])


@pytest.mark.parametrize("text", [
    "Before " + "<tool_call>{not json}</tool_call> after",
    "<tool_call>" + json.dumps({"name": "f"}) + "</tool_call>",  # no "arguments"
    "<tool_call>" + json.dumps({"name": 3, "arguments": {}}) + "</tool_call>",  # name not a str
    "<tool_call>[1, 2]</tool_call>",
    "x" + H("f", {"a": 1})[:-3],  # unterminated and not JSON (cut mid-tag by max_tokens)
])
def test_hermes_invalid_json_returns_the_whole_text_as_content(text):
    out = check_stream(P(None, "hermes"), text)
    assert out == ParsedOutput(reasoning=None, content=text, tool_calls=[])


def test_hermes_unterminated_but_complete_json_is_a_call_at_the_end():
    text = "<tool_call>\n" + json.dumps({"name": "f", "arguments": {"a": [1, 2]}})
    p = P(None, "hermes")
    out = check_stream(p, text)
    assert (out.content, out.tool_calls) == (None, [call("f", a=[1, 2])])
    assert p.parse(text, reasoning_open=False, tools_enabled=True, final=False).tool_calls == []


def test_hermes_arguments_keep_vllms_json_dumps():
    out = P(None, "hermes").parse('<tool_call>{"name": "f", "arguments": "raw"}</tool_call>',
                                  reasoning_open=False, tools_enabled=True, final=True)
    assert out.tool_calls == [ParsedToolCall("f", '"raw"')]


def test_hermes_later_invalid_block_is_the_documented_exception():
    # vLLM: one bad block -> no calls at all, whole text as content; the stream sent the first call
    p = P(None, "hermes")
    text = "Hi " + H("f", {"a": 1}) + "<tool_call>{oops</tool_call>"
    final = p.parse(text, reasoning_open=False, tools_enabled=True, final=True)
    assert final == ParsedOutput(reasoning=None, content=text, tool_calls=[])
    last = p.parse(text, reasoning_open=False, tools_enabled=True, final=False)
    assert (last.content, last.tool_calls) == (text, [call("f", a=1)])
    check_stream(p, text, final_fields=("reasoning", "content"))  # content still only extends


def test_hermes_holds_a_partial_tag_and_ignores_tools_when_disabled():
    p = P(None, "hermes")
    assert p.parse("Hi <tool_ca", reasoning_open=False, tools_enabled=True, final=False).content == "Hi "
    assert p.parse("Hi <tool_ca", reasoning_open=False, tools_enabled=True, final=True).content == "Hi <tool_ca"
    text = "x" + H("f", {})
    assert p.parse(text, reasoning_open=False, tools_enabled=False, final=True).content == text


# ------------------------------------------------------------------------------------ llama3_json

@pytest.mark.parametrize("name", ["llama3_json", "llama4_json"])
@pytest.mark.parametrize("text, calls", [
    ('<|python_tag|>{"name": "f", "parameters": {"x": 1}}', [call("f", x=1)]),
    ('{"name": "f", "arguments": {"x": "é"}}; {"name": "g", "parameters": {}}', [call("f", x="é"), call("g")]),
    ('\n\n{"name": "f", "parameters": {"q": "{braces} inside"}}', [call("f", q="{braces} inside")]),
    ('{"name": "f", "parameters": {}} trailing text is dropped', [call("f")]),
])
def test_llama3_json_calls(name, text, calls):
    out = check_stream(P(None, name), text)
    assert (out.content, out.tool_calls) == (None, calls)


@pytest.mark.parametrize("text", [
    "No tools needed, the answer is 4.",
    "\n  plain",
    '{"answer": 42}',  # JSON without "name"
    '{"name": "f"}',  # neither "arguments" nor "parameters"
    '{"name": "f", "parameters": {}',  # never closes
    '<|python_tag|>print("hi")',
])
def test_llama3_json_content(text):
    out = check_stream(P(None, "llama3_json"), text)
    assert out == ParsedOutput(reasoning=None, content=text, tool_calls=[])


@pytest.mark.parametrize("text", [
    '{"name": "f", "parameters": {}}; {broken',
    # vLLM quirk kept: a "{" right at the end of the previous object is skipped as if inside it,
    # so the inner "{}" is decoded on its own, has no "name", and the whole parse fails
    '{"name": "f", "parameters": {}}{"name": "g", "parameters": {}}',
])
def test_llama3_json_later_invalid_object_is_the_documented_exception(text):
    p = P(None, "llama3_json")
    assert p.parse(text, reasoning_open=False, tools_enabled=True, final=True) == ParsedOutput(None, text, [])
    assert p.parse(text, reasoning_open=False, tools_enabled=True, final=False).tool_calls == [call("f")]
    check_stream(p, text, final_fields=("reasoning", "content"))


def test_llama3_json_text_before_the_json_is_the_documented_exception():
    # vLLM's non-stream finds the call anywhere (content None); its stream -- and ours -- sends
    # output that does not start with "{"/the python tag as content.
    p = P(None, "llama3_json")
    text = 'Calling it: {"name": "f", "parameters": {"x": 1}}'
    final = p.parse(text, reasoning_open=False, tools_enabled=True, final=True)
    assert final == ParsedOutput(None, None, [call("f", x=1)])
    assert p.parse(text, reasoning_open=False, tools_enabled=True, final=False) == ParsedOutput(None, text, [])
    check_stream(p, text, final_fields=("reasoning",))


def test_llama3_json_holds_until_the_object_closes():
    p = P(None, "llama3_json")
    text = '{"name": "f", "parameters": {"x": 1}}'
    for i in range(len(text)):
        assert p.parse(text[:i], reasoning_open=False, tools_enabled=True, final=False) == ParsedOutput(None, None, [])
    assert p.parse(text, reasoning_open=False, tools_enabled=True, final=False).tool_calls == [call("f", x=1)]


# ------------------------------------------------------------------------- reasoning + tool calls

@pytest.mark.parametrize("r, t, text, reasoning, content, calls", [
    ("deepseek_r1", "hermes", "<think>plan</think>\n\n" + H("f", {"a": 1}), "plan", None, [call("f", a=1)]),
    ("deepseek_r1", "hermes", "plan " + H("f", {"a": 1}), "plan " + H("f", {"a": 1}), None, []),  # no </think>
    ("qwen3", "hermes", "<think>\nplan\n</think>\n\nOK." + H("f", {}) + H("g", {"b": "c"}),
     "\nplan\n", "\n\nOK.", [call("f"), call("g", b="c")]),
    ("qwen3", "hermes", "plan" + H("f", {}), "plan", None, [call("f")]),  # <tool_call> ends reasoning
    ("qwen3", "hermes", "plan</think>" + H("f", {})[:-2], "plan", H("f", {})[:-2], []),  # cut tag: content
    ("qwen3", "llama3_json", 'plan</think>\n{"name": "f", "parameters": {"a": 1}}', "plan", None, [call("f", a=1)]),
    ("deepseek_r1", "llama3_json", 'plan</think>Answer: 4', "plan", "Answer: 4", []),
])
def test_reasoning_then_tool_calls(r, t, text, reasoning, content, calls):
    out = check_stream(P(r, t), text)
    assert (out.reasoning, out.content, out.tool_calls) == (reasoning, content, calls)


def test_tags_split_across_chunks_never_leak():
    p = P("qwen3", "hermes")
    text = "<think>a</think>b" + H("f", {"k": "v"})
    seen = set()
    for i in range(len(text) + 1):
        out = p.parse(text[:i], reasoning_open=True, tools_enabled=True, final=False)
        seen.add((out.reasoning, out.content))
        assert "<" not in _s(out.reasoning) + _s(out.content), (text[:i], out)
    assert ("a", "b") in seen


_FRAGMENTS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|python_tag|>", "{", "}", "; ", " ",
              "\n", "hi", "<thi", "</tool", '"', '{"name": "f", "arguments": {"a": 1}}',
              '{"name": "g", "parameters": {"b": "é"}}', '{"x": 1}', H("h", {"c": [1]})]


def test_random_outputs_stream_monotonically_for_every_parser_pair():
    rng = random.Random(1234)
    pairs = [(r, t) for r in (None, "deepseek_r1", "qwen3") for t in (None, "hermes", "llama3_json")]
    for _ in range(25):
        text = "".join(rng.choice(_FRAGMENTS) for _ in range(rng.randint(1, 6)))
        for r, t in pairs:
            p = P(r, t)
            final = p.parse(text, reasoning_open=True, tools_enabled=True, final=True)
            parses = stream(p, text)
            for a, b in zip(parses, parses[1:]):
                assert is_prefix(a, b), (r, t, text, a, b)
            # reasoning is always prefix-consistent with the final result but for deepseek_r1's late <think>
            late_think = r == "deepseek_r1" and "<think>" in text and not text.lstrip().startswith("<think>")
            if not late_think:
                assert all(is_prefix(a, final, ("reasoning",)) for a in parses), (r, t, text)


# ---------------------------------------------------------------------------- reasoning_open_at_start

@pytest.mark.parametrize("r, prompt, kwargs, expected", [
    ("deepseek_r1", "<｜User｜>hi<｜Assistant｜><think>\n", None, True),  # template pre-opens <think>
    ("deepseek_r1", "<｜User｜>hi<｜Assistant｜>", None, True),  # no marker: reasoning assumed
    ("deepseek_r1", "<|im_start|>assistant\n<think>\n\n</think>\n\n", None, False),  # already closed
    ("qwen3", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", None, True),
    ("qwen3", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", {"enable_thinking": True}, True),
    ("qwen3", "<|im_start|>assistant\n<think>\n", {}, True),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", {}, False),
    ("qwen3", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", {"enable_thinking": False}, False),
    ("qwen3", "<think>a</think>old turn<|im_end|>\n<|im_start|>assistant\n", {}, True),  # only the last turn
    ("qwen3", "<|im_start|>assistant\n<tool_call>", {}, False),  # <tool_call> ends reasoning too
    (None, "<think>", None, False),
])
def test_reasoning_open_at_start(r, prompt, kwargs, expected):
    assert P(r, "hermes").reasoning_open_at_start(prompt, kwargs) is expected


def test_reasoning_open_default_is_what_vllms_non_stream_assumes():
    assert P("deepseek_r1").reasoning_open_default(None) is True
    assert P("qwen3").reasoning_open_default({}) is True
    assert P("qwen3").reasoning_open_default({"enable_thinking": False}) is False
    assert P(None, "hermes").reasoning_open_default({}) is False


def test_keeps_special_tokens_mirrors_vllms_adjust_request():
    assert P("qwen3").keeps_special_tokens(tools_enabled=False)
    assert P(None, "hermes").keeps_special_tokens(tools_enabled=True)
    assert not P(None, "hermes").keeps_special_tokens(tools_enabled=False)
    assert not P("deepseek_r1", "llama3_json").keeps_special_tokens(tools_enabled=True)


# ------------------------------------------------------------------------------------ finish_reason

WITH = ParsedOutput(reasoning=None, content=None, tool_calls=[call("f")])
WITHOUT = ParsedOutput(reasoning=None, content="hi", tool_calls=[])


@pytest.mark.parametrize("engine, parsed, kw, expected", [
    ("stop", WITH, {}, "tool_calls"),
    ("stop", WITHOUT, {}, "stop"),
    ("length", WITH, {}, "tool_calls"),  # vLLM non-stream: any reason once auto tools were called
    ("length", WITH, {"stream": True}, "length"),  # vLLM stream: only on "stop"
    ("stop", WITH, {"stream": True}, "tool_calls"),
    ("length", WITHOUT, {}, "length"),
    ("abort", WITH, {"stream": True}, "abort"),
    ("stop", WITHOUT, {"tool_choice": "required"}, "tool_calls"),  # non-stream required: on "stop"
    ("length", WITH, {"tool_choice": "required"}, "length"),
    ("stop", WITHOUT, {"tool_choice": "required", "stream": True}, "stop"),
    ("stop", WITH, {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "stop"),  # named
    ("stop", WITH, {"tool_choice": "none"}, "stop"),
    ("stop", WITH, {"tool_choice": None}, "stop"),  # explicit null: vLLM's message drops the calls
    ("stop", WITH, {"tool_choice": None, "stream": True}, "tool_calls"),
    (None, WITH, {}, None),
])
def test_final_finish_reason(engine, parsed, kw, expected):
    assert final_finish_reason(engine, parsed, **kw) == expected


# ------------------------------------------------------------------------------------ names, ids

def test_unknown_parser_names_list_the_choices():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3, openai_gptoss"):
        OutputParser("granite", None)
    with pytest.raises(ValueError, match="hermes, llama3_json, llama4_json, qwen3_json, openai"):
        OutputParser(None, "pythonic")
    assert OutputParser("", "").parse("x", reasoning_open=True, tools_enabled=True, final=True).content == "x"
    assert OutputParser.REASONING_PARSERS == REASONING_PARSERS and "hermes" in OutputParser.TOOL_CALL_PARSERS


def test_tool_call_id_format():
    ids = {make_tool_call_id() for _ in range(50)}
    assert len(ids) == 50
    assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", i) for i in ids)


# ------------------------------------------------ forced "required": raw control characters
def test_required_calls_with_raw_control_characters_parse_and_stream_as_strict_json():
    """xgrammar (like vLLM's) admits raw U+0000-U+001F inside JSON strings; a strict parse
    refuses them, which dropped the whole answer (issue 39)."""
    from gateway.parsers import forced_tool_calls as forced

    text = '[{"name":"get_weather","parameters":{"city":"a\x1e\nb\\"\x17"}}]'
    with pytest.raises(ValueError):
        json.loads(text)
    (call,) = forced.parse_required(text)
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": 'a\x1e\nb"\x17'}
    # streamed one character at a time: strict JSON arguments, whatever the cut
    sent, arguments, names = "", "", []
    for i in range(1, len(text) + 1):
        for piece in forced.required_stream_pieces(sent, text[:i]):
            names += [piece.name] if piece.name else []
            arguments += piece.arguments
        sent = text[:i]
    assert names == ["get_weather"] and json.loads(arguments) == {"city": 'a\x1e\nb"\x17'}
    assert forced.escape_control_characters('{"a":\n"x\ty"}') == '{"a":\n"x\\ty"}'  # outside strings: kept
