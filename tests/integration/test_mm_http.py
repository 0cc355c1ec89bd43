"""Image input over HTTP: ``content_parts`` on /inference/v1/generate, end to end (a real
broker, a real worker serving a tiny Qwen2-VL, a gateway given the model folder).

The gateway loads and preprocesses the images; the greedy tokens must equal the
in-process engine given the same images as ``mm_items``."""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

pytest.importorskip("transformers")

import httpx  # noqa: E402
from PIL import Image  # noqa: E402

from common.multimodal import Qwen2VLImageConfig, load_image, mm_hash, preprocess_image  # noqa: E402
from common.protocol import GenerateRequest, MultiModalItem, SamplingParams  # noqa: E402
from tests.support.engine_helpers import make_engine  # noqa: E402
from tests.support.gateway_helpers import GENERATE, metric_value, sse_payloads, start_gateway, wait_metric  # noqa: E402
from tests.support.model_factory import write_tokenizer  # noqa: E402
from tests.support.procs import ProcGroup, wait_for_workers  # noqa: E402
from tests.unit.engine.test_qwen2_vl_engine import IMAGE, VEND, VSTART, _build  # noqa: E402

# Small pixel bounds: a 56x56 image is a 4x4 patch grid -> 4 placeholders, 84x56 -> 6.
PREPROCESSOR = {"min_pixels": 56 * 56, "max_pixels": 112 * 112, "patch_size": 14, "merge_size": 2,
                "temporal_patch_size": 2}
WORKER_ARGS = ("--max-model-len", "256", "--max-num-seqs", "8", "--num-kv-blocks", "64", "--threads", "1",
               "--tokens-only")
MAX_TOKENS = 6


def _png(seed: int, width: int, height: int) -> bytes:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _prompt(counts: list[int]) -> list[int]:
    ids = [5, 17, 33]
    for k, n in enumerate(counts):
        ids += [40 + k, VSTART] + [IMAGE] * n + [VEND]
    return ids + [61, 62, 63]


def _body(ids, parts, **extra):
    return {"token_ids": ids, "content_parts": parts,
            "sampling_params": {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}, **extra}


def _part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen2_vl_http")
    _build("qwen2_vl", out)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    write_tokenizer(out)  # the gateway's text side wants one; the worker serves tokens only
    return out


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    allowed = root / "allowed"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(_png(1, 56, 56))
    (root / "outside.png").write_bytes(_png(1, 56, 56))
    return root


@pytest.fixture(scope="module")
def gw(tmp_path_factory, model_dir, media):
    with ProcGroup(tmp_path_factory.mktemp("mm-stack")) as procs:
        broker = procs.broker()
        procs.worker(broker, 0, "--model", str(model_dir), *WORKER_ARGS)
        wait_for_workers(broker.frontend, 1, timeout=120)
        gw = start_gateway(procs, broker.frontend, "--tokenizer", str(model_dir),
                           "--allowed-local-media-path", str(media / "allowed"))
        with httpx.Client(base_url=gw.url, timeout=60) as http:
            yield procs, http


def _engine_tokens(model_dir, ids, pngs) -> list[int]:
    cfg = Qwen2VLImageConfig.from_model_dir(model_dir)
    runs = [i for i, t in enumerate(ids) if t == IMAGE and (i == 0 or ids[i - 1] != IMAGE)]
    items = []
    for offset, png in zip(runs, pngs):
        pixels, grid = preprocess_image(load_image(_data_url(png), allowed_local_media_path=None), cfg)
        n = grid[0] * grid[1] * grid[2] // 4
        items.append(MultiModalItem(modality="image", mm_hash=mm_hash(pixels, grid), offset=offset, length=n,
                                    grid_thw=list(grid), pixel_values=np.ascontiguousarray(pixels, "<f4").tobytes(),
                                    shape=list(pixels.shape)))
    engine = make_engine(model_dir, tokens_only=True)
    req = GenerateRequest(request_id="ref", prompt_token_ids=list(ids), mm_items=items,
                          params=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return engine.generate([req])["ref"][0].token_ids


def _error(resp, status=400) -> str:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]["message"]


