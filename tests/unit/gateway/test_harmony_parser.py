"""gateway.parsers.harmony: GPT-OSS's harmony output split as vLLM 0.33's HarmonyParser splits it
(``--reasoning-parser openai_gptoss`` / ``--tool-call-parser openai``), and the streaming
contract: every prefix (cut at every character, so control tokens are cut everywhere) parses to
fields that only grow and add up to the final parse."""
from __future__ import annotations

import json
import random

import pytest

from gateway.parsers import OutputParser, ParsedOutput, ParsedToolCall
from gateway.parsers import harmony

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather. Call the tool.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city":"Paris","unit":"celsius"}<|call|>')


def P(r="openai_gptoss", t="openai") -> OutputParser:
    return OutputParser(r, t)


def _s(x):
    return x or ""


def is_prefix(a: ParsedOutput, b: ParsedOutput) -> bool:
    return (_s(b.reasoning).startswith(_s(a.reasoning)) and _s(b.content).startswith(_s(a.content))
            and b.tool_calls[:len(a.tool_calls)] == a.tool_calls)


def check_stream(parser: OutputParser, text: str, tools: bool = True) -> ParsedOutput:
    final = parser.parse(text, reasoning_open=True, tools_enabled=tools, final=True)
    parses = [parser.parse(text[:i], reasoning_open=True, tools_enabled=tools, final=False)
              for i in range(len(text) + 1)]
    for i, (a, b) in enumerate(zip(parses, parses[1:])):
        assert is_prefix(a, b), (text[:i + 1], a, b)
    for i, a in enumerate(parses):
        assert is_prefix(a, final), (text[:i], a, final)
    return final


def test_analysis_then_final():
    out = check_stream(P(), ANALYSIS + FINAL)
    assert out == ParsedOutput(reasoning="The user wants the weather. Call the tool.",
                               content="It is sunny in Paris.", tool_calls=[])


