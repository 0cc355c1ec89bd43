"""Gemma 3 image input end to end: the real openai SDK sends a chat message with an
``image_url`` (data URL) to the gateway, a real broker and worker serve the tiny
``Gemma3ForConditionalGeneration``; the reply's tokens are transformers' greedy ones
(Gemma3Processor's prompt: each ``<start_of_image>`` of the rendered template replaced
by ``\\n\\n<start_of_image>`` + the image tokens + ``<end_of_image>\\n\\n``; pixel values
from Gemma3ImageProcessorPil; ``token_type_ids`` opening the mask within each image)."""
from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

import httpx  # noqa: E402
import openai  # noqa: E402
import torch  # noqa: E402

from tests.integration.test_mm_http import _data_url, _png  # noqa: E402
from tests.support.gateway_helpers import GENERATE, start_gateway  # noqa: E402
from tests.support.model_factory import BYTE_VOCAB, VOCAB_SIZE, _quiet_transformers, special_tokens  # noqa: E402
from tests.support.procs import ProcGroup, wait_for_workers  # noqa: E402

IMAGE, BOI, EOI = 300, 301, 302
NAMES = {IMAGE: "<image_soft_token>", BOI: "<start_of_image>", EOI: "<end_of_image>"}
MAX_TOKENS = 6
WORKER_ARGS = ("--max-model-len", "256", "--max-num-seqs", "8", "--num-kv-blocks", "64", "--threads", "1",
               "--dtype", "float32")
# Gemma 3's template, reduced: turns as text, each image part as <start_of_image>.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or item['type'] == 'image_url' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _write_tokenizer(out) -> None:
    """The tiny models' byte tokenizer with Gemma 3's image markers on ids 300..302."""
    from worker.engine.loading.demo_model import build_byte_tokenizer

    specials = list(special_tokens(VOCAB_SIZE))
    for tid, name in NAMES.items():
        specials[tid - BYTE_VOCAB] = name
    (out / "tokenizer.json").write_text(build_byte_tokenizer(tuple(specials)).to_str(), encoding="utf-8")
    added = {str(BYTE_VOCAB + i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                   "normalized": False, "single_word": False} for i, t in enumerate(specials)}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": specials[0], "eos_token": specials[1],
           "model_max_length": 512, "clean_up_tokenization_spaces": False, "added_tokens_decoder": added,
           "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma3_mm_chat")
    src = tiny_model("gemma3_mm")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(src / name, out / name)
    _write_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, model_dir):
    with ProcGroup(tmp_path_factory.mktemp("gemma3-mm")) as procs:
        broker = procs.broker()
        procs.worker(broker, 0, "--model", str(model_dir), *WORKER_ARGS)
        wait_for_workers(broker.frontend, 1, timeout=120)
        yield start_gateway(procs, broker.frontend, "--tokenizer", str(model_dir))


