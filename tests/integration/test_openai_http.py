"""The OpenAI facade, render, derender and tokenize routes through the real stack:
a broker, a worker on a tiny Qwen3 checkpoint whose tokenizer carries Qwen's chat
tokens and real chat template, and gateways with and without the qwen3 reasoning /
hermes tool-call parsers.  The official ``openai`` client talks to the facade."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.gateway_helpers import GENERATE, sse_payloads, start_gateway
from tests.support.procs import ProcGroup, wait_for_workers
from worker.engine.loading.demo_model import build_byte_tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "support" / "data" / "chat_templates"
SPECIAL = ("<|endoftext|>", "<|im_end|>", "<|im_start|>")
PLAIN_ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>")  # not special in Qwen's tokenizer
WORKER_ARGS = ("--max-num-seqs", "8", "--num-kv-blocks", "256", "--threads", "1", "--max-model-len", "1024")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def build_chat_model(src: Path, out: Path) -> Path:
    """The tiny qwen3 checkpoint with Qwen's chat tokens in the vocabulary and Qwen3's template."""
    from tokenizers import AddedToken

    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    reserved = tuple(f"<|reserved_{i}|>" for i in range(vocab - 256 - len(SPECIAL) - len(PLAIN_ADDED)))
    tok = build_byte_tokenizer(SPECIAL)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in reserved])
    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "special": t in SPECIAL or t in reserved, "lstrip": False,
                                       "rstrip": False, "normalized": False, "single_word": False}
             for t in SPECIAL + PLAIN_ADDED + reserved}
    cfg = {"tokenizer_class": "Qwen2TokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
           "bos_token": None, "model_max_length": 512, "added_tokens_decoder": added,
           "chat_template": (TEMPLATES / "qwen3-0.6b.jinja").read_text()}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    config = json.loads((out / "config.json").read_text())
    config["eos_token_id"] = tok.token_to_id("<|im_end|>")
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, qwen3_dir) -> Path:
    return build_chat_model(qwen3_dir, tmp_path_factory.mktemp("qwen-chat") / "model")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, chat_model):
    with ProcGroup(tmp_path_factory.mktemp("openai-stack")) as procs:
        broker = procs.broker()
        procs.worker(broker, 0, "--model", str(chat_model), *WORKER_ARGS)
        wait_for_workers(broker.frontend, 1, timeout=120)
        parsed = start_gateway(procs, broker.frontend, "--tokenizer", str(chat_model), "--reasoning-parser", "qwen3",
                               "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                               "--enable-tokenizer-info-endpoint", "--trust-request-chat-template")
        plain = start_gateway(procs, broker.frontend, "--tokenizer", str(chat_model),
                              "--enable-prompt-tokens-details")
        yield procs, broker, parsed, plain


@pytest.fixture(scope="module")
def hf_tokenizer(chat_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(chat_model))


def _client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)


PRINTABLE = {"allowed_token_ids": list(range(32, 127))}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]


# ---------------------------------------------------------------- tokenize / render
def test_tokenize_detokenize_and_tokenizer_info(stack, hf_tokenizer):
    _, _, parsed, _ = stack
    r = httpx.post(parsed.url + "/tokenize", json={"prompt": "héllo world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    want = hf_tokenizer("héllo world")["input_ids"]
    assert body["tokens"] == want and body["count"] == len(want) and body["max_model_len"] == 1024
    assert body["token_strs"] == hf_tokenizer.convert_ids_to_tokens(want)
    r = httpx.post(parsed.url + "/tokenize", json={"messages": MESSAGES})
    want = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r.json()["tokens"] == list(want)
    r = httpx.post(parsed.url + "/detokenize", json={"tokens": want})
    assert r.json() == {"prompt": hf_tokenizer.decode(want)}
    info = httpx.get(parsed.url + "/tokenizer_info").json()
    assert info["tokenizer_class"] == "Qwen2TokenizerFast" and "<|im_start|>" in info["chat_template"]
    assert httpx.get(stack[3].url + "/tokenizer_info").status_code == 404  # off without the flag


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_render_equals_transformers(stack, hf_tokenizer, thinking):
    _, _, parsed, _ = stack
    req = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 7, "temperature": 0,
           "chat_template_kwargs": {"enable_thinking": thinking}}
    r = httpx.post(parsed.url + "/v1/chat/completions/render", json=req)
    assert r.status_code == 200, r.text
    gen = r.json()
    want = hf_tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False,
                                            enable_thinking=thinking)
    assert gen["token_ids"] == list(want)
    assert gen["request_id"].startswith("chatcmpl-")
    sp = gen["sampling_params"]
    assert sp["max_tokens"] == 7 and sp["temperature"] == 0 and sp["output_kind"] == 2
    assert sp["skip_special_tokens"] is False  # the hermes parser must see its tags
    assert gen["reasoning_parser_kwargs"] == {"chat_template_kwargs": {"enable_thinking": thinking}}
    # Thinking off: the template closed the think block in the prompt.
    assert gen["reasoning_ended"] is (not thinking)


def test_completion_render_equals_encode(stack, hf_tokenizer):
    _, _, parsed, _ = stack
    r = httpx.post(parsed.url + "/v1/completions/render",
                   json={"prompt": ["one", "two three"], "max_tokens": 5, "stop": "x"})
    assert r.status_code == 200, r.text
    gens = r.json()
    assert [g["token_ids"] for g in gens] == [hf_tokenizer("one")["input_ids"], hf_tokenizer("two three")["input_ids"]]
    assert gens[0]["request_id"].endswith("-0") and gens[1]["request_id"].endswith("-1")
    assert gens[0]["sampling_params"]["stop"] == ["x"] and gens[0]["sampling_params"]["max_tokens"] == 5
    r = httpx.post(parsed.url + "/v1/completions/render", json={"prompt": [5, 6, 7]})
    assert r.json()[0]["token_ids"] == [5, 6, 7]


# ---------------------------------------------------------------- the facade
def test_openai_client_chat_stream_equals_non_stream(stack):
    _, _, _, plain = stack
    client = _client(plain)
    kw = dict(model=client.models.list().data[0].id, messages=MESSAGES, temperature=0, max_completion_tokens=12,
              seed=1)
    full = client.chat.completions.create(**kw)
    choice = full.choices[0]
    assert full.object == "chat.completion" and choice.message.role == "assistant"
    assert full.usage.completion_tokens == 12 and choice.finish_reason == "length"
    pieces, usage = [], None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
    assert "".join(pieces) == choice.message.content
    assert usage.completion_tokens == 12 and usage.prompt_tokens == full.usage.prompt_tokens


def test_openai_client_chat_n_logprobs_stop(stack):
    _, _, _, plain = stack
    client = _client(plain)
    model = client.models.list().data[0].id
    # Printable bytes only: logprob token strings show special tokens the text skips (as vLLM's do).
    r = client.chat.completions.create(model=model, messages=MESSAGES, n=2, temperature=1.0, seed=3,
                                       max_tokens=6, logprobs=True, top_logprobs=2, extra_body=PRINTABLE)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert len(c.logprobs.content) == 6 and all(len(e.top_logprobs) == 2 for e in c.logprobs.content)
        assert "".join(e.token for e in c.logprobs.content) == c.message.content
    greedy = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=12,
                                            extra_body=PRINTABLE)
    text = greedy.choices[0].message.content
    stop = text[3:5]
    cut = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=12, stop=[stop],
                                         extra_body=PRINTABLE)
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == text[:text.index(stop)]


def test_openai_client_completions(stack, hf_tokenizer):
    _, _, _, plain = stack
    client = _client(plain)
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt=["Hello", "Bye"], max_tokens=5, temperature=0, logprobs=1,
                                  extra_body=PRINTABLE)
    assert [c.index for c in r.choices] == [0, 1] and r.object == "text_completion"
    assert r.usage.completion_tokens == 10
    for c in r.choices:
        assert len(c.logprobs.tokens) == 5 and "".join(c.logprobs.tokens) == c.text
        assert all(1 <= len(t) <= 2 for t in c.logprobs.top_logprobs)
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(model=model, prompt=["Hello", "Bye"], max_tokens=5, temperature=0,
                                           stream=True, extra_body=PRINTABLE):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == {0: r.choices[0].text, 1: r.choices[1].text}
    echo = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0, echo=True,
                                     extra_body=PRINTABLE)
    assert echo.choices[0].text == "Hello" + r.choices[0].text[:len(echo.choices[0].text) - 5]


def test_stream_lines_survive_unicode_line_separators(stack):
    """A streamed text holding U+2028, U+2029 or U+0085 stays one ``data:`` line per event
    for a reader that splits decoded text with ``str.splitlines`` (requests'
    ``iter_lines(decode_unicode=True)``, hand-written clients): they reach the client
    JSON-escaped, and the decoded text is unchanged (the openai SDK reads the same text)."""
    _, _, _, plain = stack
    model = _client(plain).models.list().data[0].id
    prompt = "a\u2028b\u2029c\u0085d"
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True, "stream": True,
            **PRINTABLE}
    r = httpx.post(plain.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    lines = [line for line in r.text.splitlines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines), lines
    text = "".join(c["text"] for line in lines[:-1] for c in json.loads(line[len("data: "):])["choices"])
    assert text.startswith(prompt)
    sdk = "".join(c.text for chunk in _client(plain).completions.create(
        model=model, prompt=prompt, max_tokens=2, temperature=0, echo=True, stream=True, extra_body=PRINTABLE)
        for c in chunk.choices)
    assert sdk == text


# ---------------------------------------------------------------- derender == facade
def _generate(gw, gen: dict) -> dict:
    r = httpx.post(gw.url + GENERATE, json=gen, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_derender_of_generate_equals_facade(stack):
    _, _, parsed, _ = stack
    chat = {"messages": MESSAGES, "temperature": 0, "max_tokens": 16, "model": None}
    gen = httpx.post(parsed.url + "/v1/chat/completions/render", json=chat).json()
    out = _generate(parsed, gen)
    body = {"generate_response": out, "prompt_token_ids": gen["token_ids"], "prompt_tokens": len(gen["token_ids"]),
            "chat_request": chat}
    r = httpx.post(parsed.url + "/v1/chat/completions/derender", json=body)
    assert r.status_code == 200, r.text
    derendered = r.json()
    facade = httpx.post(parsed.url + "/v1/chat/completions", json=chat, timeout=120).json()
    for key in ("content", "reasoning", "tool_calls"):
        assert derendered["choices"][0]["message"][key] == facade["choices"][0]["message"][key], key
    assert derendered["usage"] == facade["usage"]
    assert derendered["choices"][0]["finish_reason"] == facade["choices"][0]["finish_reason"]

    # Stream derender, chunk by chunk with the carried state, concatenates to the same message.
    stream_gen = dict(gen, stream=True)
    r = httpx.post(parsed.url + GENERATE, json=stream_gen, timeout=120)
    state, parts = None, {"content": "", "reasoning": ""}
    for payload in sse_payloads(r)[:-1]:
        d = httpx.post(parsed.url + "/v1/chat/completions/derender", json={
            "stream": True, "generate_chunk": json.loads(payload), "stream_state": state,
            "prompt_token_ids": gen["token_ids"], "chat_request": chat}).json()
        state = d["stream_state"]
        for c in d["chunk"]["choices"]:
            for key in parts:
                parts[key] += c["delta"].get(key) or ""
    assert parts["content"] == (facade["choices"][0]["message"]["content"] or "")
    assert parts["reasoning"] == (facade["choices"][0]["message"]["reasoning"] or "")


def _chunk(request_id: str, ids: list[int], finish=None) -> dict:
    return {"request_id": request_id, "output_mode": "tokens",
            "choices": [{"index": 0, "token_ids": ids, "finish_reason": finish, "stop_reason": None}]}


def test_derender_parses_reasoning_and_tool_calls_split_over_tokens(stack, hf_tokenizer):
    _, _, parsed, _ = stack
    chat = {"messages": MESSAGES, "tools": TOOLS}
    prompt = httpx.post(parsed.url + "/v1/chat/completions/render", json=chat).json()["token_ids"]
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = "<think>\nI should check.\n</think>\n\nLet me look.\n<tool_call>\n" + call + "\n</tool_call>"
    ids = hf_tokenizer.encode(text, add_special_tokens=False) + [hf_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    full = {"request_id": "r1", "output_mode": "tokens",
            "choices": [{"index": 0, "token_ids": ids, "finish_reason": "stop", "stop_reason": None}]}
    r = httpx.post(parsed.url + "/v1/chat/completions/derender",
                   json={"generate_response": full, "prompt_token_ids": prompt, "chat_request": chat})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    msg = choice["message"]
    assert msg["reasoning"].strip() == "I should check."
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert msg["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
    assert choice["finish_reason"] == "tool_calls"
    # One token per chunk: every tag arrives split over several chunks (bytes).
    state, reasoning, content, calls, last = None, "", "", [], None
    for j, tid in enumerate(ids):
        finish = "stop" if j == len(ids) - 1 else None
        r = httpx.post(parsed.url + "/v1/chat/completions/derender", json={
            "stream": True, "generate_chunk": _chunk("r1", [tid], finish), "stream_state": state,
            "prompt_token_ids": prompt, "chat_request": chat})
        assert r.status_code == 200, r.text
        d = r.json()
        state = d["stream_state"]
        delta = d["chunk"]["choices"][0]["delta"]
        reasoning += delta.get("reasoning") or ""
        content += delta.get("content") or ""
        calls += delta.get("tool_calls") or []
        last = d["chunk"]["choices"][0]["finish_reason"]
        assert "<" not in (delta.get("content") or "") + (delta.get("reasoning") or "")
    assert reasoning == msg["reasoning"] and content.strip() == (msg["content"] or "").strip()
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and last == "tool_calls"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}


def test_completion_derender_stream_and_non_stream(stack, hf_tokenizer):
    _, _, _, plain = stack
    ids = hf_tokenizer.encode("naïve café", add_special_tokens=False)  # multi-byte characters split over tokens
    full = {"request_id": "c1", "output_mode": "tokens",
            "choices": [{"index": 0, "token_ids": ids, "finish_reason": "length", "stop_reason": None}]}
    r = httpx.post(plain.url + "/v1/completions/derender", json={"generate_responses": [full], "prompt_tokens": [3]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "naïve café" and r.json()["usage"]["prompt_tokens"] == 3
    state, text = None, ""
    for tid in ids:
        d = httpx.post(plain.url + "/v1/completions/derender", json={
            "stream": True, "generate_chunk": _chunk("c1", [tid]), "stream_state": state}).json()
        state = d["stream_state"]
        text += d["chunk"]["choices"][0]["text"]
        assert len(state["prev_tokens"]) <= 8  # bounded window, not the history
    assert text == "naïve café"


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize("body, status, needle", [
    ({}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ({"messages": MESSAGES, "chat_template": "{{ raise_exception('no way') }}"}, 400, "no way"),
    ({"messages": [{"role": "user", "content": "x" * 1100}]}, 400, "maximum context length"),
    ({"messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "function"),
    ({"messages": MESSAGES, "tools": []}, 400, "`tools` must not be an empty array"),
    ({"messages": MESSAGES, "tool_choice": "auto"}, 400, "`tools` must be set"),
    ({"messages": MESSAGES, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ({"messages": MESSAGES, "response_format": {"type": "structural_tag", "format": {"type": "x"}}}, 400,
     "Invalid response_format structural_tag specification."),
    ({"messages": MESSAGES, "model": "nope"}, 404, "does not exist"),
    ({"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message"),
    ({"messages": MESSAGES, "top_logprobs": 3}, 400, "logprobs"),
])
def test_bad_chat_requests_get_vllm_errors(stack, body, status, needle):
    _, _, parsed, _ = stack
    for path in ("/v1/chat/completions", "/v1/chat/completions/render"):
        r = httpx.post(parsed.url + path, json=body, timeout=60)
        assert r.status_code == status, (path, r.text)
        err = r.json()["error"]
        assert needle in err["message"] and err["code"] == status, (path, err)


def test_untrusted_request_template_and_auto_tools_without_parser_are_refused(stack):
    _, _, _, plain = stack
    r = httpx.post(plain.url + "/v1/chat/completions", json={"messages": MESSAGES, "chat_template": "{{ 1 }}"})
    assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"]
    r = httpx.post(plain.url + "/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS})
    assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]


def test_render_only_gateway_needs_no_broker(tmp_path_factory, chat_model, hf_tokenizer):
    with ProcGroup(tmp_path_factory.mktemp("render-only")) as procs:
        gw = start_gateway(procs, "tcp://127.0.0.1:9", "--render-only", "--tokenizer", str(chat_model))
        r = httpx.post(gw.url + "/v1/chat/completions/render", json={"messages": MESSAGES})
        assert r.status_code == 200, r.text
        assert r.json()["token_ids"] == list(hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                                               tokenize=True, return_dict=False))
        assert httpx.post(gw.url + "/tokenize", json={"prompt": "hi"}).json()["max_model_len"] == 1024
        assert httpx.post(gw.url + "/v1/chat/completions", json={"messages": MESSAGES}).status_code == 404
        assert httpx.post(gw.url + GENERATE, json={"token_ids": [1], "sampling_params": {}}).status_code == 404
        assert httpx.get(gw.url + "/kv_event_sources").json() == {}  # vLLM: empty on render-only servers


def test_facade_reasoning_stream_equals_non_stream(stack):
    """Qwen3 with thinking on starts inside reasoning: with no </think> in the output the
    qwen3 parser puts everything in `reasoning`; with thinking off it is all content."""
    _, _, parsed, _ = stack
    client = _client(parsed)
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=MESSAGES, temperature=0, max_tokens=10, extra_body=PRINTABLE)
    full = client.chat.completions.create(**kw).choices[0].message
    assert full.reasoning and full.content is None
    streamed = ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed += getattr(c.delta, "reasoning", None) or ""
            assert not c.delta.content
    assert streamed == full.reasoning
    off = dict(kw, extra_body=dict(PRINTABLE, chat_template_kwargs={"enable_thinking": False}))
    plain = client.chat.completions.create(**off).choices[0].message
    assert plain.content and getattr(plain, "reasoning", None) is None


@pytest.mark.parametrize("path, body, needle", [
    ("/v1/chat/completions/derender", {"generate_response": {"request_id": "x", "output_mode": "text", "choices": []},
                                       "chat_request": {"messages": MESSAGES}}, "output_mode"),
    ("/v1/chat/completions/derender", {"generate_response": _chunk("x", [65])}, "chat_request is required"),
    ("/v1/chat/completions/derender", {"stream": True, "generate_chunk": _chunk("x", [65]),
                                       "chat_request": {"messages": MESSAGES}}, "prompt_token_ids is required"),
    ("/v1/chat/completions/derender", {"generate_response": _chunk("x", [65] * 1100),
                                       "chat_request": {"messages": MESSAGES}}, "exceeds max_model_len"),
    ("/v1/chat/completions/derender", {"generate_response": _chunk("x", []), "chat_request": {"messages": MESSAGES}},
     "empty or null token_ids"),
    ("/v1/completions/derender", {"generate_responses": []}, "must not be empty"),
    ("/v1/completions/derender", {"generate_responses": [_chunk("x", [65])], "prompt_tokens": [1, 2]},
     "must equal generate_responses length"),
    ("/v1/completions/derender", {"stream": True, "generate_chunk": _chunk("x", [65]),
                                  "stream_state": {"prev_tokens": ["not-a-piece"], "read_offset": 1,
                                                   "role_sent": True}}, "invalid stream_state"),
])
def test_bad_derender_requests(stack, path, body, needle):
    _, _, parsed, _ = stack
    r = httpx.post(parsed.url + path, json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def _with(chunk: dict, **fields) -> dict:
    return {**chunk, **fields}


def _logprob_chunk(token_id: int, top_id: int = 66) -> dict:
    chunk = _chunk("x", [65])
    chunk["choices"][0]["logprobs"] = {"content": [{"token_id": token_id, "logprob": -0.5,
                                                    "top_logprobs": [{"token_id": top_id, "logprob": -1.0}]}]}
    return chunk


CHAT = {"messages": MESSAGES}


@pytest.mark.parametrize("path, body, param", [
    # vLLM's GenerateChoiceBase validator and NonNegativeInt: a 400 naming where, not a 500
    ("/v1/chat/completions/derender", {"generate_response": _chunk("x", [65, -1]), "chat_request": CHAT},
     "body.generate_response.choices.0.token_ids"),
    ("/v1/chat/completions/derender", {"generate_response": _chunk("x", [65, 2**40]), "chat_request": CHAT},
     "body.generate_response.choices.0.token_ids"),
    ("/v1/chat/completions/derender", {"generate_response": _with(_chunk("x", [65]), prompt_token_ids=[1, -3]),
                                       "chat_request": CHAT}, "body.generate_response.prompt_token_ids.1"),
    ("/v1/chat/completions/derender", {"generate_response": _chunk("x", [65]), "prompt_token_ids": [-1],
                                       "chat_request": CHAT}, "prompt_token_ids"),
    ("/v1/chat/completions/derender", {"generate_response": _logprob_chunk(-5), "chat_request": CHAT}, "logprobs"),
    ("/v1/chat/completions/derender", {"generate_response": _logprob_chunk(65, -7), "chat_request": CHAT},
     "logprobs"),
    ("/v1/chat/completions/derender", {"stream": True, "generate_chunk": _chunk("x", [-2]), "prompt_token_ids": [1],
                                       "chat_request": CHAT}, "body.generate_chunk.choices.0.token_ids"),
    ("/v1/chat/completions/derender", {"stream": True, "generate_chunk": _chunk("x", [65]), "prompt_token_ids": [1],
                                       "chat_request": CHAT, "stream_state": {"output_token_ids": [-1],
                                                                              "output_chunk_lens": [1]}},
     "body.stream_state.output_token_ids.0"),
    ("/v1/completions/derender", {"generate_responses": [_chunk("x", [65]), _chunk("y", [-1])]},
     "body.generate_responses.1.choices.0.token_ids"),
    ("/v1/completions/derender", {"generate_responses": [_chunk("x", [65])], "prompt_token_ids": [[-4]]},
     "prompt_token_ids"),
    ("/v1/completions/derender", {"stream": True, "generate_chunk": _chunk("x", [-1])},
     "body.generate_chunk.choices.0.token_ids"),
    ("/v1/completions/derender", {"stream": True, "generate_chunk": _chunk("x", [65]),
                                  "stream_state": {"logprob_context_token_ids": [-9]}},
     "body.stream_state.logprob_context_token_ids.0"),
    ("/v1/completions/derender", {"generate_responses": [_logprob_chunk(-5)]}, "logprobs"),
])
def test_derender_refuses_ids_no_tokenizer_has(stack, path, body, param):
    _, _, parsed, _ = stack
    r = httpx.post(parsed.url + path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "BadRequestError" and err["code"] == 400, err


@pytest.mark.parametrize("parallel, want", [(True, ["get_weather", "get_weather"]), (False, ["get_weather"])])
def test_derender_parallel_tool_calls(stack, hf_tokenizer, parallel, want):
    _, _, parsed, _ = stack
    chat = {"messages": MESSAGES, "tools": TOOLS, "parallel_tool_calls": parallel,
            "chat_template_kwargs": {"enable_thinking": False}}
    prompt = httpx.post(parsed.url + "/v1/chat/completions/render", json=chat).json()["token_ids"]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
    ids = hf_tokenizer.encode(call % "Oslo" + "\n" + call % "Rome", add_special_tokens=False)
    full = {"request_id": "p", "output_mode": "tokens",
            "choices": [{"index": 0, "token_ids": ids, "finish_reason": "stop", "stop_reason": None}]}
    r = httpx.post(parsed.url + "/v1/chat/completions/derender",
                   json={"generate_response": full, "prompt_token_ids": prompt, "chat_request": chat})
    msg = r.json()["choices"][0]["message"]
    assert [c["function"]["name"] for c in msg["tool_calls"]] == want and msg["reasoning"] is None
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert len({c["id"] for c in msg["tool_calls"]}) == len(want)


def test_facade_returns_prompt_logprobs(stack):
    """Non-stream chat and completions carry vLLM's prompt_logprobs ([null, {id: {logprob, rank,
    decoded_token}}, ...]) when asked for, one entry per prompt token."""
    _, _, _, plain = stack
    chat = httpx.post(plain.url + "/v1/chat/completions", timeout=60,
                      json={"messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 1}).json()
    plp = chat["prompt_logprobs"]
    assert plp[0] is None and len(plp) == chat["usage"]["prompt_tokens"]
    assert all(1 <= len(entry) <= 2 and all("logprob" in v for v in entry.values()) for entry in plp[1:])
    comp = httpx.post(plain.url + "/v1/completions", timeout=60,
                      json={"prompt": "Hello there", "max_tokens": 2, "prompt_logprobs": 0}).json()
    cplp = comp["choices"][0]["prompt_logprobs"]
    assert cplp[0] is None and len(cplp) == comp["usage"]["prompt_tokens"] and all(len(e) == 1 for e in cplp[1:])
    assert httpx.post(plain.url + "/v1/completions", timeout=60,
                      json={"prompt": "Hi", "max_tokens": 2}).json()["choices"][0]["prompt_logprobs"] is None


# ---------------------------------------------------------------- generate output_mode "derender" (vLLM 0.33)
DERENDER_CHAT = {"messages": MESSAGES, "tools": TOOLS, "temperature": 0, "max_tokens": 12, "logprobs": True,
                 "top_logprobs": 2, "allowed_token_ids": PRINTABLE["allowed_token_ids"]}


def test_chat_render_returns_parse_context(stack):
    _, _, parsed, _ = stack
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call-2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call-2", "content": "rain"}]
    chat = {"messages": history, "tools": TOOLS, "parallel_tool_calls": False,
            "chat_template_kwargs": {"enable_thinking": False}}
    r = httpx.post(parsed.url + "/v1/chat/completions/render", json=chat)
    assert r.status_code == 200, r.text
    gen = r.json()
    keys = list(gen)
    assert keys.index("output_mode") + 1 == keys.index("parse_context")  # vLLM's field order
    assert gen["parse_context"] == {
        "tools": [{"type": "function", "function": TOOLS[0]["function"]}], "tool_choice": "auto",
        "parallel_tool_calls": False, "include_reasoning": True,
        "chat_template_kwargs": {"enable_thinking": False}, "history_tool_call_cnt": 2}
    plain = httpx.post(parsed.url + "/v1/chat/completions/render", json={"messages": MESSAGES}).json()
    assert plain["parse_context"] == {"tools": None, "tool_choice": "none", "parallel_tool_calls": True,
                                      "include_reasoning": True, "chat_template_kwargs": {},
                                      "history_tool_call_cnt": 0}
    completion = httpx.post(parsed.url + "/v1/completions/render", json={"prompt": "hi"}).json()
    assert completion[0]["parse_context"] is None


@pytest.mark.parametrize("thinking", [True, False])
def test_generate_derender_equals_chat_completions(stack, thinking):
    """The rendered request sent back with output_mode "derender": the choices carry the
    assistant message /v1/chat/completions answers (content, reasoning, tool_calls), chat
    logprobs and its finish_reason; token_ids stay."""
    _, _, parsed, _ = stack
    chat = dict(DERENDER_CHAT, chat_template_kwargs={"enable_thinking": thinking})
    gen = httpx.post(parsed.url + "/v1/chat/completions/render", json=chat).json()
    out = _generate(parsed, dict(gen, output_mode="derender"))
    facade = httpx.post(parsed.url + "/v1/chat/completions", json=chat, timeout=120).json()
    assert out["output_mode"] == "derender" and out["request_id"] == "generate-tokens-" + gen["request_id"]
    choice, want = out["choices"][0], facade["choices"][0]
    assert list(choice) == ["index", "finish_reason", "stop_reason", "token_ids", "routed_experts", "sampling_mask",
                            "weight_versions", "message", "logprobs"]
    for key in ("role", "content", "reasoning", "tool_calls"):
        assert choice["message"].get(key) == want["message"].get(key), key
    assert bool(choice["message"]["reasoning"]) is thinking
    assert choice["logprobs"] == want["logprobs"]
    entry = choice["logprobs"]["content"][0]
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and len(entry["top_logprobs"]) == 2
    assert choice["finish_reason"] == want["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 12
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert out["usage"][key] == facade["usage"][key], key
    # Tokens mode ignores parse_context; text mode's text is what the message was parsed from.
    text = _generate(parsed, dict(gen, output_mode="text"))["choices"][0]
    assert text["token_ids"] == choice["token_ids"] and "message" not in text
    assert (choice["message"]["reasoning"] or "") + (choice["message"]["content"] or "") in text["text"]


def test_generate_derender_hides_metadata_with_reasoning_hidden(stack):
    _, _, parsed, _ = stack
    chat = dict(DERENDER_CHAT, include_reasoning=False)
    gen = httpx.post(parsed.url + "/v1/chat/completions/render", json=chat).json()
    assert gen["parse_context"]["include_reasoning"] is False
    choice = _generate(parsed, dict(gen, output_mode="derender"))["choices"][0]
    facade = httpx.post(parsed.url + "/v1/chat/completions", json=chat, timeout=120).json()["choices"][0]
    assert choice["message"]["reasoning"] is None and facade["message"]["reasoning"] is None
    assert choice["message"]["content"] == facade["message"]["content"]
    assert choice["logprobs"] is None and choice["token_ids"] is None and choice["sampling_mask"] is None
    # Shown again with include_reasoning on.
    gen["parse_context"]["include_reasoning"] = True
    shown = _generate(parsed, dict(gen, output_mode="derender"))["choices"][0]
    assert shown["message"]["reasoning"] and shown["logprobs"] is not None and len(shown["token_ids"]) == 12


def test_generate_derender_without_parser_is_the_text(stack):
    """A gateway with no reasoning / tool parser needs no parse_context: the content is the text."""
    _, _, _, plain = stack
    gen = httpx.post(plain.url + "/v1/chat/completions/render",
                     json={"messages": MESSAGES, "temperature": 0, "max_tokens": 8, **PRINTABLE}).json()
    text = _generate(plain, dict(gen, output_mode="text"))["choices"][0]["text"]
    del gen["parse_context"]
    msg = _generate(plain, dict(gen, output_mode="derender"))["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"] == text and msg["reasoning"] is None


def test_generate_derender_errors(stack):
    _, _, parsed, plain = stack
    gen = httpx.post(parsed.url + "/v1/chat/completions/render",
                     json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4}).json()

    def post(gw, body):
        return httpx.post(gw.url + GENERATE, json=body, timeout=120)

    r = post(parsed, dict(gen, output_mode="derender", stream=True))
    assert r.status_code == 400 and r.json()["error"]["message"] == \
        "output_mode='derender' does not support stream=true.", r.text
    r = post(parsed, dict(gen, output_mode="derender", parse_context=None))
    assert r.status_code == 400 and "requires parse_context on a server with a tool or reasoning parser" in r.text
    r = post(parsed, dict(gen, output_mode="derender", sampling_params=dict(gen["sampling_params"], detokenize=False)))
    assert r.status_code == 400
    assert "output_mode='derender' requires sampling_params.detokenize to be true" in r.json()["error"]["message"]
    # Fields from a newer /render: refused where they would be read, ignored elsewhere.
    newer = dict(gen["parse_context"], zeta=1, alpha={"x": 1})
    r = post(parsed, dict(gen, output_mode="derender", parse_context=newer))
    assert r.status_code == 400 and r.json()["error"]["message"] == (
        "Unknown parse_context fields ['alpha', 'zeta']; the render server is newer than this generate server")
    for mode in ("tokens", "text"):
        assert post(parsed, dict(gen, output_mode=mode, parse_context=newer)).status_code == 200, mode
        assert post(parsed, dict(gen, output_mode=mode, parse_context=newer, stream=True)).status_code == 200
    # Known fields are type-checked in every mode.
    for mode in ("tokens", "derender"):
        bad = dict(gen["parse_context"], include_reasoning="yes")
        r = post(parsed, dict(gen, output_mode=mode, parse_context=bad))
        assert r.status_code == 400 and r.json()["error"]["param"] == "parse_context.include_reasoning", r.text
        r = post(parsed, dict(gen, output_mode=mode, parse_context=dict(gen["parse_context"],
                                                                        history_tool_call_cnt=-1)))
        assert r.status_code == 400 and "history_tool_call_cnt" in r.text
    named = dict(gen["parse_context"], tool_choice={"type": "function", "function": {"name": "nope"}})
    r = post(parsed, dict(gen, output_mode="derender", parse_context=named))
    assert r.status_code == 400 and "does not match any of the specified `tools`" in r.text
    assert post(parsed, dict(gen, output_mode="bogus")).status_code == 400


def test_one_token_prompt_logprobs_are_a_lone_null(stack):
    """vLLM: a one-token prompt's prompt_logprobs is [null] (nothing to score), not null;
    echo + logprobs lists the prompt token with a null logprob, then the output's."""
    _, _, _, plain = stack
    one = httpx.post(plain.url + "/v1/completions", timeout=60,
                     json={"prompt": [72], "max_tokens": 2, "prompt_logprobs": 1}).json()
    assert one["usage"]["prompt_tokens"] == 1 and one["choices"][0]["prompt_logprobs"] == [None]
    echo = httpx.post(plain.url + "/v1/completions", timeout=60,
                      json={"prompt": [72], "max_tokens": 2, "echo": True, "logprobs": 1}).json()["choices"][0]
    assert echo["prompt_logprobs"] == [None]  # echo with logprobs asks for them (vLLM)
    lp = echo["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == 3 and all(v is not None for v in lp["token_logprobs"][1:])


def _usage_of_stream(r: httpx.Response) -> dict:
    return [json.loads(p) for p in sse_payloads(r) if p != "[DONE]"][-1]["usage"]


def test_prompt_tokens_details_follow_the_flag_on_every_route(stack):
    """vLLM's --enable-prompt-tokens-details: with it (plain), usage.prompt_tokens_details
    carries cached_tokens on /generate and the OpenAI routes (non-stream: with the null fields
    of model_dump; stream: nulls dropped); without it (parsed), null, or absent in a stream."""
    _, _, parsed, plain = stack
    prompt = "The same long prompt, sent twice so that its full blocks are cached. " * 3
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
    comp = {"prompt": prompt, "max_tokens": 2}
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    for gw, on in ((plain, True), (parsed, False)):
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", comp)):
            httpx.post(gw.url + path, json=body, timeout=60)  # warms the prefix cache
            usage = httpx.post(gw.url + path, json=body, timeout=60).json()["usage"]
            streamed = _usage_of_stream(httpx.post(gw.url + path, json={**body, **stream}, timeout=60))
            if on:
                details = usage["prompt_tokens_details"]
                assert details["cached_tokens"] > 0 and details["created_cache_tokens"] is None, details
                assert set(streamed["prompt_tokens_details"]) == {"cached_tokens"}
                assert streamed["prompt_tokens_details"]["cached_tokens"] > 0
            else:
                assert usage["prompt_tokens_details"] is None
                assert "prompt_tokens_details" not in streamed
        ids = httpx.post(gw.url + "/v1/completions/render", json=comp).json()[0]["token_ids"]
        gen = {"token_ids": ids, "sampling_params": {"max_tokens": 2}}
        usage = httpx.post(gw.url + GENERATE, json=gen, timeout=60).json()["usage"]
        if on:
            assert usage["prompt_tokens_details"]["cached_tokens"] > 0
        else:
            assert usage["prompt_tokens_details"] is None


def test_integral_float_max_tokens_as_vllm(stack):
    """vLLM 0.33 takes ``max_tokens: 1e3`` (pydantic: an integral float is an int), clamps
    what the context has no room for (get_max_tokens), refuses more than max_model_len
    (TokenizeParams) and a fractional number."""
    _, _, _, plain = stack
    r = httpx.post(plain.url + "/v1/completions/render", json={"prompt": [5, 6, 7], "max_tokens": 1.024e3})
    assert r.status_code == 200, r.text
    assert r.json()[0]["sampling_params"]["max_tokens"] == 1024 - 3
    r = httpx.post(plain.url + "/v1/chat/completions/render", json={"messages": MESSAGES, "max_tokens": 1000.0})
    assert r.status_code == 200, r.text
    assert r.json()["sampling_params"]["max_tokens"] == 1024 - len(r.json()["token_ids"])
    for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": MESSAGES})):
        err = httpx.post(plain.url + path, json={**body, "max_tokens": 1e18}).json()["error"]
        assert err["message"] == ("max_tokens=1000000000000000000 cannot be greater than max_model_len=1024. "
                                  "Please request fewer output tokens.") and err["param"] == "max_tokens", err
    err = httpx.post(plain.url + "/v1/chat/completions",
                     json={"messages": MESSAGES, "max_completion_tokens": 2000}).json()["error"]
    assert err["param"] == "max_completion_tokens" and "cannot be greater than max_model_len" in err["message"]
    r = httpx.post(plain.url + "/v1/completions", timeout=60,
                   json={"prompt": "Hi", "max_tokens": 2.0, "logprobs": 1.0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2 and len(r.json()["choices"][0]["logprobs"]["tokens"]) == 2
    r = httpx.post(plain.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2.5})
    assert r.status_code == 400 and "fractional part" in r.json()["error"]["message"], r.text
