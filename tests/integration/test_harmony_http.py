"""GPT-OSS's harmony format in the OpenAI facade: a gateway with ``--reasoning-parser
openai_gptoss --tool-call-parser openai --enable-auto-tool-choice`` on a tokenizer carrying
harmony's control tokens and GPT-OSS's real chat template, a broker and a scripted worker whose
reply is harmony output (tests/support/fake_worker.py ``--reply-file``).  The official openai
client reads ``reasoning`` (the analysis channel), ``content`` (final) and ``tool_calls``
(commentary to=functions.NAME), streamed and not; the derender routes decode real token ids of
the same output with the gateway's own detokenizer."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.support import inprocess_gateway
from tests.support.chat_models import TEMPLATE_MODELS, write_model
from tests.support.gateway_helpers import stream_chat
from tests.support.procs import ProcGroup, wait_for_workers

GPT_OSS = next(spec for spec in TEMPLATE_MODELS if spec.hf_id == "openai/gpt-oss-120b")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What's the weather like in Paris?"}]
REASONING = "The user wants the weather. I should call the tool."
ANSWER = "It is sunny in Paris, 21 degrees."
# What GPT-OSS writes after the prompt's "<|start|>assistant"; the stop tokens (<|return|>,
# <|call|>) end generation and are not part of the text.
ANSWERED = (f"<|channel|>analysis<|message|>{REASONING}<|end|>"
            f"<|start|>assistant<|channel|>final<|message|>{ANSWER}")
CALLED = (f"<|channel|>analysis<|message|>{REASONING}<|end|>"
          '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
          '{"city":"Paris"}')


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("harmony-stack")
    reply, records = root / "reply.json", root / "records"
    reply.write_text(json.dumps({"text": ANSWERED, "chunk": 3}))
    records.mkdir()
    folder = write_model(GPT_OSS, root / "gpt-oss")
    with ProcGroup(root / "logs") as procs:
        broker = procs.broker()
        procs.fake_worker(broker, 0, "--has-tokenizer", "--reply-file", str(reply), "--record-dir", str(records))
        wait_for_workers(broker.frontend, 1, timeout=60)
        with inprocess_gateway.serve(tokenizer=str(folder), broker=broker.frontend, served_model_names=["gpt-oss"],
                                     reasoning_parser="openai_gptoss", tool_call_parser="openai",
                                     enable_auto_tool_choice=True, info_ttl_s=0.2) as gw:
            yield {"gw": gw, "reply": reply, "folder": folder, "records": records}


def _reply(stack, text: str, chunk: int = 3) -> None:
    """Chunks of 3 characters: every control token arrives cut into pieces."""
    stack["reply"].write_text(json.dumps({"text": text, "chunk": chunk}))


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack["gw"].url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_prompt_renders_through_gpt_oss_template(stack):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(stack["folder"]))
    body = {"messages": MESSAGES, "tools": TOOLS, "chat_template_kwargs": {"reasoning_effort": "low"}}
    r = httpx.post(stack["gw"].url + "/v1/chat/completions/render", json=body, timeout=60)
    assert r.status_code == 200, r.text
    gen = r.json()
    want = hf.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                  return_dict=False, reasoning_effort="low")
    assert gen["token_ids"] == list(want)
    prompt = hf.decode(gen["token_ids"])
    assert "Reasoning: low" in prompt and "namespace functions" in prompt and prompt.endswith("<|start|>assistant")
    # the parser reads harmony's control tokens: the worker is told to keep them in the text
    assert gen["sampling_params"]["skip_special_tokens"] is False
    assert gen["reasoning_ended"] is False  # vLLM's is_reasoning_end: no final-channel header in the prompt
    # the request's reasoning_effort reaches the template (over chat_template_kwargs), as vLLM passes it
    body = {"messages": MESSAGES, "reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}}
    r = httpx.post(stack["gw"].url + "/v1/chat/completions/render", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["token_ids"] == list(hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                                return_dict=False, reasoning_effort="high"))


def test_reasoning_and_content(stack):
    _reply(stack, ANSWERED)
    client = _client(stack)
    kw = dict(model="gpt-oss", messages=MESSAGES, max_tokens=200)
    full = client.chat.completions.create(**kw).choices[0]
    assert full.message.reasoning == REASONING
    assert full.message.content == ANSWER
    assert not full.message.tool_calls and full.finish_reason == "stop"
    reasoning, content, calls, finish = stream_chat(client, **kw)
    assert (reasoning, content, calls, finish) == (REASONING, ANSWER, [], "stop")


def test_include_reasoning_false_hides_the_analysis_channel(stack):
    _reply(stack, ANSWERED)
    client = _client(stack)
    kw = dict(model="gpt-oss", messages=MESSAGES, max_tokens=200, extra_body={"include_reasoning": False})
    msg = client.chat.completions.create(**kw).choices[0].message
    assert getattr(msg, "reasoning", None) is None and msg.content == ANSWER
    assert stream_chat(client, **kw)[:2] == ("", ANSWER)


def test_tool_call(stack):
    _reply(stack, CALLED)
    client = _client(stack)
    kw = dict(model="gpt-oss", messages=MESSAGES, tools=TOOLS, max_tokens=200)
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning == REASONING and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather" and call.function.arguments == '{"city": "Paris"}'
    reasoning, content, calls, finish = stream_chat(client, **kw)
    assert reasoning == REASONING and content == "" and finish == "tool_calls"
    (delta,) = calls
    assert delta.index == 0 and delta.id.startswith("chatcmpl-tool-")
    assert delta.function.name == "get_weather" and json.loads(delta.function.arguments) == {"city": "Paris"}


def test_tool_call_message_without_tools_is_dropped(stack):
    """tool_choice "none" (or no tools): vLLM's harmony parser surfaces no calls, and the
    call message is not content either."""
    _reply(stack, CALLED)
    client = _client(stack)
    msg = client.chat.completions.create(model="gpt-oss", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                         max_tokens=200).choices[0].message
    assert msg.reasoning == REASONING and msg.content is None and not msg.tool_calls


def test_multi_turn_with_the_tool_result_renders_and_answers(stack):
    """The assistant's call and the tool's result go back through the template (the
    conversation an agent loop sends next)."""
    _reply(stack, ANSWERED)
    client = _client(stack)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    r = httpx.post(stack["gw"].url + "/v1/chat/completions/render", json={"messages": messages, "tools": TOOLS},
                   timeout=60)
    prompt_ids = r.json()["token_ids"]
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(str(stack["folder"])).decode(prompt_ids)
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
            '<|call|>') in prompt
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\\"temperature\\": 21}"' \
        in prompt
    msg = client.chat.completions.create(model="gpt-oss", messages=messages, tools=TOOLS,
                                         max_tokens=200).choices[0].message
    assert msg.content == ANSWER and msg.reasoning == REASONING


def _chunk(ids, finish=None) -> dict:
    return {"request_id": "r1", "output_mode": "tokens",
            "choices": [{"index": 0, "token_ids": ids, "finish_reason": finish, "stop_reason": None}]}


@pytest.mark.parametrize("text, stop", [(ANSWERED, "<|return|>"), (CALLED, "<|call|>")])
def test_derender_decodes_harmony_token_ids(stack, text, stop):
    """Token ids in, as a worker produced them (the stop token last): the gateway decodes them
    with the special tokens kept and parses the channels, whole and one token per chunk."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(stack["folder"]))
    gw = stack["gw"].url
    chat = {"messages": MESSAGES, "tools": TOOLS}
    prompt = httpx.post(gw + "/v1/chat/completions/render", json=chat, timeout=60).json()["token_ids"]
    ids = hf.encode(text + stop, add_special_tokens=False)
    assert hf.convert_tokens_to_ids("<|channel|>") in ids  # control tokens are single ids
    r = httpx.post(gw + "/v1/chat/completions/derender", timeout=60, json={
        "generate_response": _chunk(ids, "stop"), "prompt_token_ids": prompt, "chat_request": chat})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    msg = choice["message"]
    assert msg["reasoning"] == REASONING
    if stop == "<|call|>":
        assert msg["content"] is None and choice["finish_reason"] == "tool_calls"
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
            ("get_weather", '{"city": "Paris"}')]
    else:
        assert msg["content"] == ANSWER and not msg["tool_calls"]
    state, reasoning, content, calls = None, "", "", []
    for j, tid in enumerate(ids):
        r = httpx.post(gw + "/v1/chat/completions/derender", timeout=60, json={
            "stream": True, "generate_chunk": _chunk([tid], "stop" if j == len(ids) - 1 else None),
            "stream_state": state, "prompt_token_ids": prompt, "chat_request": chat})
        assert r.status_code == 200, r.text
        d = r.json()
        state = d["stream_state"]
        delta = d["chunk"]["choices"][0]["delta"]
        reasoning += delta.get("reasoning") or ""
        content += delta.get("content") or ""
        calls += delta.get("tool_calls") or []
        assert "<|" not in (delta.get("reasoning") or "") + (delta.get("content") or "")
    assert reasoning == REASONING and content == (msg["content"] or "")
    assert [c["function"]["name"] for c in calls] == [c["function"]["name"] for c in msg["tool_calls"] or []]


