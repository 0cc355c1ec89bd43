"""The generating agent APIs' pieces without a stack: the Anthropic and Responses event
sequences built from worker deltas (qwen3 reasoning, hermes tool calls, a forced call),
stop-reason mapping, the previous-response conversation, the bounded key-scoped store,
the reasoning-token count, Anthropic's error shape and the key scope."""
from __future__ import annotations

import json

from common.protocol import CompletionDelta
from gateway.auth import key_scope
from gateway.generate_api.protocol import HttpGenerateRequest, HttpSamplingParams
from gateway.openai_api.chat_output import ChatParsing
from gateway.openai_api.messages_output import MessagesCollector, MessagesStream, anthropic_error, stop_reason
from gateway.openai_api.render import RenderedChat
from gateway.openai_api.response_store import ResponseStore
from gateway.openai_api.responses_messages import previous_messages, responses_request_decoder
from gateway.openai_api.responses_output import (
    ReasoningCounter,
    ResponseContext,
    ResponsesCollector,
    ResponsesStream,
)
from gateway.parsers import OutputParser

QWEN = ChatParsing(OutputParser("qwen3", "hermes"), reasoning_open=True, tools_enabled=True)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PIECES = ["plan", " it</think>", "Sure.", CALL]


def _rendered(parsing: ChatParsing = QWEN) -> RenderedChat:
    request = HttpGenerateRequest(request_id="chatcmpl-1", token_ids=[1, 2, 3],
                                  sampling_params=HttpSamplingParams(temperature=0.0, max_tokens=9))
    return RenderedChat(request=request, prompt_text=None, token_ids=[1, 2, 3], parsing=parsing)


def _deltas(pieces: list[str], finish: str = "stop", stop=None) -> list[CompletionDelta]:
    out = [CompletionDelta(request_id="r", token_ids=[10 + i], text=p, num_prompt_tokens=3, num_cached_tokens=2)
           for i, p in enumerate(pieces)]
    out[-1].finish_reason, out[-1].stop_reason = finish, stop
    return out


def _events(raw: bytes) -> list[tuple[str, dict]]:
    events = []
    for block in raw.decode().split("\n\n"):
        if block:
            name, data = block.split("\n")
            events.append((name[len("event: "):], json.loads(data[len("data: "):])))
    return events


def _stream(formatter, deltas) -> list[tuple[str, dict]]:
    raw = b"".join(formatter.head())
    for d in deltas:
        raw += formatter.chunk(d) or b""
    raw += formatter.final() or b""
    return _events(raw)


# ---------------------------------------------------------------- Anthropic
def test_messages_body_thinking_text_and_tool_use():
    collector = MessagesCollector(None, _rendered(), "m", None)
    for d in _deltas(PIECES):
        collector.add(d)
    body = json.loads(collector.body())
    blocks = body.pop("content")
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[0]["thinking"] == "plan it" and blocks[0]["signature"]
    assert blocks[1] == {"type": "text", "text": "Sure."}
    assert blocks[2]["name"] == "get_weather" and blocks[2]["input"] == {"city": "Paris"} and blocks[2]["id"]
    assert body == {"id": "chatcmpl-1", "type": "message", "role": "assistant", "model": "m",
                    "stop_reason": "tool_use", "stop_sequence": None,
                    "usage": {"input_tokens": 3, "output_tokens": 4}}


