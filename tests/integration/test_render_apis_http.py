"""``/v1/responses/render`` and ``/v1/messages/render`` on a render-only gateway over the
tiny Qwen3 chat model (Qwen3's real template): the token ids equal transformers'
``apply_chat_template`` of the chat messages vLLM converts the request into
(instructions / system, multi-turn, tool calls and results, tools, reasoning), the
GenerateRequest's shape, vLLM's 400s, --api-key; and ``return_token_offsets`` on the
chat and completion render routes: each token's [start, end) into the text it was
tokenized from, as transformers' ``offset_mapping``."""
from __future__ import annotations

import httpx
import pytest

from tests.integration.test_openai_http import TOOLS, build_chat_model
from tests.support.gateway_helpers import start_gateway
from tests.support.procs import ProcGroup

KEY = "render-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PARAMS = TOOLS[0]["function"]["parameters"]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
                    "parameters": PARAMS}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather of a city", "input_schema": PARAMS}]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, qwen3_dir):
    return build_chat_model(qwen3_dir, tmp_path_factory.mktemp("qwen-chat") / "model")


@pytest.fixture(scope="module")
def gw(tmp_path_factory, chat_model):
    with ProcGroup(tmp_path_factory.mktemp("render-apis")) as procs:
        yield start_gateway(procs, "tcp://127.0.0.1:9", "--render-only", "--tokenizer", str(chat_model),
                            "--api-key", KEY, "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                            "--enable-auto-tool-choice", "--max-prompt-chars", "20000")


@pytest.fixture(scope="module")
def hf(chat_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(chat_model))


def _post(gw, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(gw.url + path, json=body, headers=AUTH, timeout=60, **kw)


def _want(hf, messages, tools=None, **kw) -> list[int]:
    generation = kw.pop("add_generation_prompt", True)
    return list(hf.apply_chat_template(messages, tools=tools, add_generation_prompt=generation, tokenize=True,
                                       return_dict=False, **kw))


# ---------------------------------------------------------------- /v1/responses/render
RESPONSES_CASES = [
    # a string input, with instructions -> system + user
    ({"instructions": "You are terse.", "input": "Say hi."},
     [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}], None),
    # multi-turn: easy messages, an assistant output message, input_text parts
    ({"input": [{"role": "user", "content": "Hi"},
                {"type": "message", "role": "assistant", "id": "m1", "status": "completed",
                 "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Again?"}]}]},
     [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
      {"role": "user", "content": "Again?"}], None),
    # tools, a function call and its output, instructions
    ({"instructions": "Use tools.", "tools": RESPONSES_TOOLS,
      "input": [{"role": "user", "content": "Weather in Paris?"},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]},
     [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": "", "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], TOOLS),
    # reasoning merged with the assistant message after it
    ({"input": [{"role": "user", "content": "2+2?"},
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "add them"}]},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]},
     [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": "add them"},
      {"role": "user", "content": "and 3+3?"}], None),
]


@pytest.mark.parametrize("body, messages, tools", RESPONSES_CASES)
def test_responses_render_equals_transformers(gw, hf, body, messages, tools):
    r = _post(gw, "/v1/responses/render", dict(body, max_output_tokens=9, temperature=0))
    assert r.status_code == 200, r.text
    gen = r.json()
    assert gen["token_ids"] == _want(hf, messages, tools)
    assert gen["request_id"].startswith("resp_")
    assert gen["sampling_params"]["max_tokens"] == 9 and gen["sampling_params"]["temperature"] == 0
    assert gen["reasoning_ended"] is None and gen["stream_options"] is None and gen["token_offsets"] is None
    assert gen["output_mode"] == "tokens" and gen["features"] is None
    # With tools and tool_choice auto the hermes parser must see its tags (vLLM's adjust_request).
    if tools:
        assert gen["sampling_params"]["skip_special_tokens"] is False