def test_data_url_images_match_the_engine(gw, model_dir):
    _, http = gw
    pngs = [_png(1, 56, 56), _png(2, 84, 56)]
    ids = _prompt([4, 6])
    expected = _engine_tokens(model_dir, ids, pngs)
    parts = [_part(_data_url(p)) for p in pngs]
    ranges = [{"offset": ids.index(IMAGE), "length": 4}, {"offset": len(ids) - 3 - 1 - 6, "length": 6}]

    resp = http.post(GENERATE, json=_body(ids, parts, return_token_ids=True))
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["choices"][0]["token_ids"] == expected
    assert out["prompt_token_ids"] == ids
    assert out["mm_placeholders"] == {"image": ranges}

    # vLLM's own part shape ({"type", "url"}); without return_token_ids no placeholders
    vllm_parts = [{"type": "image_url", "url": _data_url(p)} for p in pngs]
    out = http.post(GENERATE, json=_body(ids, vllm_parts)).json()
    assert out["choices"][0]["token_ids"] == expected
    assert out["mm_placeholders"] is None

    resp = http.post(GENERATE, json=_body(ids, parts, return_token_ids=True, stream=True))
    assert resp.status_code == 200, resp.text
    chunks = [json.loads(p) for p in sse_payloads(resp)[:-1]]
    assert chunks[0]["prompt_token_ids"] == ids
    assert chunks[0]["mm_placeholders"] == {"image": ranges}
    assert all("mm_placeholders" not in c for c in chunks[1:])
    assert [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]] == expected
    # vLLM's multimodal cache counters: the first request encoded both images (2 misses);
    # the later ones found the image past the prefix-cached block in the encoder cache
    hits = wait_metric(str(http.base_url), "vllm:mm_cache_hits_total", 2, engine="0")
    queries = metric_value(http.get("/metrics").text, "vllm:mm_cache_queries_total", engine="0")
    assert hits == 2 and queries - hits == 2, (queries, hits)


