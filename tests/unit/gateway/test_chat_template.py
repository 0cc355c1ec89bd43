"""gateway.chat.template renders chat requests as vLLM 0.32 does: the prompt text and
its token ids equal transformers' ``apply_chat_template`` given the conversation vLLM's
preprocessing hands it, for real model templates (tests/support/data/chat_templates, sources
in its README).  Tokenizers are small BPEs trained here on a few lines, with each
template's control tokens as added tokens, written as model directories and loaded
the way the gateway loads them (``load_tokenizer``, ``ChatTemplate.from_model_dir``).
"""
from __future__ import annotations

import copy
import datetime as real_datetime
import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from common.errors import BadRequest
from common.tokenizer import load_tokenizer
from gateway.chat import jinja_env
from gateway.chat.template import ChatTemplate, ChatTemplateError, load_chat_template

transformers = pytest.importorskip("transformers")
hf_chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
from transformers import PreTrainedTokenizerFast  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "support" / "data" / "chat_templates"

CORPUS = [
    "You are a helpful assistant. Answer briefly and politely.",
    "What's the weather like in Paris today? It is sunny and 21 degrees.",
    "Given the following functions, please respond with a JSON for a function call.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "The capital of France is Paris. The answer is 42. Thanks, hello world!",
    "Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024",
    "function description parameters properties required type object string enum",
    "I should call the tool first. Let me think about it step by step.",
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}]
# No "type", no description, keys out of order, an unknown field: vLLM's pydantic
# model_dump() turns it into the dict below, and that is what the template sees.
SPARSE_TOOL = {"function": {"parameters": {"type": "object", "properties": {}}, "name": "get_time",
                            "strict": True, "x-internal": "dropped"}}
SPARSE_TOOL_DUMPED = {"type": "function", "function": {"name": "get_time", "description": None,
                                                       "parameters": {"type": "object", "properties": {}},
                                                       "strict": True}}
