"""Harmony end to end on a real worker: the tiny random GPT-OSS checkpoint (tests/support/
model_factory.py ``gpt_oss``) with a tokenizer carrying harmony's control tokens and GPT-OSS's
real chat template, behind a broker and a gateway running ``--reasoning-parser openai_gptoss
--tool-call-parser openai``.  The random model's output is driven with a structural tag whose
format is the harmony text itself (compiled on the full vocabulary, so the control tokens are
allowed), then the grammar ends and the model can only stop on one of GPT-OSS's stop ids
(``<|return|>``, ``<|call|>``).  So the worker really generates, detokenizes with the special
tokens kept (the gateway asks for it) and stops as GPT-OSS does; the openai client reads the
reasoning, content and tool calls parsed from that text, streamed and not."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest

from common.structured_outputs_config import StructuredOutputsConfig
from tests.support import inprocess_gateway
from tests.support.chat_models import HARMONY, TEMPLATES
from tests.support.gateway_helpers import stream_chat
from tests.support.procs import ProcGroup, wait_for_workers
from worker.engine.loading.demo_model import build_byte_tokenizer

WORKER_ARGS = ("--max-num-seqs", "4", "--num-kv-blocks", "128", "--threads", "1", "--max-model-len", "1024")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
REASONING = "Call the tool."
ANSWER = "Sunny."
ANSWERED = (f"<|channel|>analysis<|message|>{REASONING}<|end|>"
            f"<|start|>assistant<|channel|>final<|message|>{ANSWER}")
CALLED = (f"<|channel|>analysis<|message|>{REASONING}<|end|>"
          '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
          '{"city":"Paris"}')


def build_harmony_model(src: Path, out: Path) -> Path:
    """The tiny GPT-OSS checkpoint with harmony's tokens in its vocabulary (bytes, the harmony
    tokens, reserved specials up to the model's vocab size) and GPT-OSS's chat template;
    <|return|> and <|call|> are its eos ids, as in the released generation_config."""
    from tokenizers import AddedToken

    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    config = json.loads((src / "config.json").read_text())
    reserved = tuple(f"<|reserved_{i}|>" for i in range(config["vocab_size"] - 256 - len(HARMONY)))
    tok = build_byte_tokenizer(HARMONY)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in reserved])
    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                       "normalized": False, "single_word": False} for t in HARMONY + reserved}
    stops = [tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")]
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>", "model_max_length": 1024, "added_tokens_decoder": added,
        "chat_template": (TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()}))
    config.update(eos_token_id=stops, bos_token_id=tok.token_to_id("<|startoftext|>"))
    (out / "config.json").write_text(json.dumps(config))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("harmony-worker")
    model = build_harmony_model(tiny_model("gpt_oss"), root / "gpt-oss")
    with ProcGroup(root / "logs") as procs:
        broker = procs.broker()
        procs.worker(broker, 0, "--model", str(model), *WORKER_ARGS)
        wait_for_workers(broker.frontend, 1, timeout=180)
        # enable_in_reasoning: the structural tag below drives the whole output, analysis included
        with inprocess_gateway.serve(tokenizer=str(model), broker=broker.frontend, served_model_names=["gpt-oss"],
                                     reasoning_parser="openai_gptoss", tool_call_parser="openai",
                                     enable_auto_tool_choice=True, info_ttl_s=0.2,
                                     structured_outputs_config=StructuredOutputsConfig(enable_in_reasoning=True)
                                     ) as gw:
            yield openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)


# The grammar admits a control token's text spelled in bytes too; a bias makes the model take
# the control token itself wherever the grammar allows it, as GPT-OSS writes them.
CONTROL = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|constrain|>")
CONTROL_IDS = {t: build_byte_tokenizer(HARMONY).token_to_id(t) for t in CONTROL}


def _driven(text: str) -> dict:
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": text}}
    return {"structured_outputs": {"structural_tag": json.dumps(tag)},
            "logit_bias": {str(i): 100 for i in CONTROL_IDS.values()}}


def test_reasoning_and_content_from_a_real_worker(stack):
    kw = dict(model="gpt-oss", messages=MESSAGES, max_tokens=300, temperature=0, extra_body=_driven(ANSWERED))
    choice = stack.chat.completions.create(**kw, logprobs=True).choices[0]
    assert choice.finish_reason == "stop"  # the model stopped on a GPT-OSS stop id once the grammar ended
    assert choice.message.reasoning == REASONING and choice.message.content == ANSWER
    # the control tokens were generated as single ids and reached the parser as text: the
    # worker decoded with the special tokens kept
    tokens = [t.token for t in choice.logprobs.content]
    assert {"<|channel|>", "<|message|>", "<|end|>", "<|start|>"} <= set(tokens), tokens
    assert stream_chat(stack, **kw) == (REASONING, ANSWER, [], "stop")


def test_tool_call_from_a_real_worker(stack):
    kw = dict(model="gpt-oss", messages=MESSAGES, tools=TOOLS, max_tokens=300, temperature=0,
              extra_body=_driven(CALLED))
    choice = stack.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning == REASONING and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    reasoning, content, calls, finish = stream_chat(stack, **kw)
    assert reasoning == REASONING and content == "" and finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]



def test_responses_api_counts_reasoning_tokens_on_harmony_channels(stack):
    """/v1/responses on the same output: a reasoning item and the message, and
    usage.output_tokens_details.reasoning_tokens counted as vLLM counts harmony's (the
    analysis message's <|message|> token and its text, one byte-token per character here)."""
    r = stack.responses.create(model="gpt-oss", input="Weather in Paris?", max_output_tokens=300, temperature=0,
                               extra_body=_driven(ANSWERED))
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == REASONING and r.output[1].content[0].text == ANSWER
    assert r.usage.output_tokens_details.reasoning_tokens == 1 + len(REASONING)