def _content(urls, texts):
    parts = [{"type": "text", "text": texts[0]}]
    for url, text in zip(urls, texts[1:]):
        parts += [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return parts


@torch.inference_mode()
def _hf_greedy(model_dir, pngs, texts):
    """transformers' prompt ids (Gemma3Processor's text replacement, then the tokenizer)
    and its greedy tokens."""
    from PIL import Image
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    _quiet_transformers()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    seq = "\n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n"
    prompt = tok.bos_token + "<start_of_turn>user\n" + texts[0]
    for text in texts[1:]:
        prompt += "<start_of_image>" + text
    prompt += "<end_of_turn>\n<start_of_turn>model\n"
    ids = tok(prompt.replace("<start_of_image>", seq), add_special_tokens=False)["input_ids"]
    images = [Image.open(io.BytesIO(p)).convert("RGB") for p in pngs]
    pixels = torch.from_numpy(Gemma3ImageProcessorPil(size={"height": 56, "width": 56})(
        images=images, return_tensors="np")["pixel_values"])
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    input_ids = torch.tensor([ids])
    out = hf.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=pixels,
                      token_type_ids=(input_ids == IMAGE).long(), max_new_tokens=MAX_TOKENS,
                      min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return ids, out[0, len(ids):].tolist()


def test_openai_sdk_chat_with_images_gets_hf_greedy_tokens(gateway, model_dir):
    pngs = [_png(1, 70, 40), _png(2, 56, 90)]
    cases = [([pngs[0]], ["look: ", " what?"]), (pngs, ["", " and", " now"])]
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for use, texts in cases:
        want_prompt, want = _hf_greedy(model_dir, use, texts)
        messages = [{"role": "user", "content": _content([_data_url(p) for p in use], texts)}]
        resp = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, temperature=0, max_tokens=MAX_TOKENS,
                                              extra_body={"return_token_ids": True, "ignore_eos": True})
        choice = resp.choices[0]
        assert choice.model_extra["token_ids"] == want
        assert resp.model_extra["prompt_token_ids"] == want_prompt
        assert resp.usage.prompt_tokens == len(want_prompt)
        # the render route gives the same prompt (its content_parts for /generate) and the same tokens
        rendered = httpx.post(gateway.url + "/v1/chat/completions/render",
                              json={"messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS}).json()
        assert rendered["token_ids"] == want_prompt and len(rendered["content_parts"]) == len(use)
        gen = httpx.post(gateway.url + GENERATE, json={**rendered, "sampling_params": {
            **rendered.get("sampling_params", {}), "ignore_eos": True}}, timeout=120)
        assert gen.status_code == 200, gen.text
        assert gen.json()["choices"][0]["token_ids"] == want


def test_pan_and_scan_is_refused(gateway):
    body = {"messages": [{"role": "user", "content": _content([_data_url(_png(1, 56, 56))], ["a", "b"])}],
            "max_tokens": 2, "mm_processor_kwargs": {"do_pan_and_scan": True}}
    resp = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert "pan" in resp.json()["error"]["message"]


@pytest.fixture(scope="module")
def epd(tmp_path_factory, model_dir):
    """Broker-run encoder disaggregation (``--epd auto``): a plain worker (rank 0) and an
    encoder-only worker (rank 1) serving the same Gemma 3."""
    producer = json.dumps({"ec_connector": "ECCPUConnector", "ec_role": "ec_producer"})
    with ProcGroup(tmp_path_factory.mktemp("gemma3-epd")) as procs:
        broker = procs.broker("--epd", "auto")
        procs.worker(broker, 0, "--model", str(model_dir), *WORKER_ARGS)
        procs.worker(broker, 1, "--model", str(model_dir), *WORKER_ARGS, "--ec-transfer-config", producer,
                     "--mm-encoder-only")
        wait_for_workers(broker.frontend, 2, timeout=120)
        yield start_gateway(procs, broker.frontend, "--tokenizer", str(model_dir))


def test_encoder_disaggregation_gives_hf_greedy_tokens(epd, model_dir):
    """The image is encoded on the encoder-only worker, its embeddings pulled by rank 0,
    and the reply is still transformers' greedy tokens."""
    from tests.support.gateway_helpers import metric_value, wait_metric

    queries = "vllm:mm_cache_queries_total"
    png = _png(5, 64, 48)
    texts = ["what is ", "?"]
    want_prompt, want = _hf_greedy(model_dir, [png], texts)
    before = metric_value(httpx.get(epd.url + "/metrics").text, queries, engine="1")
    client = openai.OpenAI(base_url=epd.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    resp = client.chat.completions.create(
        model=client.models.list().data[0].id, temperature=0, max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": _content([_data_url(png)], texts)}],
        extra_body={"return_token_ids": True, "ignore_eos": True})
    assert resp.model_extra["prompt_token_ids"] == want_prompt
    assert resp.choices[0].model_extra["token_ids"] == want
    assert wait_metric(epd.url, queries, before + 1, engine="1") >= before + 1  # rank 1 ran the tower