WEATHER_CALL = {"id": "abcDEF123", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
WEATHER_CALL_PARSED = {"id": "abcDEF123", "type": "function",
                       "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}


class Model:
    """A model directory (tokenizer.json + tokenizer_config.json), what the gateway
    builds from it, and transformers' tokenizer over the same files."""

    def __init__(self, root: Path, template, special_tokens: dict, control_tokens: list[str],
                 added: tuple[str, ...] = (), metaspace: bool = False, config_tokens: dict | None = None):
        root.mkdir(parents=True, exist_ok=True)
        _train_tokenizer(root / "tokenizer.json", control_tokens, added, metaspace)
        config = {"chat_template": template, **(config_tokens or special_tokens)}
        (root / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
        self.dir = root
        self.tok = load_tokenizer(root)
        self.template = ChatTemplate.from_model_dir(root)
        self.hf = PreTrainedTokenizerFast(tokenizer_file=str(root / "tokenizer.json"), chat_template=template,
                                          **special_tokens)


def _train_tokenizer(path: Path, control_tokens: list[str], added: tuple[str, ...], metaspace: bool) -> None:
    if metaspace:  # SentencePiece-style (Mistral v0.1): "▁" for spaces, <unk> for unseen characters
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=control_tokens, show_progress=False)
    else:  # byte-level BPE (Llama 3, Qwen, Mistral Nemo's tekken)
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=control_tokens, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tok.save(str(path))


def _read(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


LLAMA_CONTROL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
LLAMA_SPECIALS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
QWEN_CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
QWEN_SPECIALS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
MISTRAL_CONTROL = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                   "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
MISTRAL_SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("chat-models")


@pytest.fixture(scope="module")
def llama33(root) -> Model:
    return Model(root / "llama33", _read("llama-3.3-70b-instruct.jinja"), LLAMA_SPECIALS, LLAMA_CONTROL)


@pytest.fixture(scope="module")
def llama32(root) -> Model:
    return Model(root / "llama32", _read("llama-3.2-3b-instruct.jinja"), LLAMA_SPECIALS, LLAMA_CONTROL)


@pytest.fixture(scope="module")
def qwen25(root) -> Model:
    return Model(root / "qwen25", _read("qwen2.5-7b-instruct.jinja"), QWEN_SPECIALS, QWEN_CONTROL, QWEN_ADDED)


@pytest.fixture(scope="module")
def qwen3(root) -> Model:
    return Model(root / "qwen3", _read("qwen3-0.6b.jinja"), QWEN_SPECIALS, QWEN_CONTROL, QWEN_ADDED)


@pytest.fixture(scope="module")
def nemo(root) -> Model:
    return Model(root / "nemo", _read("mistral-nemo-instruct-2407.jinja"), MISTRAL_SPECIALS, MISTRAL_CONTROL)


@pytest.fixture(scope="module")
def mixtral(root) -> Model:
    # tokenizer_config in the AddedToken form older Mistral repositories use.
    config_tokens = {k: {"content": v, "lstrip": False, "normalized": False, "rstrip": False,
                         "single_word": False, "__type": "AddedToken"} for k, v in MISTRAL_SPECIALS.items()}
    return Model(root / "mixtral", _read("mixtral-8x7b-instruct-v0.1.jinja"), MISTRAL_SPECIALS, MISTRAL_CONTROL,
                 metaspace=True, config_tokens=config_tokens)


def assert_same(model: Model, messages, *, hf_messages=None, tools=None, hf_tools=None, documents=None,
                add_generation_prompt=True, continue_final_message=False, chat_template_kwargs=None,
                hf_kwargs=None, template: ChatTemplate | None = None, hf_template: str | None = None) -> list[int]:
    """Our prompt and ids equal transformers' for the conversation vLLM would pass it
    (``hf_messages``/``hf_tools``/``hf_kwargs``, defaulting to ours unchanged)."""
    sent = copy.deepcopy((messages, tools, documents, chat_template_kwargs))
    prompt = (template or model.template).render(
        messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs)
    assert (messages, tools, documents, chat_template_kwargs) == sent, "render() changed its arguments"
    kwargs = dict(tools=hf_tools if hf_tools is not None else tools, documents=documents,
                  add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                  chat_template=hf_template,
                  **(hf_kwargs if hf_kwargs is not None else (chat_template_kwargs or {})))
    reference = hf_messages if hf_messages is not None else messages
    expected_text = model.hf.apply_chat_template(copy.deepcopy(reference), tokenize=False, **kwargs)
    expected_ids = model.hf.apply_chat_template(copy.deepcopy(reference), tokenize=True, return_dict=False, **kwargs)
    assert prompt == expected_text
    ids = model.tok.encode(prompt, add_special_tokens=False)
    assert ids == expected_ids
    return ids


# --- Llama 3.x ---------------------------------------------------------------------

def test_llama33_system_user_generation_prompt(llama33):
    ids = assert_same(llama33, [{"role": "system", "content": "You are a helpful assistant."},
                                {"role": "user", "content": "What's the weather like in Paris today?"}])
    tok = llama33.tok
    # bos, header and end-of-turn tokens are single control tokens, as in the real model
    assert ids[0] == tok.token_to_id("<|begin_of_text|>")
    assert ids.count(tok.token_to_id("<|eot_id|>")) == 2
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_llama33_multi_turn_without_generation_prompt_and_date_string(llama33):
    assert_same(llama33, [{"role": "user", "content": "Hello"},
                          {"role": "assistant", "content": "Hello world!"},
                          {"role": "user", "content": "The capital of France?"}],
                add_generation_prompt=False, chat_template_kwargs={"date_string": "01 Jan 2025"})


def test_llama33_tools_in_user_message_and_tool_round_trip(llama33):
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "What's the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]},
                {"role": "tool", "tool_call_id": "abcDEF123", "content": '{"temperature": 21}'}]
    hf_messages = copy.deepcopy(messages)
    hf_messages[2] = {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL_PARSED]}
    ids = assert_same(llama33, messages, hf_messages=hf_messages, tools=TOOLS)
    prompt = llama33.tok.decode(ids, skip_special_tokens=False)
    assert "Environment: ipython" in prompt and '"name": "get_weather"' in prompt
    assert '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}' in prompt


def test_llama33_continue_final_message_cuts_the_trimmed_turn(llama33):
    ids = assert_same(llama33, [{"role": "user", "content": "What is six times seven?"},
                                {"role": "assistant", "content": "The answer is "}],
                      add_generation_prompt=False, continue_final_message=True)
    assert llama33.tok.decode(ids, skip_special_tokens=False).endswith("<|end_header_id|>\n\nThe answer is")


def test_llama33_text_parts_are_joined_with_newlines(llama33):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": ""}, "world",
             {"type": "input_text", "text": "today?"}]
    assert_same(llama33, [{"role": "user", "content": parts}],
                hf_messages=[{"role": "user", "content": "Hello\nworld\ntoday?"}])


