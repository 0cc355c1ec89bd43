"""Image input in chat messages: ``image_url`` parts rendered by a Qwen2-VL style chat
template, each image's single ``<|image_pad|>`` expanded to its placeholder tokens, on
``/v1/chat/completions/render`` (-> content_parts for /inference/v1/generate) and on the
``/v1/chat/completions`` facade (a real broker, worker and gateway; a tiny Qwen2-VL)."""
from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("transformers")

import httpx  # noqa: E402

from common.multimodal import Qwen2VLImageConfig, load_image, preprocess_image  # noqa: E402
from tests.support.gateway_helpers import GENERATE, start_gateway  # noqa: E402
from tests.support.procs import ProcGroup, wait_for_workers  # noqa: E402
from tests.integration.test_mm_http import PREPROCESSOR, _data_url, _png  # noqa: E402
from tests.unit.engine.test_qwen2_vl_engine import IMAGE, VEND, VSTART, _build  # noqa: E402

IM_START, ENDOFTEXT, IM_END = 157, 158, 159
MAX_TOKENS = 6
WORKER_ARGS = ("--max-model-len", "256", "--max-num-seqs", "8", "--num-kv-blocks", "64", "--threads", "1")

# Qwen2-VL-7B-Instruct's template (tokenizer_config.json), without the default system message.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = {IMAGE: "<|image_pad|>", VSTART: "<|vision_start|>", VEND: "<|vision_end|>", IM_START: "<|im_start|>",
            ENDOFTEXT: "<|endoftext|>", IM_END: "<|im_end|>"}


