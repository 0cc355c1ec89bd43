"""Render units: completion prompts tokenized as transformers does (BOS from the
tokenizer's post-processor with add_special_tokens, none without), sampling_params as
vLLM's SamplingParams dumps them (defaults omitted), max_tokens as get_max_tokens
resolves it, and the length / validation errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import processors

from common.errors import BadRequest
from gateway.openai_api.model_files import TextModel
from gateway.openai_api.protocol import chat_request_decoder, completion_request_decoder
from gateway.openai_api.render import Renderer
from worker.engine.loading.demo_model import BOS_TOKEN, EOS_TOKEN, build_byte_tokenizer, tokenizer_config


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory) -> Path:
    """A byte tokenizer whose post-processor prepends BOS, as Llama's tokenizer.json does."""
    out = tmp_path_factory.mktemp("bos-model")
    tok = build_byte_tokenizer()
    bos = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B",
                                                       special_tokens=[(BOS_TOKEN, bos)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config()))
    (out / "config.json").write_text(json.dumps({"max_position_embeddings": 64, "eos_token_id": bos + 1}))
    (out / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    return out


@pytest.fixture(scope="module")
def renderer(bos_model) -> Renderer:
    return Renderer(TextModel.load(bos_model))


def _completion(**body):
    return completion_request_decoder.decode(json.dumps(body))


def _chat(**body):
    return chat_request_decoder.decode(json.dumps(body))


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_completion_prompt_tokens_equal_transformers(bos_model, renderer, add_special_tokens):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(bos_model / "tokenizer.json"), bos_token=BOS_TOKEN,
                                 eos_token=EOS_TOKEN)
    (gen,) = [r.generate for r in renderer.completion(
        _completion(prompt="héllo", add_special_tokens=add_special_tokens), 64, "x")]
    assert gen["token_ids"] == hf("héllo", add_special_tokens=add_special_tokens)["input_ids"]
    assert gen["token_ids"][0] == (hf.bos_token_id if add_special_tokens else ord("h"))


def test_sampling_params_as_vllm_dumps_them(renderer):
    (r,) = renderer.completion(_completion(prompt=[1, 2, 3], max_tokens=5, stop="ab", seed=-1, n=2,
                                           logprobs=2, stream=True), 64, "id")
    sp = r.generate["sampling_params"]
    # generation_config's defaults fill what the request left out; vLLM's defaults are omitted.
    assert sp == {"n": 2, "temperature": 0.6, "top_p": 0.9, "stop": ["ab"], "stop_token_ids": [], "max_tokens": 5,
                  "logprobs": 2, "output_kind": 1, "skip_clone": True, "output_text_buffer_length": 1,
                  "bad_words": []}
    assert r.generate["request_id"] == "cmpl-id" and r.generate["stream"] is True
    (greedy,) = renderer.completion(_completion(prompt=[1], temperature=0, top_k=5, max_tokens=None), 64, "g")
    gsp = greedy.generate["sampling_params"]
    assert gsp["temperature"] == 0 and "top_k" not in gsp and "top_p" not in gsp  # greedy resets the filters
    assert gsp["max_tokens"] == 63 and gsp["output_kind"] == 2  # the room left in the context


def test_chat_max_tokens_and_echo_prompt_logprobs(renderer):
    r = renderer.chat(_chat(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=4, max_tokens=9,
                            logprobs=True, top_logprobs=3, echo=True), 64, "c")
    sp = r.generate["sampling_params"]
    assert sp["max_tokens"] == 4 and sp["logprobs"] == 3 and sp["prompt_logprobs"] == 3
    assert r.generate["request_id"] == "chatcmpl-c" and r.prompt_text.startswith(BOS_TOKEN + "<|user|>\nhi")


@pytest.mark.parametrize("body, needle", [
    (dict(prompt="x" * 70), "maximum context length is 64 tokens"),
    (dict(prompt="x" * 20, max_tokens=65), "max_tokens=65 cannot be greater than max_model_len=64"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=[-1]), "negative"),
    (dict(prompt="a", suffix="b"), "suffix"),
    (dict(prompt="a", use_beam_search=True), "Beam search"),
    (dict(prompt="a", logit_bias={"x": 1.0}), "logit_bias"),
    (dict(prompt="a", stream_options={"include_usage": True}), "Stream options"),
    (dict(prompt="a", structured_outputs={"regex": "a+", "json": {}}), "one kind of constraints"),
    (dict(prompt="a", prompt_logprobs=2, stream=True), "prompt_logprobs"),
])
def test_completion_errors(renderer, body, needle):
    with pytest.raises(BadRequest, match=needle):
        renderer.completion(_completion(**body), 64, "e")


def test_truncate_prompt_tokens_keeps_the_tail(renderer):
    (r,) = renderer.completion(_completion(prompt=list(range(1, 101)), truncate_prompt_tokens=10, max_tokens=3),
                               64, "t")
    assert r.generate["token_ids"] == list(range(91, 101))