def test_responses_render_request_id_reasoning_effort_and_partial_message(gw, hf):
    r = _post(gw, "/v1/responses/render", {"input": "hi", "request_id": "resp_mine", "reasoning": {"effort": "none"}})
    gen = r.json()
    assert gen["request_id"] == "resp_mine"
    assert gen["token_ids"] == _want(hf, [{"role": "user", "content": "hi"}], enable_thinking=False)
    # The last item an incomplete assistant message: continued, no new turn.
    items = [{"role": "user", "content": "Count"},
             {"type": "message", "role": "assistant", "status": "incomplete",
              "content": [{"type": "output_text", "text": "1, 2,"}]}]
    r = _post(gw, "/v1/responses/render", {"input": items})
    assert r.status_code == 200, r.text
    want = _want(hf, [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}],
                 add_generation_prompt=False, continue_final_message=True)
    assert r.json()["token_ids"] == want


@pytest.mark.parametrize("body, param, needle", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id", "stateless render endpoint"),
    ({"input": [{"type": "web_search_call", "id": "w"}]}, "input", "Unsupported input item type: web_search_call"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]}, "input", "Encrypted content"),
    ({"input": "hi", "prompt": {"id": "p"}}, "prompt", "prompt template is not supported"),
    ({"input": "hi", "model": "nope"}, "model", "does not exist"),
    ({"instructions": "x"}, None, "input"),
    ({"input": "x" * 30000}, None, "20000"),
])
def test_responses_render_errors(gw, body, param, needle):
    r = _post(gw, "/v1/responses/render", body)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == r.status_code, err
    if param is not None:
        assert err["param"] == param
    # vLLM 0.33's render_responses_request: "invalid_request_error" for previous_response_id,
    # its request validators' "BadRequestError" for the rest.
    if param == "previous_response_id":
        assert err["type"] == "invalid_request_error", err
    elif r.status_code == 400:
        assert err["type"] == "BadRequestError", err


# ---------------------------------------------------------------- /v1/messages/render
MESSAGES_CASES = [
    # system as text blocks (the billing header dropped), multi-turn
    ({"system": [{"type": "text", "text": "x-anthropic-billing-header: h=1"}, {"type": "text", "text": "Be brief."}],
      "messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": [{"type": "text", "text": "Hey"}]},
                   {"role": "user", "content": [{"type": "text", "text": "Bye"}]}]},
     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hey"}, {"role": "user", "content": "Bye"}], None),
    # tools, tool_use and tool_result blocks, thinking
    ({"system": "Use tools.", "tools": ANTHROPIC_TOOLS,
      "messages": [{"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": [
                       {"type": "thinking", "thinking": "call it", "signature": "s"},
                       {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Paris"}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1",
                                                 "content": [{"type": "text", "text": "sunny"}]}]}]},
     [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": "", "reasoning_content": "call it", "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], TOOLS),
    # an inline system message: Qwen's template wants the system first, so it is merged
    ({"system": "A.", "messages": [{"role": "user", "content": "Hi"}, {"role": "system", "content": "B."},
                                   {"role": "user", "content": "Go"}]},
     [{"role": "system", "content": "A.B."}, {"role": "user", "content": "Hi"}, {"role": "user", "content": "Go"}],
     None),
]


@pytest.mark.parametrize("body, messages, tools", MESSAGES_CASES)
def test_messages_render_equals_transformers(gw, hf, body, messages, tools):
    r = _post(gw, "/v1/messages/render", dict(body, model="", max_tokens=11, stop_sequences=["x"]))
    assert r.status_code == 200, r.text
    gen = r.json()
    assert gen["token_ids"] == _want(hf, messages, tools)
    assert gen["request_id"].startswith("chatcmpl-")
    sp = gen["sampling_params"]
    assert sp["max_tokens"] == 11 and sp["stop"] == ["x"]
    if tools:
        assert sp["skip_special_tokens"] is False  # tool_choice auto: the hermes parser's tags kept