class _FrozenDatetime(real_datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2025, 3, 9, 12, 0, 0)


def test_llama32_date_from_strftime_now(llama32, monkeypatch):
    monkeypatch.setattr(jinja_env, "datetime", _FrozenDatetime)
    monkeypatch.setattr(hf_chat_utils, "datetime", _FrozenDatetime)
    ids = assert_same(llama32, [{"role": "user", "content": "Hello"}])
    assert "Today Date: 09 Mar 2025" in llama32.tok.decode(ids, skip_special_tokens=False)


# --- Qwen2.5 (hermes-style tools) ----------------------------------------------------

def test_qwen25_default_system_prompt(qwen25):
    ids = assert_same(qwen25, [{"role": "user", "content": "Hello"}])
    assert ids[0] == qwen25.tok.token_to_id("<|im_start|>")


def test_qwen25_tools_tool_calls_and_tool_responses(qwen25):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Weather and time in Paris?"},
                {"role": "assistant", "content": "Let me check.",
                 "tool_calls": [WEATHER_CALL, {"id": "t2", "type": "function",
                                               "function": {"name": "get_time", "arguments": "not json"}}]},
                {"role": "tool", "tool_call_id": "abcDEF123", "content": '{"temperature": 21}'},
                {"role": "tool", "tool_call_id": "t2", "content": [{"type": "text", "text": "12:00"}]}]
    hf_messages = copy.deepcopy(messages)
    hf_messages[2]["tool_calls"] = [WEATHER_CALL_PARSED, {"id": "t2", "type": "function",
                                                          "function": {"name": "get_time", "arguments": {}}}]
    hf_messages[4]["content"] = "12:00"
    ids = assert_same(qwen25, messages, hf_messages=hf_messages, tools=TOOLS + [SPARSE_TOOL],
                      hf_tools=TOOLS + [SPARSE_TOOL_DUMPED])
    prompt = qwen25.tok.decode(ids, skip_special_tokens=False)
    assert '"name": "get_time", "description": null, "parameters"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in prompt
    assert '<tool_call>\n{"name": "get_time", "arguments": {}}' in prompt  # invalid JSON arguments -> {}
    assert prompt.count("<tool_response>") == 2


def test_qwen25_continue_final_message(qwen25):
    ids = assert_same(qwen25, [{"role": "user", "content": "Capital of France?"},
                               {"role": "assistant", "content": "The capital of France is"}],
                      add_generation_prompt=False, continue_final_message=True)
    assert qwen25.tok.decode(ids, skip_special_tokens=False).endswith("assistant\nThe capital of France is")


# --- Qwen3 (enable_thinking) --------------------------------------------------------