def _write_tokenizer(out, template=CHAT_TEMPLATE) -> None:
    """The byte tokenizer with the Qwen2-VL special tokens on ids 150.. (bytes ASCII text never uses)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from worker.engine.loading.demo_model import _bytes_to_unicode

    vocab = {SPECIALS.get(b, ch): b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS.values()])
    (out / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    added = {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                      "single_word": False} for i, t in SPECIALS.items()}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
           "model_max_length": 512, "clean_up_tokenization_spaces": False, "added_tokens_decoder": added,
           "chat_template": template}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen2_vl_chat")
    _build("qwen2_vl", out)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    _write_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def http(tmp_path_factory, model_dir):
    with ProcGroup(tmp_path_factory.mktemp("mm-chat")) as procs:
        broker = procs.broker()
        procs.worker(broker, 0, "--model", str(model_dir), *WORKER_ARGS)
        wait_for_workers(broker.frontend, 1, timeout=120)
        gw = start_gateway(procs, broker.frontend, "--tokenizer", str(model_dir))
        with httpx.Client(base_url=gw.url, timeout=60) as client:
            yield client


def _chat(parts, **extra):
    return {"messages": [{"role": "user", "content": parts}], "temperature": 0, "max_tokens": MAX_TOKENS, **extra}


def _img(url):
    return {"type": "image_url", "image_url": {"url": url}}


def _n(png, model_dir) -> int:
    _, grid = preprocess_image(load_image(_data_url(png), allowed_local_media_path=None),
                               Qwen2VLImageConfig.from_model_dir(model_dir))
    return grid[0] * grid[1] * grid[2] // 4


def _expected_ids(model_dir, text_parts: list[str], pngs) -> list[int]:
    from common.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir, [IM_END])
    prompt = "<|im_start|>user\n"
    for text in text_parts:
        prompt += text
    prompt = prompt.format(*["<|vision_start|><|image_pad|><|vision_end|>"] * len(pngs))
    prompt += "<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(prompt, add_special_tokens=False)
    out, k = [], 0
    for t in ids:
        if t == IMAGE:
            out += [IMAGE] * _n(pngs[k], model_dir)
            k += 1
        else:
            out.append(t)
    assert k == len(pngs)
    return out


def test_render_then_generate_matches_the_facade(http, model_dir):
    png = _png(1, 56, 56)
    assert _n(png, model_dir) == 4
    url = _data_url(png)
    body = _chat([{"type": "text", "text": "look: "}, _img(url), {"type": "text", "text": " what?"}])
    resp = http.post("/v1/chat/completions/render", json=body)
    assert resp.status_code == 200, resp.text
    rendered = resp.json()
    assert rendered["token_ids"] == _expected_ids(model_dir, ["look: {} what?"], [png])
    assert rendered["token_ids"].count(IMAGE) == 4
    assert rendered["content_parts"] == [{"type": "image_url", "url": url}]

    gen = http.post(GENERATE, json=rendered)
    assert gen.status_code == 200, gen.text
    tokens = gen.json()["choices"][0]["token_ids"]
    assert 0 < len(tokens) <= MAX_TOKENS

    chat = http.post("/v1/chat/completions", json={**body, "return_token_ids": True})
    assert chat.status_code == 200, chat.text
    out = chat.json()
    assert out["choices"][0]["token_ids"] == tokens
    assert out["usage"]["prompt_tokens"] == len(rendered["token_ids"])
    # the image matters: another image, another prompt
    other = http.post("/v1/chat/completions/render",
                      json=_chat([{"type": "text", "text": "look: "}, _img(_data_url(_png(7, 56, 56))),
                                  {"type": "text", "text": " what?"}])).json()
    assert other["token_ids"] == rendered["token_ids"] and other["content_parts"] != rendered["content_parts"]


def test_two_images(http, model_dir):
    pngs = [_png(1, 56, 56), _png(2, 84, 56)]
    assert [_n(p, model_dir) for p in pngs] == [4, 6]
    body = _chat([_img(_data_url(pngs[0])), {"type": "text", "text": "and"}, _img(_data_url(pngs[1]))])
    rendered = http.post("/v1/chat/completions/render", json=body).json()
    assert rendered["token_ids"] == _expected_ids(model_dir, ["{}and{}"], pngs)
    assert [p["url"] for p in rendered["content_parts"]] == [_data_url(p) for p in pngs]
    gen = http.post(GENERATE, json={**rendered, "return_token_ids": True})
    assert gen.status_code == 200, gen.text
    assert len(gen.json()["mm_placeholders"]["image"]) == 2
    chat = http.post("/v1/chat/completions", json={**body, "return_token_ids": True})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["token_ids"] == gen.json()["choices"][0]["token_ids"]


def test_media_errors_are_400(http):
    for route in ("/v1/chat/completions/render", "/v1/chat/completions"):
        resp = http.post(route, json=_chat([_img("data:image/png;base64,@@not base64@@")]))
        assert resp.status_code == 400, resp.text
        assert "base64" in resp.json()["error"]["message"]
        resp = http.post(route, json=_chat([{"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AA=="}}]))
        assert resp.status_code == 400 and "'audio_url'" in resp.json()["error"]["message"], resp.text
        assert "text and image_url parts can be rendered" in resp.json()["error"]["message"]
        resp = http.post(route, json=_chat([{"type": "video_url", "video_url": {"url": "file:///x.mp4"}}]))
        assert resp.status_code == 400 and "'video_url'" in resp.json()["error"]["message"], resp.text
        resp = http.post(route, json=_chat([{"type": "image_url", "image_url": {}}]))
        assert resp.status_code == 400, resp.text
    # still serving
    ok = http.post("/v1/chat/completions", json=_chat("plain text"))
    assert ok.status_code == 200, ok.text


def test_tokenize_expands_images_as_render_does(http, model_dir):
    """vLLM's create_tokenize returns the processed prompt's token ids: each image's
    placeholder expanded to its tokens, counted in ``count``; token_strs name them."""
    pngs = [_png(1, 56, 56), _png(2, 84, 56)]
    messages = _chat([{"type": "text", "text": "look: "}, _img(_data_url(pngs[0])), {"type": "text", "text": "and"},
                      _img(_data_url(pngs[1]))])["messages"]
    rendered = http.post("/v1/chat/completions/render", json={"messages": messages})
    assert rendered.status_code == 200, rendered.text
    want = rendered.json()["token_ids"]
    assert want == _expected_ids(model_dir, ["look: {}and{}"], pngs) and want.count(IMAGE) == 4 + 6
    resp = http.post("/tokenize", json={"messages": messages, "return_token_strs": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["tokens"] == want
    assert body["count"] == len(want)
    assert body["max_model_len"] == 256
    assert len(body["token_strs"]) == len(want) and body["token_strs"].count("<|image_pad|>") == 10
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    # a bad image: vLLM's 400 error shape, the same words as the chat routes
    bad = http.post("/tokenize", json={"messages": _chat([_img("data:image/png;base64,@@not base64@@")])["messages"]})
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and "base64" in err["message"]
    bad = http.post("/tokenize", json={"messages": _chat([{"type": "image_url", "image_url": {}}])["messages"]})
    assert bad.status_code == 400, bad.text


def test_text_only_model_refuses_images(tmp_path_factory, model_dir):
    text_dir = tmp_path_factory.mktemp("text_only")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, text_dir / name)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("vision_config", None)
    config.pop("image_token_id", None)
    config.get("text_config", {}).pop("image_token_id", None)
    (text_dir / "config.json").write_text(json.dumps(config))
    with ProcGroup(tmp_path_factory.mktemp("text-render-only")) as procs:
        gw = start_gateway(procs, "tcp://127.0.0.1:9", "--render-only", "--tokenizer", str(text_dir),
                           "--max-model-len", "256")
        with httpx.Client(base_url=gw.url, timeout=30) as client:
            resp = client.post("/v1/chat/completions/render",
                               json=_chat([_img(_data_url(_png(1, 56, 56))), {"type": "text", "text": "hi"}]))
            assert resp.status_code == 400, resp.text
            assert "'image_url'" in resp.json()["error"]["message"]
            tokenized = client.post("/tokenize", json={"messages": _chat([_img(_data_url(_png(1, 56, 56)))])["messages"]})
            assert tokenized.status_code == 400, tokenized.text
            assert tokenized.json()["error"]["message"] == resp.json()["error"]["message"]
            ok = client.post("/v1/chat/completions/render", json=_chat([{"type": "text", "text": "hi"}]))
            assert ok.status_code == 200, ok.text