def test_messages_render_stream_and_thinking_disabled(gw, hf):
    r = httpx.post(gw.url + "/v1/messages/render", timeout=60, headers={**AUTH, "X-Request-Id": "abc"},
                   json={"model": "", "max_tokens": 5, "stream": True, "thinking": {"type": "disabled"},
                         "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    gen = r.json()
    assert gen["request_id"] == "chatcmpl-abc" and gen["stream"] is True
    assert gen["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    # Qwen3 honours enable_thinking=False: thinking disabled maps to reasoning_effort "none".
    assert gen["token_ids"] == _want(hf, [{"role": "user", "content": "Hi"}], enable_thinking=False)


@pytest.mark.parametrize("body, needle", [
    ({"messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "robot", "content": "Hi"}]}, "role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, "type"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], "tools": ANTHROPIC_TOOLS,
      "tool_choice": {"type": "tool"}}, "tool_choice.name is required"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], "thinking": {"type": "enabled",
                                                                                     "budget_tokens": 10}},
     "budget_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x" * 30000}]}, "20000"),
])
def test_messages_render_errors(gw, body, needle):
    r = _post(gw, "/v1/messages/render", dict(body, model=""))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == 400, err


def test_new_routes_need_the_api_key(gw):
    for path, body in (("/v1/responses/render", {"input": "hi"}),
                       ("/v1/messages/render", {"model": "", "max_tokens": 1, "messages": []})):
        assert httpx.post(gw.url + path, json=body).status_code == 401


# ---------------------------------------------------------------- return_token_offsets
def _check_offsets(gen: dict, text: str, hf, add_special_tokens: bool) -> None:
    offsets = gen["token_offsets"]
    want = hf(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    assert gen["token_ids"] == want["input_ids"]
    assert [tuple(o) for o in offsets] == [tuple(o) for o in want["offset_mapping"]]
    assert len(offsets) == len(gen["token_ids"])
    # Each token's span is its text (the byte tokens of one character share its span), and
    # the spans tile the text.
    spans = []
    for tid, (start, end) in zip(gen["token_ids"], offsets):
        piece = hf.decode([tid])
        assert piece == text[start:end] or "\ufffd" in piece
        if not spans or spans[-1] != (start, end):
            spans.append((start, end))
    assert "".join(text[s:e] for s, e in spans) == text
    assert any(hf.decode([t]) == "<|im_start|>" and text[s:e] == "<|im_start|>"
               for t, (s, e) in zip(gen["token_ids"], offsets)) == ("<|im_start|>" in text)


def test_chat_render_token_offsets_index_the_templated_prompt(gw, hf):
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "héllo wörld ✓"}]
    r = _post(gw, "/v1/chat/completions/render", {"messages": messages, "return_token_offsets": True})
    assert r.status_code == 200, r.text
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    _check_offsets(r.json(), text, hf, add_special_tokens=False)
    assert _post(gw, "/v1/chat/completions/render", {"messages": messages}).json()["token_offsets"] is None
    # Truncation cuts the offsets with the ids.
    r = _post(gw, "/v1/chat/completions/render", {"messages": messages, "return_token_offsets": True,
                                                  "truncate_prompt_tokens": 5})
    gen = r.json()
    full = hf(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    assert gen["token_ids"] == hf(text, add_special_tokens=False)["input_ids"][-5:]
    assert [tuple(o) for o in gen["token_offsets"]] == [tuple(o) for o in full[-5:]]


def test_completion_render_token_offsets(gw, hf):
    r = _post(gw, "/v1/completions/render",
              {"prompt": ["héllo <|im_start|>wörld", "two"], "return_token_offsets": True})
    assert r.status_code == 200, r.text
    first, second = r.json()
    _check_offsets(first, "héllo <|im_start|>wörld", hf, add_special_tokens=True)
    _check_offsets(second, "two", hf, add_special_tokens=True)
    # A token prompt has no text: no offsets (vLLM's too).
    r = _post(gw, "/v1/completions/render", {"prompt": [5, 6, 7], "return_token_offsets": True})
    assert r.json()[0]["token_offsets"] is None