def test_max_tokens_16_survives_the_round_trip(renderer):
    """vLLM's omit_defaults would drop max_tokens=16, which /generate then reads as unset."""
    (r,) = renderer.completion(_completion(prompt=[1, 2], max_tokens=16), 64, "m")
    assert r.generate["sampling_params"]["max_tokens"] == 16


@pytest.mark.parametrize("prompt", [[None], [[]], [1, "a"], [[1, None]], [True], [["a"]], [1.5]])
def test_malformed_prompts_are_400(renderer, prompt):
    with pytest.raises(BadRequest, match="prompt"):
        renderer.completion(_completion(prompt=prompt), 64, "p")


def test_token_offsets_are_transformers_offset_mapping(bos_model, renderer):
    """return_token_offsets: each token's [start, end) in the prompt text, (0, 0) for the
    BOS the post-processor adds (a fast tokenizer's offset_mapping, as vLLM returns it);
    truncation cuts them with the ids; token prompts and the default have none."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(bos_model / "tokenizer.json"), bos_token=BOS_TOKEN,
                                 eos_token=EOS_TOKEN)
    (gen,) = [r.generate for r in renderer.completion(_completion(prompt="hé!", return_token_offsets=True), 64, "o")]
    want = hf("hé!", return_offsets_mapping=True)
    assert gen["token_ids"] == want["input_ids"]
    assert gen["token_offsets"] == [list(o) for o in want["offset_mapping"]] and gen["token_offsets"][0] == [0, 0]
    (cut,) = [r.generate for r in renderer.completion(
        _completion(prompt="hé!", return_token_offsets=True, truncate_prompt_tokens=2), 64, "o")]
    assert cut["token_offsets"] == gen["token_offsets"][-2:] and len(cut["token_ids"]) == 2
    (ids,) = [r.generate for r in renderer.completion(_completion(prompt=[1, 2], return_token_offsets=True), 64, "o")]
    assert ids["token_offsets"] is None
    assert renderer.completion(_completion(prompt="hé!"), 64, "o")[0].generate["token_offsets"] is None
    chat = renderer.chat(_chat(messages=[{"role": "user", "content": "hi"}], return_token_offsets=True), 64, "c")
    spans = chat.generate["token_offsets"]
    assert len(spans) == len(chat.token_ids) and chat.prompt_text[spans[-1][0]:spans[-1][1]] == chat.prompt_text[-1]


def test_completion_max_tokens_past_the_room_is_clamped(renderer):
    """vLLM 0.33: the prompt need not leave room for max_tokens; get_max_tokens clamps it."""
    (r,) = renderer.completion(_completion(prompt="x" * 20, max_tokens=50), 64, "c")
    assert r.generate["sampling_params"]["max_tokens"] == 64 - len(r.token_ids)


def test_the_rendered_request_is_typed_and_mapped_as_built(renderer):
    """One typed request from render to the wire: the renderer builds the generate API's
    HttpGenerateRequest once (max_tokens decided by sampling.max_tokens_for), the render
    routes answer its vLLM JSON, and map_request takes it as is: the wire's max_tokens is
    the rendered one, explicit, not re-decided."""
    from common.protocol import ClusterInfo, ModelInfo, WorkerLoad, WorkerStatus
    from gateway.generate_api.protocol import HttpGenerateRequest, HttpSamplingParams
    from gateway.generate_api.request_mapping import map_request

    r = renderer.chat(_chat(messages=[{"role": "user", "content": "hi"}], temperature=0.5, stop="zz",
                            stream=True, stream_options={"include_usage": True}), 64, "t")
    http = r.request
    assert isinstance(http, HttpGenerateRequest) and isinstance(http.sampling_params, HttpSamplingParams)
    room = 64 - len(r.token_ids)
    assert http.sampling_params.max_tokens == room and r.generate["sampling_params"]["max_tokens"] == room
    assert list(r.generate) == ["request_id", "token_ids", "token_offsets", "features", "content_parts",
                                "sampling_params", "model", "reasoning_ended", "reasoning_parser_kwargs",
                                "return_token_ids", "output_mode", "parse_context", "stream", "stream_options",
                                "cache_salt", "priority", "kv_transfer_params", "ec_transfer_params"]
    assert list(r.generate["sampling_params"]) == ["temperature", "top_p", "stop", "stop_token_ids", "max_tokens",
                                                   "output_kind", "skip_clone", "output_text_buffer_length",
                                                   "bad_words"]
    assert r.generate["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    model = ModelInfo(name="m", vocab_size=300, max_model_len=64, max_num_seqs=4, default_max_tokens=5)
    cluster = ClusterInfo(workers=[WorkerStatus(rank=0, load=WorkerLoad())], model=model)
    mapped = map_request(http, {}, cluster, model, served_model_names=[], arrival_time=1.0)
    p = mapped.wire.params
    assert (p.max_tokens, p.max_tokens_is_default) == (room, False)
    assert (p.temperature, p.stop, mapped.stream, mapped.include_usage) == (0.5, ["zz"], True, True)
