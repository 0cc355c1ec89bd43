"""Responses / Anthropic Messages -> chat messages, as vLLM 0.33 converts them
(construct_input_messages, AnthropicServingMessages.to_chat_completion_request)."""
from __future__ import annotations

import json

import pytest

from common.errors import BadRequest
from gateway.openai_api.responses_messages import (
    messages_chat_request,
    messages_request_decoder,
    responses_chat_request,
    responses_request_decoder,
)


def _responses(**body):
    return responses_request_decoder.decode(json.dumps(body))


def _anthropic(**body):
    return messages_request_decoder.decode(json.dumps(dict({"model": "m", "max_tokens": 4}, **body)))


def test_response_items_merge_into_one_assistant_turn():
    chat = responses_chat_request(_responses(input=[
        {"role": "user", "content": "q"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "sum"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "namespace": "ns", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "r1"}]))
    assert chat.messages == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "reasoning": "sum", "content": "a", "tool_calls": [
            {"id": "c1", "function": {"name": "f", "arguments": "{}"}, "type": "function"},
            {"id": "c2", "function": {"name": "ns__g", "arguments": "{}"}, "type": "function"}]},
        {"role": "tool", "content": "r1", "tool_call_id": "c1"}]
    assert chat.add_generation_prompt and not chat.continue_final_message


def test_responses_fields_map_to_chat():
    chat = responses_chat_request(_responses(
        input="hi", instructions="sys", max_output_tokens=5, truncation="auto",
        include=["message.output_text.logprobs"], top_logprobs=2, reasoning={"effort": "low"},
        tools=[{"type": "function", "name": "f"}, {"type": "web_search"},
               {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "g", "strict": True}]},
               {"type": "custom", "name": "c", "description": "free"}]),
        auto_tools=True)
    assert chat.messages == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    assert chat.max_completion_tokens == 5 and chat.truncate_prompt_tokens == -1
    assert chat.logprobs is True and chat.top_logprobs == 2 and chat.reasoning_effort == "low"
    assert chat.tools[:2] == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": None}},
        {"type": "function", "function": {"name": "ns__g", "description": None, "parameters": None, "strict": True}}]
    assert chat.tools[2]["function"]["name"] == "c" and chat.tools[2]["function"]["parameters"]["required"] == ["input"]
    assert chat.tool_choice == "auto"
    assert responses_chat_request(_responses(input="hi", tools=[{"type": "function", "name": "f"}])).tool_choice is None


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice"),
    ({"input": [], }, "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ({"input": "x", "text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"input": "x", "background": True, "store": False}, "background"),
])
def test_responses_refusals(body, param):
    with pytest.raises(BadRequest) as err:
        responses_chat_request(_responses(**body))
    assert err.value.param == param


def test_anthropic_blocks_to_chat():
    chat = messages_chat_request(_anthropic(
        system="S", stop_sequences=["z"], top_k=3, tool_choice={"type": "any", "disable_parallel_tool_use": True},
        tools=[{"name": "f", "input_schema": {"properties": {}}, "strict": True}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "look"},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AAA"}}]},
            {"role": "assistant", "content": [{"type": "text", "text": "ok"},
                                              {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                                              {"type": "tool_result", "tool_use_id": "t0", "content": "old"}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "l1"}, {"type": "text", "text": "l2"},
                {"type": "image", "source": {"type": "url", "url": "http://x/i.png"}}]}]},
            {"role": "system", "content": "inline"}]), merge_inline_system=False)
    assert chat.messages == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": "Tool result: old"}],
         "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "l1\nl2"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/i.png"}}]},
        {"role": "system", "content": "inline"}]
    assert chat.stop == ["z"] and chat.top_k == 3 and chat.max_tokens == 4 and chat.max_completion_tokens == 4
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools == [{"type": "function", "function": {
        "name": "f", "description": None, "parameters": {"properties": {}, "type": "object"}, "strict": True}}]


def test_anthropic_inline_system_merged_and_named_tool_choice():
    chat = messages_chat_request(_anthropic(
        system=[{"type": "text", "text": "A"}], tool_choice={"type": "tool", "name": "f"},
        messages=[{"role": "user", "content": "u"}, {"role": "system", "content": [{"type": "text", "text": "B"}]}]),
        merge_inline_system=True)
    assert chat.messages == [{"role": "system", "content": "AB"}, {"role": "user", "content": "u"}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}} and chat.tools is None