def test_the_stop_token_is_usually_not_in_the_text():
    # A worker stops on <|return|> / <|call|> (GPT-OSS's eos ids) and drops it from the text.
    assert P().parse((ANALYSIS + FINAL)[:-len("<|return|>")], reasoning_open=True, tools_enabled=True,
                     final=True).content == "It is sunny in Paris."
    out = check_stream(P(), ANALYSIS + CALL[:-len("<|call|>")])
    assert out.tool_calls == [ParsedToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')]


def test_tool_call_arguments_are_reserialized_like_vllm():
    out = check_stream(P(), ANALYSIS + CALL)
    assert out.reasoning == "The user wants the weather. Call the tool." and out.content is None
    # json.dumps(json.loads(text)): vLLM's non-streaming arguments
    assert out.tool_calls == [ParsedToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')]


@pytest.mark.parametrize("header", [
    "<|channel|>commentary to=functions.f <|constrain|>json",
    "<|channel|>commentary to=functions.f<|constrain|>json",  # no space: harmony inserts one
    " to=functions.f<|channel|>commentary <|constrain|>json",  # recipient in the role position
    " to=functions.f<|channel|>commentary json",
    "<|channel|>commentary to=functions.f",  # no content type: JSON assumed
    "<|channel|>analysis to=functions.f <|constrain|>json",  # any channel
])
def test_tool_call_header_forms(header):
    text = header + '<|message|>{"a": [1, 2]}<|call|>'
    assert check_stream(P(), text).tool_calls == [ParsedToolCall("f", '{"a": [1, 2]}')]


def test_non_json_content_type_and_bad_json_keep_the_text():
    out = check_stream(P(), "<|channel|>commentary to=functions.run <|constrain|>text<|message|>ls -la<|call|>")
    assert out.tool_calls == [ParsedToolCall("run", "ls -la")]
    out = check_stream(P(), "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{bad<|call|>")
    assert out.tool_calls == [ParsedToolCall("f", "{bad")]


def test_several_messages_join_with_newlines_and_preambles_are_content():
    text = ("<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>analysis<|message|>two<|end|>"
            "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>" + CALL +
            "<|start|>assistant<|channel|>final<|message|>Done.<|return|>")
    out = check_stream(P(), text)
    assert out.reasoning == "one\ntwo" and out.content == "Let me check.\nDone."
    assert [c.name for c in out.tool_calls] == ["get_weather"]


def test_builtin_tools_and_other_roles_are_dropped():
    text = ("<|channel|>commentary to=browser.search <|constrain|>json<|message|>{\"q\": 1}<|call|>"
            "<|start|>browser.search to=assistant<|channel|>commentary<|message|>results<|end|>"
            "<|start|>assistant<|channel|>analysis to=python<|message|>print(1)<|call|>"
            "<|start|>assistant<|channel|>final<|message|>ok<|return|>")
    out = check_stream(P(), text)
    # analysis to=python is reasoning in vLLM (only functions.* recipients are tool calls)
    assert out == ParsedOutput(reasoning="print(1)", content="ok", tool_calls=[])


def test_parsers_off_drop_their_messages():
    text = ANALYSIS + CALL + FINAL
    only_tools = check_stream(P(None, "openai"), text)
    assert only_tools.reasoning is None and only_tools.content == "It is sunny in Paris."
    assert len(only_tools.tool_calls) == 1
    only_reasoning = check_stream(P("openai_gptoss", None), text)
    assert only_reasoning.reasoning and only_reasoning.tool_calls == []
    # tools not enabled for the request (no tools / tool_choice none): calls dropped, not content
    assert check_stream(P(), text, tools=False) == ParsedOutput(
        reasoning="The user wants the weather. Call the tool.", content="It is sunny in Paris.", tool_calls=[])


def test_output_cut_by_length_ends_the_open_message():
    text = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sun"
    assert check_stream(P(), text).content == "It is sun"
    cut_header = ANALYSIS + "<|start|>assistant<|channel|>fin"
    # vLLM's strict parser fails on EOS inside a header; its recovery answers the raw text as content.
    out = check_stream(P(), cut_header)
    assert out.reasoning == "The user wants the weather. Call the tool."
    assert out.content == "<|start|>assistant<|channel|>fin"


def test_text_outside_the_format_is_content_at_the_end():
    out = check_stream(P(), "Hello, no harmony here.")
    assert out == ParsedOutput(reasoning=None, content="Hello, no harmony here.", tool_calls=[])
    assert P().parse("", reasoning_open=True, tools_enabled=True, final=True) == ParsedOutput(None, None, [])


def test_partial_end_tokens_are_held_back():
    p = P()
    text = "<|channel|>final<|message|>abc<|re"
    assert p.parse(text, reasoning_open=True, tools_enabled=True, final=False).content == "abc"
    assert p.parse(text, reasoning_open=True, tools_enabled=True, final=True).content == "abc<|re"


@pytest.mark.parametrize("header, expected", [
    ("<|channel|>final", harmony.Header("assistant", "final", None, None)),
    (" to=functions.f<|channel|>commentary json", harmony.Header("assistant", "commentary", "functions.f", "json")),
    ("<|channel|>commentary to=functions.f <|constrain|>json",
     harmony.Header("assistant", "commentary", "functions.f", "<|constrain|>json")),
])
def test_parse_header_as_openai_harmony(header, expected):
    assert harmony.parse_header(header, "assistant") == expected


def test_parse_header_of_a_later_message_reads_the_role():
    assert harmony.parse_header("assistant<|channel|>analysis", None).role == "assistant"
    assert harmony.parse_header("functions.f to=assistant<|channel|>commentary", None) == harmony.Header(
        "tool", "commentary", "assistant", None)
    with pytest.raises(harmony.HeaderError):
        harmony.parse_header("<|channel|>", "assistant")
    with pytest.raises(harmony.HeaderError):
        harmony.parse_header("a b c d", "assistant")


_PIECES = ["<|channel|>", "analysis", "final", "commentary", " to=functions.f", " <|constrain|>json", "<|message|>",
           "<|end|>", "<|start|>assistant", "<|call|>", "<|return|>", "hi", "{\"x\": 1}", " ", "\n", "<|", "é"]


def test_random_outputs_stream_monotonically():
    rng = random.Random(42)
    for _ in range(60):
        text = "".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 12)))
        for r, t in (("openai_gptoss", "openai"), ("openai_gptoss", None), (None, "openai")):
            check_stream(P(r, t), text)