def test_structured_outputs_start_after_the_final_channel_header(stack):
    """response_format with the harmony parser: the worker is told to constrain only the text
    after "<|channel|>final<|message|>" (an assistant message start opens reasoning again, so a
    multi-turn prompt does not count as already past reasoning)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(stack["folder"]))
    _reply(stack, f"<|channel|>analysis<|message|>{REASONING}<|end|>"
                  '<|start|>assistant<|channel|>final<|message|>{"city": "Paris"}')
    client = _client(stack)
    earlier = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    for i, messages in enumerate((MESSAGES, earlier + MESSAGES[1:])):
        rid = f"harmony-so-{i}"
        out = client.chat.completions.create(model="gpt-oss", messages=messages, max_tokens=200,
                                             extra_headers={"X-Request-Id": rid},
                                             response_format={"type": "json_object"})
        assert json.loads(out.choices[0].message.content) == {"city": "Paris"}
        assert out.choices[0].message.reasoning == REASONING
        got = json.loads((stack["records"] / f"chatcmpl-{rid}.json").read_text())["structured_outputs"]
        assert got["reasoning_end"] == tok.encode("<|channel|>final<|message|>", add_special_tokens=False)
        assert got["reasoning_start"] == tok.encode("<|start|>assistant", add_special_tokens=False)


def test_responses_and_messages_apis_read_the_channels(stack):
    """/v1/responses and /v1/messages generate through the same chat parsing: the analysis
    channel is their reasoning item / thinking block, the final channel the text, a
    functions.* call their function call / tool_use block."""
    gw = stack["gw"].url
    _reply(stack, ANSWERED)
    r = httpx.post(gw + "/v1/responses", timeout=60, json={"model": "gpt-oss", "input": "Weather in Paris?"})
    assert r.status_code == 200, r.text
    items = r.json()["output"]
    assert [i["type"] for i in items] == ["reasoning", "message"]
    assert items[0]["content"][0]["text"] == REASONING and items[1]["content"][0]["text"] == ANSWER
    _reply(stack, CALLED)
    r = httpx.post(gw + "/v1/messages", timeout=60, json={
        "model": "gpt-oss", "max_tokens": 200, "messages": [{"role": "user", "content": "Weather in Paris?"}],
        # GPT-OSS's template prints every tool's description (one without fails, as in transformers)
        "tools": [{"name": "get_weather", "description": "Weather of a city",
                   "input_schema": TOOLS[0]["function"]["parameters"]}]})
    assert r.status_code == 200, r.text
    blocks = r.json()["content"]
    assert [b["type"] for b in blocks] == ["thinking", "tool_use"]
    assert blocks[0]["thinking"] == REASONING
    assert blocks[1]["name"] == "get_weather" and blocks[1]["input"] == {"city": "Paris"}
    assert r.json()["stop_reason"] == "tool_use"


@pytest.mark.parametrize("tool_choice, final", [
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Paris"}'),
    ("required", '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'),
])
def test_forced_tool_choice_reads_the_final_channel(stack, tool_choice, final):
    """A named / required tool choice: the grammar shapes the final channel's text (it starts
    after the final header, as for any structured output of this parser) as vLLM's tool-call
    JSON, which becomes the call; the analysis channel stays reasoning."""
    _reply(stack, f"<|channel|>analysis<|message|>{REASONING}<|end|>"
                  f"<|start|>assistant<|channel|>final<|message|>{final}")
    client = _client(stack)
    kw = dict(model="gpt-oss", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, max_tokens=200)
    msg = client.chat.completions.create(**kw).choices[0].message
    assert msg.reasoning == REASONING
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    reasoning, content, calls, _ = stream_chat(client, **kw)
    assert reasoning == REASONING and content == ""
    assert calls[0].function.name == "get_weather"
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Paris"}
