"""``/v1/messages`` and ``/v1/responses`` through the real stack (a broker, a worker on
the tiny Qwen3 chat model with Qwen3's real template, gateways with the qwen3 reasoning
and hermes tool parsers), driven by the real ``anthropic`` and ``openai`` SDKs.

Each answer is checked against the render routes and ``/inference/v1/generate``: the
prompt it generated from has the token count the render route's token ids have (a
previous_response_id conversation the count of the same conversation replayed in full),
and what it says is what greedy generation of the rendered prompt gives (the same token
count, the same text parsed the same way).  Forced tool choices (Anthropic ``any``,
Responses ``required``) go through xgrammar over enum-only schemas, so a random model
still calls the tool with valid arguments."""
from __future__ import annotations

import json
from typing import Literal

import anthropic
import httpx
import openai
import pydantic
import pytest

from tests.integration.test_openai_http import WORKER_ARGS, build_chat_model
from tests.support.gateway_helpers import GENERATE, metric_value, start_gateway
from tests.support.procs import ProcGroup, wait_for, wait_for_workers

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.timeout(600)

KEY, OTHER = "agent-key", "other-key"
CONFIG = '{"backend": "xgrammar", "disable_any_whitespace": true}'
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather of a city", "input_schema": CITY}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
                    "parameters": CITY}]
PARSERS = ("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
           "--structured-outputs-config", CONFIG)