@pytest.mark.parametrize("enable_thinking", [False, True])
def test_qwen3_enable_thinking(qwen3, enable_thinking):
    ids = assert_same(qwen3, [{"role": "system", "content": "Answer briefly."},
                              {"role": "user", "content": "What is 6 x 7?"}],
                      chat_template_kwargs={"enable_thinking": enable_thinking})
    prompt = qwen3.tok.decode(ids, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") is (not enable_thinking)


def test_qwen3_reasoning_and_tool_calls_in_history(qwen3):
    messages = [{"role": "user", "content": "What's the weather in Paris?"},
                {"role": "assistant", "content": None, "reasoning_content": "I should call the tool first.",
                 "tool_calls": [WEATHER_CALL]},
                {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny, 21 degrees"}]
    hf_messages = [messages[0],
                   {"role": "assistant", "content": "", "reasoning": "I should call the tool first.",
                    "tool_calls": [WEATHER_CALL_PARSED]},
                   messages[2]]
    ids = assert_same(qwen3, messages, hf_messages=hf_messages, tools=TOOLS)
    assert "<think>\nI should call the tool first.\n</think>" in qwen3.tok.decode(ids, skip_special_tokens=False)


def test_qwen3_developer_messages_become_one_system_message(qwen3):
    # The Qwen3 template never names "developer", so vLLM sends it as system and
    # merges the system messages into the first one.
    assert_same(qwen3, [{"role": "system", "content": "Answer briefly."},
                        {"role": "user", "content": "Hi"},
                        {"role": "developer", "content": [{"type": "text", "text": "Be polite."}]}],
                hf_messages=[{"role": "system", "content": "Answer briefly.\n\nBe polite."},
                             {"role": "user", "content": "Hi"}])


def test_chat_template_kwargs_are_filtered_like_vllm(qwen3):
    # Unknown names are dropped, None/"auto" mean unset, transformers' own parameters
    # never reach the template, and the request's add_generation_prompt wins.
    messages = [{"role": "user", "content": "Hello"}]
    kwargs = {"enable_thinking": False, "not_in_template": 1, "tokenize": True, "padding": True,
              "add_generation_prompt": False, "documents": None, "tools": "auto"}
    assert_same(qwen3, messages, chat_template_kwargs=kwargs, hf_kwargs={"enable_thinking": False})
    assert_same(qwen3, messages, chat_template_kwargs={"enable_thinking": None}, hf_kwargs={})


# --- Mistral ([INST]) ---------------------------------------------------------------

def test_mistral_nemo_multi_turn(nemo):
    ids = assert_same(nemo, [{"role": "system", "content": "Answer briefly."},
                             {"role": "user", "content": "Hello"},
                             {"role": "assistant", "content": "Hello world!"},
                             {"role": "user", "content": "Capital of France?"}])
    tok = nemo.tok
    assert ids[0] == tok.token_to_id("<s>") and ids[-1] == tok.token_to_id("[/INST]")
    assert ids.count(tok.token_to_id("</s>")) == 1


def test_mistral_nemo_tools(nemo):
    messages = [{"role": "user", "content": "What's the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]},
                {"role": "tool", "tool_call_id": "abcDEF123", "content": '{"temperature": 21}'},
                {"role": "assistant", "content": "It is sunny and 21 degrees."},
                {"role": "user", "content": "Thanks!"}]
    hf_messages = copy.deepcopy(messages)
    hf_messages[1] = {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL_PARSED]}
    ids = assert_same(nemo, messages, hf_messages=hf_messages, tools=TOOLS + [SPARSE_TOOL],
                      hf_tools=TOOLS + [SPARSE_TOOL_DUMPED])
    prompt = nemo.tok.decode(ids, skip_special_tokens=False)
    assert '[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather"' in prompt
    assert '"name": "get_time", "description": null, "parameters"' in prompt


def test_mistral_template_raise_exception_is_a_400_with_its_message(nemo):
    with pytest.raises(ChatTemplateError) as info:
        nemo.template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert str(info.value) == ("After the optional system message, conversation roles must alternate "
                               "user/assistant/user/assistant/...")
    assert isinstance(info.value, BadRequest) and info.value.status == 400


def test_mixtral_sentencepiece_style_and_added_token_config(mixtral):
    assert mixtral.template.special_tokens == MISTRAL_SPECIALS  # read from the AddedToken dicts
    assert_same(mixtral, [{"role": "system", "content": "Answer briefly."},
                          {"role": "user", "content": "Hello"},
                          {"role": "assistant", "content": "Hello world!"},
                          {"role": "user", "content": "Capital of France?"}])
    ids = assert_same(mixtral, [{"role": "user", "content": "Capital of France?"},
                                {"role": "assistant", "content": "Paris is"}],
                      add_generation_prompt=False, continue_final_message=True)
    assert ids[-1] != mixtral.tok.token_to_id("</s>")


# --- vLLM preprocessing details -------------------------------------------------------

OPENAI_FORMAT_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string %}{{ message.content }}"
    "{%- else %}{%- for part in message.content %}[{{ part.type }}:{{ part.text }}]{%- endfor %}{%- endif %}"
    "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def test_openai_content_format_keeps_parts(qwen25):
    template = ChatTemplate(OPENAI_FORMAT_TEMPLATE, QWEN_SPECIALS)
    assert jinja_env.detect_content_format(OPENAI_FORMAT_TEMPLATE) == "openai"
    messages = [{"role": "user", "content": "Hello"},
                {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {"type": "x"}},
                                             {"type": "refusal", "refusal": "no"}]},
                {"role": "tool", "content": [{"type": "text", "text": "21"}, {"type": "text", "text": "C"}]}]
    hf_messages = [{"role": "user", "content": [{"type": "text", "text": "Hello"}]},
                   {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {"type": "x"}},
                                                {"type": "text", "text": "no"}]},
                   {"role": "tool", "content": "21\nC"}]
    assert_same(qwen25, messages, hf_messages=hf_messages, template=template, hf_template=OPENAI_FORMAT_TEMPLATE)


