"""output_mode "derender" of /inference/v1/generate (vLLM 0.33): parse_context checks, the
render side's parse_context, and the derender choices built from the workers' text."""
from __future__ import annotations

import json

import msgspec
import pytest

from common.errors import BadRequest
from common.protocol import ClusterInfo, CompletionDelta, ModelInfo, WorkerLoad, WorkerStatus
from gateway.generate_api import parse_context
from gateway.openai_api import generate_derender
from gateway.generate_api.protocol import generate_request_decoder
from gateway.generate_api.request_mapping import map_request
from gateway.generate_api.response_builder import ResponseAccumulator
from gateway.openai_api.chat_output import ChatParsing
from gateway.openai_api.protocol import ChatCompletionRequest
from gateway.parsers import OutputParser

MODEL = ModelInfo(name="m", vocab_size=100, max_model_len=64, max_num_seqs=4)
CLUSTER = ClusterInfo(workers=[WorkerStatus(rank=0, load=WorkerLoad())], model=MODEL)
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def mapped(body: dict):
    http = generate_request_decoder.decode(msgspec.json.encode({"token_ids": [1], "sampling_params": {}, **body}))
    return map_request(http, {}, CLUSTER, MODEL, served_model_names=[], arrival_time=1.0)


def test_parse_context_fields_are_checked_in_every_mode_and_unknown_ones_only_in_derender():
    ctx = {"tools": [TOOL], "tool_choice": "auto", "history_tool_call_cnt": 3, "future": True}
    for mode in ("tokens", "text"):
        m = mapped({"output_mode": mode, "parse_context": ctx})
        assert m.parse_context.history_tool_call_cnt == 3 and not m.derender and m.wire.output_text is (mode == "text")
    with pytest.raises(BadRequest, match=r"Unknown parse_context fields \['future'\]; the render server is newer"):
        mapped({"output_mode": "derender", "parse_context": ctx})
    m = mapped({"output_mode": "derender", "parse_context": {k: v for k, v in ctx.items() if k != "future"}})
    assert m.derender and m.wire.output_text and m.parse_context.tools[0].function.name == "get_weather"
    assert mapped({"output_mode": "derender"}).parse_context is None
    for bad, param in (({"include_reasoning": "no"}, "parse_context.include_reasoning"),
                       ({"history_tool_call_cnt": -1}, "parse_context.history_tool_call_cnt"),
                       ({"tool_choice": "sometimes"}, "parse_context.tool_choice"),
                       ({"chat_template_kwargs": None}, "parse_context.chat_template_kwargs"),
                       ({"tools": [{"type": "function"}]}, "parse_context.tools[0]")):
        for mode in ("tokens", "derender"):
            with pytest.raises(BadRequest) as err:
                mapped({"output_mode": mode, "parse_context": bad})
            assert err.value.param == param, (bad, err.value.message)
    with pytest.raises(BadRequest, match="requires sampling_params.detokenize"):
        mapped({"output_mode": "derender", "sampling_params": {"detokenize": False}})


def test_derender_checks():
    class _R:
        parser = object()

    with pytest.raises(BadRequest, match=r"^output_mode='derender' does not support stream=true\.$"):
        generate_derender.check(True, None, None)
    with pytest.raises(BadRequest, match="requires parse_context"):
        generate_derender.check(False, None, _R())
    generate_derender.check(False, None, None)  # no parser: the text is the content
    named = parse_context.read({"tools": [TOOL], "tool_choice": {"function": {"name": "other"}}}, "derender")
    with pytest.raises(BadRequest, match="does not match any of the specified `tools`"):
        generate_derender.check(False, named, _R())


def test_parse_context_from_chat_request():
    tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {}, "strict": True,
                                             "extra": 1}, "defer_loading": True}
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "tool_calls": [{"id": "a"}, {"id": "b"}]},
                {"role": "assistant", "tool_calls": {"id": "c"}}, {"role": "tool", "tool_calls": [{"id": "d"}]}]
    req = ChatCompletionRequest(messages=messages, tools=[tool], tool_choice="auto", include_reasoning=False)
    ctx = parse_context.from_chat(req, {"enable_thinking": False})
    assert ctx == {"tools": [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {},
                                                               "strict": True, "defer_loading": True},
                              "defer_loading": True}],
                   "tool_choice": "auto", "parallel_tool_calls": True, "include_reasoning": False,
                   "chat_template_kwargs": {"enable_thinking": False}, "history_tool_call_cnt": 3}
    # What render emits reads back, in every mode.
    assert parse_context.read(json.loads(json.dumps(ctx)), "derender").include_reasoning is False
    assert parse_context.from_chat(ChatCompletionRequest(messages=[]), {})["tool_choice"] == "none"


def _body(setup, deltas, logprobs=None):
    m = mapped({"output_mode": "derender", "sampling_params": {"logprobs": logprobs} if logprobs is not None else {}})
    acc = ResponseAccumulator(m, derender=setup)
    for d in deltas:
        acc.add(d)
    return json.loads(acc.body())


@pytest.mark.parametrize("engine_reason, want", [("stop", "tool_calls"), ("length", "length")])
def test_derender_choice_parses_reasoning_and_tool_calls(engine_reason, want):
    parser = OutputParser("qwen3", "hermes")
    setup = generate_derender.DerenderSetup(ChatParsing(parser, reasoning_open=True, tools_enabled=True))
    text = "Let me check.</think>\n\n" + CALL
    body = _body(setup, [CompletionDelta(request_id="r", token_ids=[5, 6], text=text[:9]),
                         CompletionDelta(request_id="r", token_ids=[7], text=text[9:], finish_reason=engine_reason)])
    assert body["output_mode"] == "derender"
    choice = body["choices"][0]
    msg = choice["message"]
    assert msg["role"] == "assistant" and msg["reasoning"] == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
        [("get_weather", {"city": "Oslo"})]
    assert choice["finish_reason"] == want and choice["token_ids"] == [5, 6, 7] and choice["logprobs"] is None
    assert "text" not in choice


def test_derender_hidden_reasoning_hides_metadata_and_no_parser_is_plain_text():
    parser = OutputParser("qwen3", None)
    hidden = generate_derender.DerenderSetup(ChatParsing(parser, reasoning_open=True, include_reasoning=False),
                                           hide_metadata=True)
    choice = _body(hidden, [CompletionDelta(request_id="r", token_ids=[5], text="think</think>answer",
                                            finish_reason="stop")])["choices"][0]
    assert choice["message"]["reasoning"] is None and choice["message"]["content"] == "answer"
    assert choice["token_ids"] is None and choice["logprobs"] is None and choice["sampling_mask"] is None
    no_parser = generate_derender.setup(None, None, [5], 64)
    plain = _body(no_parser, [CompletionDelta(request_id="r", token_ids=[5], text="a</think>b", finish_reason="stop")])
    assert plain["choices"][0]["message"]["content"] == "a</think>b"