def test_reasoning_open_and_special_tokens():
    p = P()
    assert p.keeps_special_tokens(tools_enabled=False) and P(None, "openai").keeps_special_tokens(tools_enabled=False)
    prompt = "<|start|>user<|message|>hi<|end|><|start|>assistant"
    assert p.reasoning_open_at_start(prompt, None) is True
    # an earlier turn's final answer does not end this turn's reasoning (vLLM's search of the
    # whole prompt would: documented difference)
    earlier = "<|start|>assistant<|channel|>final<|message|>Hi!<|end|><|start|>user<|message|>more<|end|>"
    assert p.reasoning_open_at_start(earlier + "<|start|>assistant", None) is True
    # continue_final_message of a final answer: generation starts inside the final channel
    assert p.reasoning_open_at_start(prompt + "<|channel|>final<|message|>The answer is", None) is False


@pytest.mark.parametrize("r, t", [("openai_gptoss", "hermes"), ("qwen3", "openai"), ("deepseek_r1", "openai")])
def test_harmony_parsers_do_not_mix(r, t):
    with pytest.raises(ValueError, match="Harmony requires"):
        OutputParser(r, t)


def test_tool_call_arguments_keep_unicode_escaped_as_vllm():
    text = '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"city": "Zürich"}<|call|>'
    assert check_stream(P(), text).tool_calls[0].arguments == json.dumps({"city": "Zürich"})


def test_gateway_flags_take_the_harmony_parsers_and_refuse_mixing(tmp_path):
    from gateway.main import build_parser, settings_from_args

    folder = str(tmp_path)
    s = settings_from_args(build_parser().parse_args(
        ["--tokenizer", folder, "--reasoning-parser", "openai_gptoss", "--tool-call-parser", "openai",
         "--enable-auto-tool-choice"]))
    assert (s.reasoning_parser, s.tool_call_parser) == ("openai_gptoss", "openai")
    with pytest.raises(SystemExit, match="Harmony requires the openai tool call parser"):
        settings_from_args(build_parser().parse_args(
            ["--tokenizer", folder, "--reasoning-parser", "openai_gptoss", "--tool-call-parser", "hermes"]))


def test_reasoning_token_counter_counts_analysis_and_addressed_commentary():
    """vLLM's usage count: a message's <|message|> token and content on the analysis channel
    or on commentary with a recipient; headers, end tokens and final / preamble text not."""
    from tests.support.chat_models import HARMONY
    from worker.engine.loading.demo_model import build_byte_tokenizer

    tok = build_byte_tokenizer(HARMONY)  # one id per byte: the count is the text's length
    counter = harmony.ReasoningTokenCounter.for_tokenizer(tok)
    preamble = "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    ids = tok.encode(ANALYSIS + preamble + CALL + FINAL).ids
    for i in range(0, len(ids), 5):  # as the deltas arrive
        counter.add(ids[i:i + 5])
    reasoning = "The user wants the weather. Call the tool."
    arguments = '{"city":"Paris","unit":"celsius"}'
    assert counter.count == (1 + len(reasoning)) + (1 + len(arguments))
    assert harmony.ReasoningTokenCounter.for_tokenizer(build_byte_tokenizer(("<|im_start|>",))) is None