def test_messages_stream_event_sequence():
    events = _stream(MessagesStream(None, _rendered(), "m", None), _deltas(PIECES))
    names = [n for n, _ in events]
    assert all(n == e["type"] for n, e in events)
    assert names == ["message_start", "ping",
                     "content_block_start", "content_block_delta", "content_block_delta", "content_block_delta",
                     "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    starts = [e["content_block"] for n, e in events if n == "content_block_start"]
    assert [s["type"] for s in starts] == ["thinking", "text", "tool_use"] and starts[2]["input"] == {}
    deltas = [(e["index"], e["delta"]) for n, e in events if n == "content_block_delta"]
    assert [d["type"] for _, d in deltas] == ["thinking_delta", "thinking_delta", "signature_delta", "text_delta",
                                              "input_json_delta"]
    assert "".join(d.get("thinking", "") for _, d in deltas) == "plan it"
    assert json.loads(deltas[-1][1]["partial_json"]) == {"city": "Paris"}
    assert [i for i, _ in deltas] == [0, 0, 0, 1, 2]
    assert events[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                             "usage": {"input_tokens": 3, "output_tokens": 4}}
    assert MessagesStream.done == b""


def test_messages_forced_call_streams_its_arguments_in_pieces():
    forced = ChatParsing(forced_tool_choice="named", named_tool="get_weather")
    events = _stream(MessagesStream(None, _rendered(forced), "m", None), _deltas(['{"ci', 'ty": "Oslo"}']))
    partial = [e["delta"]["partial_json"] for n, e in events if e.get("delta", {}).get("type") == "input_json_delta"]
    assert partial == ['{"ci', 'ty": "Oslo"}']
    # A forced named call stops with tool_use, as Anthropic answers (vLLM: end_turn).
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_stop_reasons():
    plain = _rendered(ChatParsing())
    assert stop_reason(plain, "stop", None, False, None) == ("end_turn", None)
    assert stop_reason(plain, "length", None, False, None) == ("max_tokens", None)
    assert stop_reason(plain, "stop", None, True, None) == ("tool_use", None)
    assert stop_reason(plain, "stop", "##", False, ["##"]) == ("stop_sequence", "##")
    assert stop_reason(plain, "stop", 7, False, ["##"]) == ("end_turn", None)  # a stop token id
    named = _rendered(ChatParsing(forced_tool_choice="named", named_tool="f"))
    assert stop_reason(named, "stop", None, True, None) == ("tool_use", None)
    assert stop_reason(named, "length", None, True, None) == ("max_tokens", None)


def test_anthropic_error_shape():
    assert json.loads(anthropic_error(404, "nope")) == {"type": "error", "error": {"type": "not_found_error",
                                                                                   "message": "nope"}}
    assert json.loads(anthropic_error(503, "x"))["error"]["type"] == "overloaded_error"
    assert json.loads(anthropic_error(500, "x"))["error"]["type"] == "api_error"
    assert json.loads(anthropic_error(422, "x"))["error"]["type"] == "invalid_request_error"


# ---------------------------------------------------------------- Responses
def _ctx(parsing: ChatParsing = QWEN, **body) -> ResponseContext:
    request = responses_request_decoder.decode(json.dumps(dict({"input": "hi"}, **body)))
    return ResponseContext(request=request, response_id="resp_1", model="m", rendered=_rendered(parsing),
                           markers=(50, 51), created=7)


def test_responses_body_items_status_and_usage():
    collector = ResponsesCollector(None, _ctx(metadata={"k": "v"}))
    deltas = _deltas(PIECES)
    deltas[1].token_ids = [51]  # </think>
    for d in deltas:
        collector.add(d)
    body = json.loads(collector.body())
    assert [i["type"] for i in body["output"]] == ["reasoning", "message", "function_call"]
    assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": "plan it"}]
    assert body["output"][1]["content"][0]["text"] == "Sure."
    call = body["output"][2]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert body["status"] == "completed" and body["incomplete_details"] is None and body["metadata"] == {"k": "v"}
    assert body["usage"] == {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 4,
                             "output_tokens_details": {"reasoning_tokens": 1}, "total_tokens": 7}
    cut = ResponsesCollector(None, _ctx(ChatParsing()))
    for d in _deltas(["a", "b"], finish="length"):
        cut.add(d)
    body = json.loads(cut.body())
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}


def test_responses_stream_event_sequence_and_numbers():
    stored = []
    events = _stream(ResponsesStream(None, _ctx(), stored.append), _deltas(PIECES))
    kinds = [n for n, _ in events]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    assert all(n == e["type"] for n, e in events)
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    final = events[-1][1]["response"]
    done_items = [e["item"] for n, e in events if n == "response.output_item.done"]
    assert final["output"] == done_items and stored == [final]
    added = [e["item"]["id"] for n, e in events if n == "response.output_item.added"]
    assert added == [i["id"] for i in done_items]
    assert [e["output_index"] for n, e in events if n == "response.output_item.added"] == [0, 1, 2]
    assert events[0][1]["response"]["status"] == "in_progress" and final["status"] == "completed"


def test_previous_messages_replay_calls_but_not_instructions():
    messages = [{"role": "system", "content": "old instructions"}, {"role": "user", "content": "q"}]
    output = [{"type": "reasoning", "id": "rs", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]},
              {"type": "function_call", "id": "fc", "call_id": "c1", "name": "f", "arguments": "{}",
               "status": "completed"}]
    assert previous_messages(messages, output) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "reasoning": "r",
         "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}, "type": "function"}]}]


def test_reasoning_counter():
    counter = ReasoningCounter((50, 51), starts_open=True)
    counter.add([1, 2, 51, 3, 50, 4, 51, 5])
    assert counter.count == 3
    none = ReasoningCounter(None, starts_open=True)
    none.add([1, 2])
    assert none.count == 0


# ---------------------------------------------------------------- store, key scope
def _response(i: int, text: str = "") -> dict:
    return {"id": f"resp_{i}", "output": text}


def test_store_is_bounded_in_count_and_bytes_and_scoped():
    store = ResponseStore(max_entries=2, max_bytes=10_000)
    for i in range(3):
        assert store.put("a", _response(i), [])
    assert store.get("a", "resp_0") is None and store.get("a", "resp_2") is not None and len(store) == 2
    assert store.get("b", "resp_2") is None  # another key's scope
    small = ResponseStore(max_entries=100, max_bytes=200)
    assert small.put("a", _response(1, "x" * 100), [])
    assert small.put("a", _response(2, "y" * 100), [])
    assert small.get("a", "resp_1") is None and small.bytes <= 200  # evicted by bytes
    assert not small.put("a", _response(3, "z" * 500), [])  # bigger than the bound alone: not kept
    assert small.get("a", "resp_3") is None