def test_file_urls_and_refusals(gw, media):
    procs, http = gw
    ids = _prompt([4])
    ok = http.post(GENERATE, json=_body(ids, [_part((media / "allowed" / "a.png").as_uri())]))
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"][0]["token_ids"]) == MAX_TOKENS

    assert "must be a subpath" in _error(http.post(GENERATE, json=_body(ids, [_part((media / "outside.png").as_uri())])))
    assert "base64" in _error(http.post(GENERATE, json=_body(ids, [_part("data:image/png;base64,@@not base64@@")])))
    assert "audio_url input is not supported yet" in _error(
        http.post(GENERATE, json=_body(ids, [{"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AA=="}}])))
    msg = _error(http.post(GENERATE, json=_body(_prompt([5]), [_part(_data_url(_png(1, 56, 56)))])))
    assert "placeholder count mismatch: image 0 has 5 placeholder tokens in token_ids" in msg and "needs 4" in msg
    assert "2 run(s)" in _error(http.post(GENERATE, json=_body(_prompt([4, 4]), [_part(_data_url(_png(1, 56, 56)))])))
    assert "`features` is not supported" in _error(http.post(GENERATE, json={
        "token_ids": ids, "sampling_params": {}, "features": {"mm_hashes": {"image": ["h"]}}}))
    assert "http(s) URLs is disabled" in _error(http.post(GENERATE, json=_body(ids, [_part("http://127.0.0.1:1/x.png")])))

    # everyone is still up and serves
    assert all(p.alive() for p in procs.procs), procs.tails()
    plain = http.post(GENERATE, json={"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3}})
    assert plain.status_code == 200, plain.text
    again = http.post(GENERATE, json=_body(ids, [_part((media / "allowed" / "a.png").as_uri())]))
    assert again.json()["choices"][0]["token_ids"] == ok.json()["choices"][0]["token_ids"]


def test_image_conversations_follow_their_cache(tmp_path_factory, model_dir):
    """Two workers, cache-aware routing: the gateway's routing keys fold each image in as
    the workers' block hashes do, so every later turn of a conversation with an image
    goes to the worker holding its history, image blocks included."""
    import random
    import time

    rng = random.Random(7)
    with ProcGroup(tmp_path_factory.mktemp("mm-routing")) as procs:
        broker = procs.broker("--routing", "cache-aware")
        for rank in range(2):
            procs.worker(broker, rank, "--model", str(model_dir), *WORKER_ARGS)
        wait_for_workers(broker.frontend, 2, timeout=120)
        gw = start_gateway(procs, broker.frontend, "--tokenizer", str(model_dir), "--enable-prompt-tokens-details")
        with httpx.Client(base_url=gw.url, timeout=60) as http:
            convs = []
            for c in range(4):  # a different 84x56 image (6 placeholders) per conversation
                ids = [rng.randrange(3, 140) for _ in range(20)] + [VSTART] + [IMAGE] * 6 + [VEND]
                convs.append((ids + [rng.randrange(3, 140) for _ in range(20)], _data_url(_png(100 + c, 84, 56))))
            cached = []
            for turn in range(3):
                for history, url in convs:
                    r = http.post(GENERATE, json=_body(history, [_part(url)]))
                    assert r.status_code == 200, r.text
                    body = r.json()
                    if turn:
                        cached.append((body["usage"]["prompt_tokens_details"]["cached_tokens"], len(history)))
                    history += body["choices"][0]["token_ids"] + [rng.randrange(3, 140) for _ in range(10)]
                time.sleep(0.3)  # the workers' KV events reach the broker
            time.sleep(0.5)  # past the gateway's cluster-info cache
            routed = metric_value(http.get("/metrics").text, "tokserve:broker_requests_prefix_routed_total")
        assert routed >= len(cached)  # each later turn matched its history's keys, image blocks included
        # the previous turn's prompt + output are cached on one worker: at least its full
        # blocks (the image's two blocks among them) are hits every time
        assert all(c >= (n - 10 - MAX_TOKENS) // 16 * 16 - 16 and c >= 32 for c, n in cached), cached
        log = broker.log_path.read_text(errors="replace")
        assert "Traceback" not in log, log[-2000:]


def test_limit_mm_per_prompt(gw, model_dir):
    """vLLM's --limit-mm-per-prompt: more images than allowed is a 400 with vLLM's message,
    before any image is loaded; as many as allowed are served."""
    from tests.support.procs import BrokerProc

    procs, _ = gw
    broker = next(p for p in procs.procs if isinstance(p, BrokerProc))
    limited = start_gateway(procs, broker.frontend, "--tokenizer", str(model_dir),
                            "--limit-mm-per-prompt", '{"image": {"count": 1}}')
    with httpx.Client(base_url=limited.url, timeout=60) as http:
        two = _body(_prompt([4, 4]), [_part("data:image/png;base64,never-decoded")] * 2)
        resp = http.post(GENERATE, json=two)
        assert resp.status_code == 400
        assert resp.json()["error"] == {"message": "At most 1 image(s) may be provided in one prompt.",
                                        "type": "BadRequestError", "param": "image", "code": 400}
        chat = {"messages": [{"role": "user", "content": [_part(_data_url(_png(1, 56, 56)))] * 2}]}
        for route in ("/v1/chat/completions", "/v1/chat/completions/render", "/tokenize"):
            resp = http.post(route, json=chat)
            assert resp.status_code == 400 and "At most 1 image(s)" in resp.json()["error"]["message"], route
        resp = http.post(GENERATE, json=_body(_prompt([4]), [_part(_data_url(_png(1, 56, 56)))]))
        assert resp.status_code == 200, resp.text