def test_claude_code_billing_header_is_dropped_from_system_text(qwen25):
    assert_same(qwen25, [{"role": "system", "content": "x-anthropic-billing-header: cch=1a2b\nAnswer briefly."},
                         {"role": "user", "content": "Hello"}],
                hf_messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello"}])


def test_documents_reach_the_template(qwen25):
    source = "{% for d in documents %}{{ d.title }}: {{ d.text }}\n{% endfor %}{{ messages[0].content }}"
    docs = [{"title": "Paris", "text": "The capital of France."}]
    assert_same(qwen25, [{"role": "user", "content": "Hello"}], documents=docs,
                template=ChatTemplate(source, QWEN_SPECIALS), hf_template=source)


def test_generation_tag_renders_its_body(qwen25):
    source = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
              "{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}")
    assert_same(qwen25, [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}],
                add_generation_prompt=False, template=ChatTemplate(source, QWEN_SPECIALS), hf_template=source)


def test_messages_reach_the_template_as_vllm_builds_them():
    # vLLM 0.32's transformers (<5.20) passes None-valued keys on and adds no
    # "thinking" alias; fields vLLM does not keep never arrive.
    source = ("{% for m in messages %}{{ m.role }} tools={{ m.tools is defined }} id={{ m.tool_call_id }} "
              "thinking={{ m.thinking is defined }} r={{ m.reasoning }}/{{ m.reasoning_content }} "
              "extra={{ m.extra is defined }}|{% endfor %}{# 'developer' role supported #}")
    template = ChatTemplate(source, {})
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "assistant", "content": "x", "reasoning": "because", "extra": 1},
                {"role": "tool", "content": "21", "tool_call_id": None}]
    assert template.render(messages, add_generation_prompt=False) == (
        "developer tools=True id= thinking=False r=/ extra=False|"
        "assistant tools=False id= thinking=False r=because/because extra=False|"
        "tool tools=False id=None thinking=False r=/ extra=False|")


def test_named_templates_pick_tool_use_when_tools_are_given(root):
    named = [{"name": "default", "template": _read("qwen3-0.6b.jinja")},
             {"name": "tool_use", "template": _read("qwen2.5-7b-instruct.jinja")}]
    model = Model(root / "named", named, QWEN_SPECIALS, QWEN_CONTROL, QWEN_ADDED)
    assert load_chat_template(model.dir) == named
    assert model.template.names == ["default", "tool_use"]
    messages = [{"role": "user", "content": "Hello"}]
    with_tools = assert_same(model, messages, tools=TOOLS)
    without = assert_same(model, messages)
    assert "You are Qwen" in model.tok.decode(with_tools, skip_special_tokens=False)
    assert "You are Qwen" not in model.tok.decode(without, skip_special_tokens=False)


# --- loading --------------------------------------------------------------------------

def test_load_chat_template_override_file_and_inline(tmp_path):
    path = tmp_path / "custom.jinja"
    path.write_text("{{ messages[0].content }}!", encoding="utf-8")
    assert load_chat_template(None, str(path)) == "{{ messages[0].content }}!"
    assert load_chat_template(tmp_path, "{{ 'inline' }}") == "{{ 'inline' }}"
    with pytest.raises(ChatTemplateError, match="looks like a file path"):
        load_chat_template(None, str(tmp_path / "missing.jinja"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config", "bos_token": "<s>"}))
    override = ChatTemplate.from_model_dir(tmp_path, override=str(path))
    assert override.render([{"role": "user", "content": "hi"}]) == "hi!"
    assert override.special_tokens == {"bos_token": "<s>"}


def test_load_chat_template_file_layouts(tmp_path):
    assert load_chat_template(tmp_path) is None
    assert ChatTemplate.from_model_dir(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "from config"}))
    assert load_chat_template(tmp_path) == "from config"
    # transformers: chat_template.jinja wins over tokenizer_config, extra files make the named form
    (tmp_path / "chat_template.jinja").write_text("from file", encoding="utf-8")
    assert load_chat_template(tmp_path) == "from file"
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("tools", encoding="utf-8")
    assert load_chat_template(tmp_path) == [{"name": "default", "template": "from file"},
                                            {"name": "tool_use", "template": "tools"}]