class _Req:
    def __init__(self, headers: dict):
        self.headers = {k.lower(): v for k, v in headers.items()}

    def get_header(self, name: str):
        return self.headers.get(name.lower())


def test_key_scope():
    a = key_scope(_Req({"Authorization": "Bearer k1"}))
    assert a and a == key_scope(_Req({"x-api-key": "k1"})) and "k1" not in a
    assert a != key_scope(_Req({"Authorization": "Bearer k2"}))
    assert key_scope(_Req({})) == ""


def test_previous_response_history_goes_between_instructions_and_input():
    import pytest

    from common.errors import ServingError
    from gateway.openai_api.responses_messages import responses_chat_request

    request = responses_request_decoder.decode(json.dumps({
        "instructions": "new rules", "previous_response_id": "resp_1",
        "input": [{"type": "function_call_output", "call_id": "c1", "output": "sunny"}]}))
    history = [{"role": "user", "content": "q"},
               {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                     "function": {"name": "f", "arguments": "{}"}}]}]
    chat = responses_chat_request(request, history=history)
    assert chat.messages == [{"role": "system", "content": "new rules"}, *history,
                             {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    with pytest.raises(ServingError, match="stateless render endpoint"):  # the render route has no store
        responses_chat_request(request)


def test_generating_route_refuses_builtin_tools_and_unserved_background():
    import pytest

    from common.errors import BadRequest
    from gateway.resources.agent_apis import _refuse_unserved

    def request(**body):
        return responses_request_decoder.decode(json.dumps(dict({"input": "hi"}, **body)))

    from common.errors import ServingError

    _refuse_unserved(request(tools=[{"type": "function", "name": "f", "parameters": {}}]), True)
    for tool in ("web_search_preview", "file_search", "code_interpreter", "mcp", "custom"):
        with pytest.raises(BadRequest, match=f"'{tool}'"):
            _refuse_unserved(request(tools=[{"type": tool, "name": "x"}]), True)
    _refuse_unserved(request(background=True), True)
    with pytest.raises(ServingError, match="VLLM_ENABLE_RESPONSES_API_STORE"):  # vLLM: store needed
        _refuse_unserved(request(background=True), False)
    with pytest.raises(BadRequest, match="stream"):
        _refuse_unserved(request(background=True, stream=True), True)


class _FakeRun:
    """A Generation stand-in: its deltas, then (``hang``) none until cancelled."""

    def __init__(self, deltas, hang: bool = False, fail: Exception = None):
        self.deltas, self.hang, self.fail = deltas, hang, fail
        self.closed = []

    async def start(self):
        if self.fail is not None:
            raise self.fail

    async def __aiter__(self):
        import asyncio

        for d in self.deltas:
            yield d
        if self.hang:
            await asyncio.Event().wait()

    async def close(self, error_status=None):
        self.closed.append(error_status)


def test_background_responses_finish_fail_and_cancel():
    import asyncio

    import pytest

    from common.errors import BadRequest, NotFound, ServingError
    from gateway.resources.agent_apis import BackgroundResponses

    async def scenario():
        store = ResponseStore(10, 100_000)
        background = BackgroundResponses(store)
        ctx = _ctx(ChatParsing())
        queued = background.start("k", _FakeRun(_deltas(["a", "b"])), ctx, [{"role": "user", "content": "hi"}])
        assert queued["status"] == "queued" and store.get("k", "resp_1").response["status"] == "queued"
        await asyncio.gather(*background.tasks.values())
        done = store.get("k", "resp_1")
        assert done.response["status"] == "completed" and done.response["output"][0]["content"][0]["text"] == "ab"
        assert done.messages == [{"role": "user", "content": "hi"}] and not background.tasks
        with pytest.raises(ServingError, match="Cannot cancel a synchronous response"):
            await background.cancel("k", "resp_1")
        with pytest.raises(NotFound):
            await background.cancel("other-key", "resp_1")

        hanging = _FakeRun([CompletionDelta(request_id="r", token_ids=[1], text="a")], hang=True)
        ctx2 = _ctx(ChatParsing())
        ctx2.response_id = "resp_2"
        background.start("k", hanging, ctx2, [])
        await asyncio.sleep(0)
        cancelled = await background.cancel("k", "resp_2")
        assert cancelled["status"] == "cancelled" and hanging.closed[0] == 499  # closing aborts the generation
        assert store.get("k", "resp_2").response["status"] == "cancelled" and not background.tasks

        ctx3 = _ctx(ChatParsing())
        ctx3.response_id = "resp_3"
        failing = _FakeRun([], fail=BadRequest("worker says no"))
        background.start("k", failing, ctx3, [])
        await asyncio.gather(*background.tasks.values())
        failed = store.get("k", "resp_3").response
        assert failed["status"] == "failed" and failed["error"]["message"] == "worker says no"
        assert failing.closed == [400]

    asyncio.run(scenario())