NO_THINKING = {"type": "disabled"}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, qwen3_dir):
    return build_chat_model(qwen3_dir, tmp_path_factory.mktemp("qwen-chat") / "model")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, chat_model):
    with ProcGroup(tmp_path_factory.mktemp("agent-apis")) as procs:
        broker = procs.broker()
        procs.worker(broker, 0, "--model", str(chat_model), *WORKER_ARGS, "--structured-outputs-config", CONFIG)
        wait_for_workers(broker.frontend, 1, timeout=180)
        stored = start_gateway(procs, broker.frontend, "--tokenizer", str(chat_model), *PARSERS,
                               "--api-key", KEY, OTHER, env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
        default = start_gateway(procs, broker.frontend, "--tokenizer", str(chat_model), *PARSERS)
        yield stored, default


def _anthropic(gw, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=300)


def _openai(gw, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=300)


def _post(gw, path: str, body: dict, key: str = KEY) -> dict:
    r = httpx.post(gw.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _generate(gw, gen: dict, mode: str) -> dict:
    return _post(gw, GENERATE, dict(gen, output_mode=mode))["choices"][0]


def _model(gw) -> str:
    return _openai(gw).models.list().data[0].id


def _sdk(body: dict) -> dict:
    """A Messages body as the anthropic SDK takes it: this SDK has no sampling arguments
    (temperature, top_p, top_k), so they travel in extra_body as any client sends them."""
    sampling = {k: body[k] for k in ("temperature", "top_p", "top_k") if k in body}
    rest = {k: v for k, v in body.items() if k not in sampling}
    return dict(rest, extra_body=sampling) if sampling else rest


def _blocks(message) -> dict:
    return {b.type: b for b in message.content}


# ---------------------------------------------------------------- /v1/messages
@pytest.mark.parametrize("thinking", [None, NO_THINKING])
def test_messages_create_equals_render_and_generate(stack, thinking):
    """Thinking on (Qwen3's default) the random model's whole output is reasoning: one
    thinking block; off it is text.  Either way the blocks are the derender of greedy
    /generate over the rendered prompt, token for token."""
    gw, _ = stack
    body = {"model": _model(gw), "max_tokens": 12, "temperature": 0, "system": "You are terse.",
            "messages": [{"role": "user", "content": "Count to three."}], "metadata": {"user_id": "u1"}}
    if thinking:
        body["thinking"] = thinking
    message = _anthropic(gw).messages.create(**_sdk(body))
    gen = _post(gw, "/v1/messages/render", body)
    choice = _generate(gw, gen, "derender")
    assert message.type == "message" and message.role == "assistant" and message.model == body["model"]
    assert message.usage.input_tokens == len(gen["token_ids"])
    assert message.usage.output_tokens == len(choice["token_ids"]) == 12
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    blocks = _blocks(message)
    if thinking is None:
        assert list(blocks) == ["thinking"] and blocks["thinking"].thinking == choice["message"]["reasoning"]
        assert blocks["thinking"].signature
    else:
        assert list(blocks) == ["text"] and blocks["text"].text == choice["message"]["content"]
    assert _anthropic(gw).messages.count_tokens(
        model=body["model"], system=body["system"], messages=body["messages"],
        **({"thinking": thinking} if thinking else {})).input_tokens == len(gen["token_ids"])


def _sse_events(gw, path: str, body: dict, headers: dict) -> list[tuple[str, dict]]:
    events, name = [], None
    with httpx.stream("POST", gw.url + path, json=body, headers=headers, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
    return events


@pytest.mark.parametrize("thinking", [None, NO_THINKING])
def test_messages_stream_equals_create(stack, thinking):
    gw, _ = stack
    body = {"model": _model(gw), "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "Count to three."}]}
    if thinking:
        body["thinking"] = thinking
    client = _anthropic(gw)
    full = client.messages.create(**_sdk(body))
    with client.messages.stream(**_sdk(body)) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump(exclude={"signature"}) for b in streamed.content] == \
        [b.model_dump(exclude={"signature"}) for b in full.content]
    assert streamed.stop_reason == full.stop_reason and streamed.usage.output_tokens == full.usage.output_tokens
    # The raw event sequence, with x-api-key as Anthropic's clients send the key.
    events = _sse_events(gw, "/v1/messages", dict(body, stream=True), {"x-api-key": KEY})
    names = [n for n, _ in events]
    assert all(n == data["type"] for n, data in events)
    kind = "thinking" if thinking is None else "text"
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-2:] == ["message_delta",
                                                                                          "message_stop"]
    assert events[0][1]["message"]["usage"] == {"input_tokens": full.usage.input_tokens, "output_tokens": 0}
    assert events[2][1]["content_block"]["type"] == kind
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert {d["type"] for d in deltas} == ({"thinking_delta", "signature_delta"} if kind == "thinking"
                                           else {"text_delta"})
    assert names.count("content_block_stop") == 1 and names[-3] == "content_block_stop"
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    assert events[-2][1]["usage"]["output_tokens"] == 12


def test_messages_tools_over_several_turns(stack):
    """Turn 1 forced (``any``) to call the tool, streamed and not; turn 2 answers with
    the tool's result: its prompt is what the render route renders, and count_tokens
    counts it."""
    gw, _ = stack
    client = _anthropic(gw)
    model = _model(gw)
    user = {"role": "user", "content": "Weather in Paris?"}
    turn1 = dict(model=model, max_tokens=64, temperature=0, messages=[user], tools=ANTHROPIC_TOOLS,
                 tool_choice={"type": "any"}, thinking=NO_THINKING)
    first = client.messages.create(**_sdk(turn1))
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input["city"] in ("Paris", "Oslo") and call.id
    with client.messages.stream(**_sdk(turn1)) as stream:
        streamed = stream.get_final_message()
    (scall,) = [b for b in streamed.content if b.type == "tool_use"]
    assert scall.name == call.name and scall.input == call.input and streamed.stop_reason == "tool_use"
    events = _sse_events(gw, "/v1/messages", dict(turn1, stream=True), {"x-api-key": KEY})
    assert any(d.get("delta", {}).get("type") == "input_json_delta" for _, d in events)
    gen = _post(gw, "/v1/messages/render", turn1)
    assert first.usage.input_tokens == len(gen["token_ids"])

    turn2 = dict(turn1, tool_choice={"type": "auto"}, max_tokens=8, messages=[
        user, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21C"}]}])
    second = client.messages.create(**_sdk(turn2))
    gen2 = _post(gw, "/v1/messages/render", turn2)
    assert second.usage.input_tokens == len(gen2["token_ids"]) > len(gen["token_ids"])
    choice = _generate(gw, gen2, "derender")
    assert second.usage.output_tokens == len(choice["token_ids"])
    text = "".join(b.text for b in second.content if b.type == "text")
    assert text == (choice["message"]["content"] or "")
    # A named tool, and tool_choice none (the tools are shown, no call is parsed).
    named = client.messages.create(**_sdk(dict(turn1, tool_choice={"type": "tool", "name": "get_weather"})))
    (ncall,) = [b for b in named.content if b.type == "tool_use"]
    assert ncall.name == "get_weather" and ncall.input["city"] in ("Paris", "Oslo")
    assert named.stop_reason == "tool_use"
    none = client.messages.create(**_sdk(dict(turn1, tool_choice={"type": "none"}, max_tokens=8)))
    assert none.stop_reason != "tool_use" and not [b for b in none.content if b.type == "tool_use"]
    assert none.usage.input_tokens == first.usage.input_tokens
    counted = client.messages.count_tokens(model=model, messages=turn2["messages"], tools=ANTHROPIC_TOOLS,
                                           thinking=NO_THINKING)
    assert counted.input_tokens == len(gen2["token_ids"])


def test_messages_stop_sequence(stack):
    gw, _ = stack
    client = _anthropic(gw)
    body = dict(model=_model(gw), max_tokens=12, temperature=0, thinking=NO_THINKING,
                messages=[{"role": "user", "content": "Say hi."}])
    text = _blocks(client.messages.create(**_sdk(body)))["text"].text
    stop = text[2:5]
    assert len(stop) == 3 and text.find(stop) == 2, text
    out = client.messages.create(**_sdk(body), stop_sequences=[stop])
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
    assert "".join(b.text for b in out.content if b.type == "text") == text[:2]


def test_messages_errors_in_anthropics_shape(stack):
    gw, _ = stack
    model = _model(gw)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.AuthenticationError) as err:
        _anthropic(gw, key="wrong").messages.create(model=model, max_tokens=4, messages=msgs)
    assert err.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                         "message": "invalid x-api-key"}}
    with pytest.raises(anthropic.NotFoundError) as err:
        _anthropic(gw).messages.create(model="no-such-model", max_tokens=4, messages=msgs)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(gw.url + "/v1/messages", json={"model": model, "messages": msgs},
                   headers={"Authorization": f"Bearer {KEY}"})  # Bearer is taken too; max_tokens missing
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(gw.url + "/v1/messages/count_tokens", json={"model": model, "messages": msgs})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # x-api-key is Anthropic's: the OpenAI routes still want the Bearer token.
    assert httpx.post(gw.url + "/v1/responses", json={"input": "hi"}, headers={"x-api-key": KEY}).status_code == 401


# ---------------------------------------------------------------- /v1/responses
def test_responses_create_equals_render_and_generate(stack):
    """Reasoning on: one reasoning item whose every output token is counted as reasoning;
    off (effort none): the output text is greedy /generate's text of the rendered prompt."""
    gw, _ = stack
    client = _openai(gw)
    model = _model(gw)
    body = dict(model=model, input="Count to three.", instructions="You are terse.", max_output_tokens=12,
                temperature=0,
                metadata={"run": "1"}, store=False)
    out = client.responses.create(**body)
    gen = _post(gw, "/v1/responses/render", body)
    ids = _generate(gw, gen, "tokens")["token_ids"]
    assert out.object == "response" and out.id.startswith("resp_") and out.status == "incomplete"
    assert out.incomplete_details.reason == "max_output_tokens" and out.metadata == {"run": "1"}
    assert out.usage.input_tokens == len(gen["token_ids"]) and out.usage.output_tokens == len(ids) == 12
    # The same prompt again: its full blocks come from the prefix cache.
    again = client.responses.create(**body)
    assert 0 < again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens
    assert again.output[0].content[0].text == out.output[0].content[0].text
    (item,) = out.output
    assert item.type == "reasoning" and item.content[0].text
    assert out.usage.output_tokens_details.reasoning_tokens == 12 - _think_markers(gw, ids)

    off = dict(body, reasoning={"effort": "none"}, include=["message.output_text.logprobs"], top_logprobs=2)
    out = client.responses.create(**off)
    gen = _post(gw, "/v1/responses/render", off)
    text = _generate(gw, gen, "text")
    assert out.usage.input_tokens == len(gen["token_ids"]) and out.usage.output_tokens == len(text["token_ids"])
    assert out.output_text == text["text"] and out.usage.output_tokens_details.reasoning_tokens == 0
    (message,) = out.output
    logprobs = message.content[0].logprobs
    assert len(logprobs) == len(text["token_ids"]) and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    # Same tokens and the same logprobs (each a function of the whole prompt): the route
    # generated from exactly the rendered prompt.
    want = text["logprobs"]["content"]
    assert [(lp.token, lp.logprob) for lp in logprobs] == [(e["token"], pytest.approx(e["logprob"], abs=1e-5))
                                                          for e in want]
    assert [[t.token for t in lp.top_logprobs] for lp in logprobs] == [[t["token"] for t in e["top_logprobs"]]
                                                                       for e in want]


def test_responses_raw_messages_carry_the_exact_token_ids(stack):
    """vLLM's ``enable_response_messages`` (what RL trainers keep): ``input_messages`` is
    the rendered prompt with its token ids, ``output_messages`` the output with the ids
    generated -- equal to /render and greedy /generate of that prompt, streamed or not;
    absent (null) unless asked for."""
    gw, _ = stack
    client = _openai(gw)
    body = dict(model=_model(gw), input="Count to three.", max_output_tokens=9, temperature=0, store=False,
                reasoning={"effort": "none"})
    gen = _post(gw, "/v1/responses/render", body)
    text = _generate(gw, gen, "text")
    plain = client.responses.create(**body)
    assert plain.model_extra.get("input_messages") is None and plain.model_extra.get("output_messages") is None
    out = client.responses.create(**body, extra_body={"enable_response_messages": True})
    streamed = [e for e in client.responses.create(**body, stream=True, extra_body={"enable_response_messages": True})
                if e.type == "response.completed"][0].response
    for response in (out, streamed):
        (inp,), (outp,) = response.model_extra["input_messages"], response.model_extra["output_messages"]
        assert inp["type"] == outp["type"] == "raw_message_tokens"
        assert inp["tokens"] == gen["token_ids"] and inp["message"]
        assert outp["tokens"] == text["token_ids"] and outp["message"] == text["text"]


def _think_markers(gw, ids: list[int]) -> int:
    tokens = _post(gw, "/tokenize", {"prompt": "<think></think>"})["tokens"]
    return sum(t in tokens for t in ids)


def test_responses_stream_events_and_final_response(stack):
    gw, _ = stack
    client = _openai(gw)
    body = dict(model=_model(gw), input="Count to three.", max_output_tokens=12, temperature=0, store=False)
    full = client.responses.create(**body)
    with client.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.reasoning_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.reasoning_text.delta"}
    assert final.output[0].content[0].text == full.output[0].content[0].text
    assert final.usage.output_tokens == full.usage.output_tokens == 12
    # Reasoning off: output text events.
    with client.responses.stream(**body, reasoning={"effort": "none"}, include=["message.output_text.logprobs"],
                                 top_logprobs=1) as stream:
        events = list(stream)
        final = stream.get_final_response()
    streamed_logprobs = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert len(streamed_logprobs) == final.usage.output_tokens
    assert [lp.token for lp in streamed_logprobs] == [lp.token for lp in final.output[0].content[0].logprobs]
    kinds = [e.type for e in events]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == text and text


def test_responses_function_tools_over_several_turns(stack):
    """Turn 1 forced (``required``) to call the tool; turn 2 sends its output with the
    whole conversation replayed, and again through previous_response_id: both prompts
    are the one the render route renders for the replayed input."""
    gw, _ = stack
    client = _openai(gw)
    model = _model(gw)
    user = {"role": "user", "content": "Weather in Paris?"}
    turn1 = dict(model=model, input=[user], tools=RESPONSES_TOOLS, tool_choice="required", temperature=0,
                 max_output_tokens=64, reasoning={"effort": "none"}, parallel_tool_calls=False)
    first = client.responses.create(**turn1)
    (call,) = [i for i in first.output if i.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    with client.responses.stream(**turn1) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    (scall,) = [i for i in streamed.output if i.type == "function_call"]
    # The same call; streamed, its arguments are the model's own text (no spaces: the
    # grammar's), non-streamed re-serialized -- as on /v1/chat/completions.
    assert (scall.name, json.loads(scall.arguments)) == (call.name, json.loads(call.arguments))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == scall.arguments
    assert [e.type for e in events if e.type.startswith("response.function_call_arguments.done")]

    named = client.responses.create(**dict(turn1, tool_choice={"type": "function", "name": "get_weather"}))
    (ncall,) = [i for i in named.output if i.type == "function_call"]
    assert ncall.name == "get_weather" and json.loads(ncall.arguments)["city"] in ("Paris", "Oslo")

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}
    replay = dict(turn1, tool_choice="auto", max_output_tokens=8, include=["message.output_text.logprobs"],
                  input=[user, *[i.model_dump(exclude_none=True) for i in first.output], result])
    second = client.responses.create(**replay)
    gen = _post(gw, "/v1/responses/render", replay)
    text = _generate(gw, gen, "text")
    assert second.usage.input_tokens == len(gen["token_ids"])
    assert second.usage.output_tokens == len(text["token_ids"])
    chained = client.responses.create(**dict(replay, input=[result], previous_response_id=first.id))
    assert chained.usage.input_tokens == second.usage.input_tokens
    assert chained.output_text == second.output_text and chained.previous_response_id == first.id
    # The same logprobs from all three: the stored conversation renders to the replayed prompt.
    (message,) = [i for i in second.output if i.type == "message"]
    (chained_message,) = [i for i in chained.output if i.type == "message"]
    got = [(lp.token, lp.logprob) for lp in message.content[0].logprobs]
    assert got == [(lp.token, pytest.approx(lp.logprob, abs=1e-5)) for lp in chained_message.content[0].logprobs]
    assert got == [(e["token"], pytest.approx(e["logprob"], abs=1e-5)) for e in text["logprobs"]["content"]]


class City(pydantic.BaseModel):
    city: Literal["Paris", "Oslo"]


def test_responses_parse_with_a_pydantic_model(stack):
    gw, _ = stack
    out = _openai(gw).responses.parse(model=_model(gw), input="A city?", text_format=City, temperature=0,
                                      max_output_tokens=32, reasoning={"effort": "none"}, store=False)
    assert isinstance(out.output_parsed, City) and out.output_parsed.city == json.loads(out.output_text)["city"]


def test_stored_responses_are_key_scoped(stack):
    gw, default = stack
    client = _openai(gw)
    out = client.responses.create(model=_model(gw), input="Say hi.", max_output_tokens=4, temperature=0)
    got = client.responses.retrieve(out.id)
    assert got.id == out.id and got.output[0].content[0].text == out.output[0].content[0].text
    with pytest.raises(openai.NotFoundError):  # never readable with another key
        _openai(gw, OTHER).responses.retrieve(out.id)
    with pytest.raises(openai.NotFoundError):
        _openai(gw, OTHER).responses.create(model=_model(gw), input="more", previous_response_id=out.id,
                                            max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:  # a finished response cannot be cancelled
        client.responses.cancel(out.id)
    assert "Cannot cancel a synchronous response" in str(err.value)
    stateless = client.responses.create(model=_model(gw), input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stateless.id)
    # vLLM's default: no store; store=true (the default) is silently not stored.
    plain = _openai(default)
    kept = plain.responses.create(model=_model(default), input="hi", max_output_tokens=2)
    assert kept.store is False
    with pytest.raises(openai.NotFoundError):
        plain.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        plain.responses.create(model=_model(default), input="more", previous_response_id=kept.id, max_output_tokens=2)


def test_background_responses_finish_in_the_store_and_cancel(stack):
    """background: answered queued at once, generated detached, the finished Response in
    the store (the same as the foreground one); a running one cancelled stays cancelled;
    without the store (vLLM's default) background is vLLM's 400."""
    gw, default = stack
    client = _openai(gw)
    body = dict(model=_model(gw), input="Count to three.", max_output_tokens=12, temperature=0,
                reasoning={"effort": "none"})
    queued = client.responses.create(**body, background=True)
    assert queued.status == "queued" and queued.output == [] and queued.background is True

    def finished():
        got = client.responses.retrieve(queued.id)
        return got if got.status not in ("queued", "in_progress") else None

    done = wait_for(finished, 120, "the background response to finish")
    foreground = client.responses.create(**body, store=False)
    assert done.status == foreground.status == "incomplete" and done.id == queued.id
    assert done.output_text == foreground.output_text and done.usage.output_tokens == 12
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response"):
        client.responses.cancel(queued.id)
    with pytest.raises(openai.NotFoundError):  # another key's
        _openai(gw, OTHER).responses.cancel(queued.id)

    long = client.responses.create(**dict(body, max_output_tokens=900), background=True,
                                   extra_body={"ignore_eos": True})
    running = lambda: metric_value(httpx.get(gw.url + "/metrics").text, "vllm:num_requests_running")  # noqa: E731
    wait_for(lambda: running() >= 1, 60, "the background request to run")
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.id == long.id
    assert client.responses.retrieve(long.id).status == "cancelled"
    # the workers let it go: nothing is left running
    wait_for(lambda: running() == 0, 60, "the cancelled request to leave the workers")
    assert client.responses.retrieve(long.id).status == "cancelled"

    with pytest.raises(openai.BadRequestError, match="VLLM_ENABLE_RESPONSES_API_STORE"):
        _openai(default).responses.create(**body, background=True)


@pytest.mark.parametrize("body, needle", [
    ({"input": "hi", "tools": [{"type": "web_search_preview"}]}, "web_search_preview"),
    ({"input": "hi", "background": True, "stream": True}, "stream"),
    ({"input": []}, "non-empty"),
])
def test_responses_refusals(stack, body, needle):
    gw, _ = stack
    r = httpx.post(gw.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