# --- errors -----------------------------------------------------------------------------

def _render_error(template: ChatTemplate, messages, **kwargs) -> str:
    with pytest.raises(ChatTemplateError) as info:
        template.render(messages, **kwargs)
    assert isinstance(info.value, ValueError) and info.value.status == 400
    return str(info.value)


USER = [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize("messages, expected", [
    ([], "Cannot apply chat template to an empty conversation"),
    ({"role": "user"}, "messages must be a list"),
    (["hello"], "messages[0] must be an object"),
    ([{"content": "hi"}], "messages[0] has no 'role' field"),
    ([{"role": "wizard", "content": "hi"}], "unknown role 'wizard'"),
    ([{"role": "user", "content": 5}], "messages[0].content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
     "Multimodal content is not supported yet: messages[0].content[0] is a 'image_url' part"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}],
     "Multimodal content is not supported yet: messages[0].content[0] is a 'input_audio' part"),
    ([{"role": "user", "content": [{"image_url": "http://x/y.png"}]}], "is a 'image_url' part"),
    ([{"role": "user", "content": [{"text": "no type"}]}], "Missing 'type' field in multimodal part."),
    ([{"role": "user", "content": [{"type": "hologram"}]}], "Unsupported chat content part type: 'hologram'"),
    ([{"role": "assistant", "content": "", "tool_calls": ["call"]}], "assistant tool_calls entries must be objects."),
    ([{"role": "assistant", "content": "", "tool_calls": [{"type": "retrieval", "function": {}}]}],
     "chat completions only support assistant tool_calls of type 'function'."),
])
def test_message_errors(qwen25, messages, expected):
    assert expected in _render_error(qwen25.template, messages)


def test_any_string_role_when_roles_are_not_restricted(llama33):
    # vLLM accepts custom roles; Llama 3 templates read "ipython" for tool output.
    template = ChatTemplate(_read("llama-3.3-70b-instruct.jinja"), LLAMA_SPECIALS, allowed_roles=None)
    messages = [{"role": "user", "content": "Hi"}, {"role": "ipython", "content": "21"}]
    assert_same(llama33, messages, template=template)


@pytest.mark.parametrize("tools, expected", [
    ({"type": "function"}, "tools must be a list"),
    ([], "`tools` must not be an empty array."),
    (["get_weather"], "tools[0] must be an object"),
    ([{"type": "function"}], "tools[0].function must be an object"),
    ([{"type": "function", "function": {"description": "no name"}}], "tools[0].function.name must be a string"),
    ([{"type": "code_interpreter", "function": {"name": "x"}}], "tools[0].type must be 'function'"),
    ([{"type": "function", "function": {"name": "x", "parameters": "{}"}}], "parameters must be an object"),
])
def test_tool_errors(qwen25, tools, expected):
    assert expected in _render_error(qwen25.template, USER, tools=tools)


def test_request_option_errors(qwen25):
    t = qwen25.template
    assert _render_error(t, USER, add_generation_prompt=True, continue_final_message=True) == (
        "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    assert "chat_template_kwargs must be an object" in _render_error(t, USER, chat_template_kwargs=[1])
    assert "--trust-request-chat-template" in _render_error(t, USER, chat_template_kwargs={"chat_template": "x"})
    assert "documents must be a list" in _render_error(t, USER, documents=[{"title": 1}])


def test_template_errors_become_clear_400s(qwen25):
    undefined = ChatTemplate("{{ messages[0].nothing.here }}", {})
    assert "cannot render this request: UndefinedError" in _render_error(undefined, USER)
    # list content into a template that concatenates strings
    openai = ChatTemplate(_read("qwen2.5-7b-instruct.jinja"), QWEN_SPECIALS, content_format="openai")
    assert "cannot render this request: TypeError" in _render_error(openai, USER)
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    assert "cannot render this request: SecurityError" in _render_error(sandboxed, USER)
    with pytest.raises(ChatTemplateError, match=r"Invalid chat template: .* \(line 1\)"):
        ChatTemplate("{% if messages %}unclosed", {})
    with pytest.raises(ChatTemplateError, match="no default specified"):
        ChatTemplate([{"name": "a", "template": "x"}], {}).render(USER)
