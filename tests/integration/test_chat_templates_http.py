"""The real chat templates of the served families (tests/support/data/chat_templates, sources in
its README) through the gateway's HTTP routes: ``/v1/chat/completions/render`` gives the token
ids transformers' ``apply_chat_template(..., tokenize=True)`` gives for the conversation vLLM
0.33 hands it -- system + user, multi-turn, a final assistant turn without the generation
prompt, tools with a tool call and its result where the template renders tools, and the
template's own chat_template_kwargs -- and ``/v1/chat/completions`` answers through each of
them (the official openai client, a broker and a scripted worker behind the gateway).

One gateway per template, served in this process (tests/support/inprocess_gateway.py) on a
tokenizer-only model folder whose tokenizer carries the template's control tokens
(tests/support/chat_models.py)."""
from __future__ import annotations

import json
from contextlib import ExitStack

import httpx
import openai
import pytest

from tests.support import inprocess_gateway
from tests.support.chat_models import TEMPLATE_MODELS, Conversation, TemplateModel, vllm_view, write_model
from tests.support.procs import ProcGroup, wait_for_workers

transformers = pytest.importorskip("transformers")

REPLY = "Hello from the scripted worker."
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}]
# Mistral's template wants 9-character alphanumeric ids
CALL = {"id": "abcDEF123", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def conversations(spec: TemplateModel) -> list[Conversation]:
    out = [
        Conversation("system_user", [SYSTEM, {"role": "user", "content": "What's the weather like in Paris?"}]),
        Conversation("multi_turn", [SYSTEM, {"role": "user", "content": "Hello"},
                                    {"role": "assistant", "content": "Hello world!"},
                                    {"role": "user", "content": "The capital of France?"}]),
        Conversation("assistant_last", [{"role": "user", "content": "The capital of France?"},
                                        {"role": "assistant", "content": "The capital of France is Paris."}],
                     add_generation_prompt=False),
    ]
    if spec.tools:
        out.append(Conversation("tools", [
            SYSTEM, {"role": "user", "content": "What's the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "abcDEF123", "content": '{"temperature": 21}'}], tools=TOOLS))
        out.append(Conversation("tools_offered", [{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS))
    for i, kwargs in enumerate(spec.kwargs):
        out.append(Conversation(f"kwargs{i}", [SYSTEM, {"role": "user", "content": "Answer briefly: 6 x 7?"}],
                                chat_template_kwargs=kwargs))
    return out


CASES = [(spec, conv) for spec in TEMPLATE_MODELS for conv in conversations(spec)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("templates-stack")
    reply = root / "reply.json"
    reply.write_text(json.dumps({"text": REPLY, "chunk": 5}))
    with ProcGroup(root / "logs") as procs:
        broker = procs.broker()
        procs.fake_worker(broker, 0, "--has-tokenizer", "--reply-file", str(reply))
        wait_for_workers(broker.frontend, 1, timeout=60)
        yield broker


@pytest.fixture(scope="module")
def served(tmp_path_factory, stack):
    """template file -> (gateway, transformers' tokenizer over the same folder)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("template-models")
    out = {}
    with ExitStack() as stack_of_servers:
        for spec in TEMPLATE_MODELS:
            folder = write_model(spec, root / spec.template.removesuffix(".jinja"))
            gw = stack_of_servers.enter_context(inprocess_gateway.serve(
                tokenizer=str(folder), broker=stack.frontend, served_model_names=["tiny"], info_ttl_s=0.2))
            out[spec.template] = (gw, AutoTokenizer.from_pretrained(str(folder)))
        yield out


def _render(gw, conv: Conversation) -> httpx.Response:
    body = {"messages": conv.messages, "add_generation_prompt": conv.add_generation_prompt}
    if conv.tools is not None:
        # "none": these gateways run no tool parser; the template still gets the tools (vLLM
        # drops them only with --exclude-tools-when-tool-choice-none)
        body["tools"], body["tool_choice"] = conv.tools, "none"
    if conv.chat_template_kwargs:
        body["chat_template_kwargs"] = conv.chat_template_kwargs
    return httpx.post(gw.url + "/v1/chat/completions/render", json=body, timeout=60)


def _expected(hf, spec: TemplateModel, conv: Conversation) -> list[int]:
    return list(hf.apply_chat_template(vllm_view(conv.messages, spec.openai_content), tools=conv.tools,
                                       add_generation_prompt=conv.add_generation_prompt, tokenize=True,
                                       return_dict=False, **conv.chat_template_kwargs))


@pytest.mark.parametrize("spec, conv", CASES, ids=[f"{s.template.removesuffix('.jinja')}-{c.name}" for s, c in CASES])
def test_render_equals_transformers(served, spec, conv):
    gw, hf = served[spec.template]
    # GPT-OSS prints today's date: the reference is taken on both sides of the render, so a
    # run across midnight still compares against the same day's prompt.
    before = _expected(hf, spec, conv)
    r = _render(gw, conv)
    after = _expected(hf, spec, conv)
    assert r.status_code == 200, r.text
    ids = r.json()["token_ids"]
    want = before if ids == before else after
    assert ids == want, (hf.decode(ids), hf.decode(want))
    # the control tokens are single ids, as in the released tokenizer
    specials = {hf.convert_tokens_to_ids(t) for t in spec.special}
    assert specials & set(ids)


def test_every_registry_family_has_a_template_here():
    """The families of worker/engine/models' registry that release a chat template."""
    ids = " ".join(spec.hf_id for spec in TEMPLATE_MODELS)
    for family in ("Llama-3", "Mistral", "Qwen2.5", "Qwen3", "gpt-oss", "SmolLM3", "GLM-4", "DeepSeek-V3",
                   "granite", "Phi-3", "Phi-4", "phi-4", "gemma-3", "OLMo-2"):
        assert family in ids, family


@pytest.mark.parametrize("spec", TEMPLATE_MODELS, ids=[s.template.removesuffix(".jinja") for s in TEMPLATE_MODELS])
def test_chat_completions_through_each_template(served, spec):
    gw, hf = served[spec.template]
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    conv = conversations(spec)[0]
    out = client.chat.completions.create(model="tiny", messages=conv.messages, max_tokens=16)
    assert out.choices[0].message.content == REPLY
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.prompt_tokens == len(_expected(hf, spec, conv))
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="tiny", messages=conv.messages, max_tokens=16, stream=True) if c.choices)
    assert streamed == REPLY
