"""Encoder disaggregation (worker/engine/disagg/ec_transfer.py) through real processes.

One broker (a tiny Qwen2-VL with a chat template), an encoder worker (rank 0,
``--ec-transfer-config`` ec_producer), a plain worker (rank 1), an encoder-only worker
(rank 2, ``--mm-encoder-only``), a gateway; requests pinned with X-data-parallel-rank, as vLLM's E/P/D
proxy runs them: the images go to the encoder worker, whose response names where each
encoder output can be read (ECCPUConnector's ec_transfer_params); the prompt then goes to
the other worker with metadata-only ``features`` (the grid, no pixels) and those params,
and its output equals encoding the images there.  Failed pulls are 400 / 503 with clear
messages, or fall back to the pixels when the request carries them."""
from __future__ import annotations

import json
import time

import httpx
import pytest
import torch

pytest.importorskip("transformers")

from common.multimodal import cache_key  # noqa: E402
from common.protocol import MultiModalItem  # noqa: E402
from tests.support.gateway_helpers import GENERATE, start_gateway  # noqa: E402
from tests.support.procs import ProcGroup, free_port, wait_for_workers  # noqa: E402
from tests.integration.test_mm_features import _features, _grid_elem, _item  # noqa: E402
from tests.integration.test_pd_transfer import _close  # noqa: E402
from tests.integration.test_mm_chat import WORKER_ARGS, _chat, _img, model_dir  # noqa: E402,F401
from tests.integration.test_mm_http import MAX_TOKENS, _body, _data_url, _part, _png, _prompt  # noqa: E402
from worker.engine.disagg.ec_transfer import EncoderExports, announce, parse_ec_transfer_config  # noqa: E402

PRODUCER = json.dumps({"ec_connector": "ECCPUConnector", "ec_role": "ec_producer"})
ENTRY_KEYS = {"item_indices", "metadata", "peer_host", "peer_port", "size_bytes", "shape", "remote_key"}


CONSUMER = json.dumps({"ec_connector": "ECCPUConnector", "ec_role": "ec_consumer"})


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dir):
    with ProcGroup(tmp_path_factory.mktemp("epd-stack")) as procs:
        broker = procs.broker()
        # A registered worker whose announced transfer server never answers (a producer that
        # is gone, as far as a pull can tell): the broker admits only registered peers.
        # Registered first, so that the model the broker reports is the real workers'.
        silent = free_port()
        procs.fake_worker(broker, 9, "--role", "encode", "--transfer-address", f"127.0.0.1:{silent}")
        wait_for_workers(broker.frontend, 1)
        procs.worker(broker, 0, "--model", str(model_dir), *WORKER_ARGS, "--ec-transfer-config", PRODUCER)
        # Takes client ec_transfer_params only as an ec_consumer.
        procs.worker(broker, 1, "--model", str(model_dir), *WORKER_ARGS, "--ec-transfer-config", CONSUMER)
        procs.worker(broker, 2, "--model", str(model_dir), *WORKER_ARGS, "--ec-transfer-config", PRODUCER,
                     "--mm-encoder-only")
        wait_for_workers(broker.frontend, 4, timeout=120)
        gw = start_gateway(procs, broker.frontend, "--tokenizer", str(model_dir))
        with httpx.Client(base_url=gw.url, timeout=60) as http:
            http.silent_port = silent
            yield http


def _post(http, rank: int, body: dict):
    return http.post(GENERATE, json=body, headers={"X-data-parallel-rank": str(rank)})


def _encode(http, ids, pngs) -> dict:
    """The encoder worker's leg: the images, one token; its response."""
    body = _body(ids, [_part(_data_url(p)) for p in pngs], return_token_ids=True)
    body["sampling_params"]["max_tokens"] = 1
    r = _post(http, 0, body)
    assert r.status_code == 200, r.text
    return r.json()


def _metadata_only(encoded: dict) -> tuple[dict, dict]:
    """What an orchestrator sends the next worker: features without pixels, and the
    encoder worker's ec_transfer_params."""
    ec = encoded["ec_transfer_params"]
    order = sorted(ec, key=lambda h: ec[h]["item_indices"][0])
    features = {"mm_hashes": {"image": order},
                "mm_placeholders": encoded["mm_placeholders"],
                "kwargs_data": None,
                "mm_metadata": {"image": [_item({"image_grid_thw": _grid_elem(ec[h]["metadata"]["image_grid_thw"])})
                                          for h in order]}}
    return features, ec


def _fbody(ids, features, ec, **params):
    return {"token_ids": ids, "features": features, "ec_transfer_params": ec,
            "sampling_params": {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **params}}


def _error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


def test_metadata_only_request_pulls_the_encoder_output(stack):
    http = stack
    pngs = [_png(21, 56, 56), _png(22, 84, 56)]
    ids = _prompt([4, 6])
    body = _body(ids, [_part(_data_url(p)) for p in pngs])
    body["sampling_params"]["logprobs"] = 1
    ref = _post(http, 1, {**body, "cache_salt": "ref"})
    assert ref.status_code == 200, ref.text
    ref = ref.json()["choices"][0]

    encoded = _encode(http, ids, pngs)
    ec = encoded["ec_transfer_params"]
    assert len(ec) == 2
    for index, (h, entry) in enumerate(sorted(ec.items(), key=lambda kv: kv[1]["item_indices"][0])):
        assert set(entry) == ENTRY_KEYS and entry["item_indices"] == [index]
        assert entry["peer_host"] == "127.0.0.1" and isinstance(entry["peer_port"], int)
        grid = entry["metadata"]["image_grid_thw"]
        rows = grid[0] * grid[1] * grid[2] // 4
        assert rows == encoded["mm_placeholders"]["image"][index]["length"]
        assert entry["shape"][0] == rows and entry["size_bytes"] == rows * entry["shape"][1] * 4  # float32

    features, ec = _metadata_only(encoded)
    r = _post(http, 1, _fbody(ids, features, ec, logprobs=1))
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["token_ids"] == ref["token_ids"]
    assert _close(ref["logprobs"], out["choices"][0]["logprobs"])
    assert out.get("ec_transfer_params") is None  # a consumer answers with none (as vLLM)

    # Again: now served from the consumer's encoder cache, same answer.
    again = _post(http, 1, {**_fbody(ids, features, ec), "cache_salt": "again"})
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["token_ids"] == ref["token_ids"]


def test_only_an_encoder_worker_answers_with_ec_transfer_params(stack):
    for rank in (0, 1):  # as vLLM: a request's own params are never echoed
        r = _post(stack, rank, {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2},
                                "ec_transfer_params": {"k": 1}})
        assert r.status_code == 200, r.text
        assert r.json()["ec_transfer_params"] is None


def test_unknown_output_is_a_400_and_a_gone_producer_a_503(stack):
    http = stack
    pngs = [_png(31, 56, 56)]
    ids = _prompt([4])
    features, ec = _metadata_only(_encode(http, ids, pngs))
    (h, entry), = ec.items()

    # An output the encoder worker never exported.
    features_x = {**features, "mm_hashes": {"image": ["never-encoded"]}}
    err = _error(_post(http, 1, _fbody(ids, features_x, {"never-encoded": {**entry, "remote_key": "nope#1x4x4"}})),
                 400)
    assert "unknown or evicted encoder output" in err["message"] and err["param"] == "ec_transfer_params"
    bad = {h: {k: v for k, v in entry.items() if k != "remote_key"}}
    assert "remote_key must be" in _error(_post(http, 1, _fbody(ids, features, bad)), 400)["message"]

    # A registered worker's transfer server that does not answer.
    t = time.monotonic()
    err = _error(_post(http, 1, _fbody(ids, features, {h: {**entry, "peer_port": http.silent_port}})), 503)
    assert "did not answer" in err["message"] and time.monotonic() - t < 8
    assert str(http.silent_port) not in err["message"]
    # A port no worker registered: refused by the broker, nothing echoed.
    port = free_port()
    err = _error(_post(http, 1, _fbody(ids, features, {h: {**entry, "peer_port": port}})), 400)
    assert "unknown transfer peer" in err["message"] and err["param"] == "ec_transfer_params"
    assert str(port) not in err["message"] and "127.0.0.1" not in err["message"]

    # An announcement that does not fit the placeholder.
    bad = {h: {**entry, "shape": [entry["shape"][0] + 1, entry["shape"][1]]}}
    assert "does not fit the image's 4 placeholder tokens" in _error(_post(http, 1, _fbody(ids, features, bad)),
                                                                      400)["message"]
    bad = {h: {**entry, "peer_port": "x"}}
    assert "peer_port must be an integer" in _error(_post(http, 1, _fbody(ids, features, bad)), 400)["message"]
    # No entry for a metadata-only item: refused by the gateway.
    assert "names no encoder worker" in _error(_post(http, 1, _fbody(ids, features, {"other": entry})),
                                               400)["message"]


def test_failed_pull_falls_back_to_the_pixels(stack, model_dir):
    http = stack
    pngs = [_png(41, 84, 56)]
    ids = _prompt([6])
    full = _features(model_dir, ids, pngs)  # pixels included (hash "hash0", not in any encoder cache yet)
    ref = _post(http, 1, {**_body(ids, [_part(_data_url(p)) for p in pngs]), "cache_salt": "fallback-ref"})
    assert ref.status_code == 200, ref.text
    # The announcement points nowhere: the worker encodes the pixels it was sent.
    hidden = next(iter(_encode(http, ids, pngs)["ec_transfer_params"].values()))["shape"][1]
    dead = {"hash0": {"item_indices": [0], "metadata": {"image_grid_thw": [1, 4, 6]}, "peer_host": "127.0.0.1",
                      "peer_port": http.silent_port, "size_bytes": 6 * hidden * 4, "shape": [6, hidden],
                      "remote_key": "features:hash0#1x4x6"}}
    t = time.monotonic()
    r = _post(http, 1, {**_fbody(ids, full, dead), "cache_salt": "fallback"})
    assert r.status_code == 200, r.text
    assert time.monotonic() - t > 2  # it did wait for the pull (3 s), then encoded
    assert r.json()["choices"][0]["token_ids"] == ref.json()["choices"][0]["token_ids"]


def test_chat_facade_passes_ec_transfer_params_both_ways(stack):
    http = stack
    parts = [{"type": "text", "text": "see "}, _img(_data_url(_png(51, 84, 56)))]
    enc = _post_chat(http, 0, {**_chat(parts), "max_tokens": 1})
    ec = enc["ec_transfer_params"]
    (h, entry), = ec.items()  # keyed by the gateway's content hash, which the next gateway computes too
    assert set(entry) == ENTRY_KEYS and entry["metadata"]["image_grid_thw"] == [1, 4, 6]
    plain = _post_chat(http, 1, {**_chat(parts), "return_token_ids": True, "cache_salt": "plain"})
    pulled = _post_chat(http, 1, {**_chat(parts), "return_token_ids": True, "cache_salt": "pulled",
                                  "ec_transfer_params": ec})
    assert pulled["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    assert pulled["choices"][0]["message"] == plain["choices"][0]["message"]
    assert pulled.get("ec_transfer_params") is None
    # The worker did look the image up in them: a wrong announcement is refused.
    bad = {h: {**entry, "shape": [1, entry["shape"][1]]}}
    r = http.post("/v1/chat/completions", json={**_chat(parts), "ec_transfer_params": bad},
                  headers={"X-data-parallel-rank": "1"})
    assert r.status_code == 400 and "does not fit the image's 6 placeholder tokens" in r.text, r.text


def _post_chat(http, rank: int, body: dict) -> dict:
    r = http.post("/v1/chat/completions", json=body, headers={"X-data-parallel-rank": str(rank)})
    assert r.status_code == 200, r.text
    return r.json()


def test_encoder_only_worker_encodes_and_stops(stack):
    http = stack
    pngs = [_png(81, 56, 56), _png(82, 84, 56)]
    ids = _prompt([4, 6])
    r = _post(http, 2, _body(ids, [_part(_data_url(p)) for p in pngs], return_token_ids=True))
    assert r.status_code == 200, r.text
    encoded = r.json()
    choice = encoded["choices"][0]
    assert choice["token_ids"] == [] and choice["finish_reason"] == "stop"
    assert encoded["usage"]["completion_tokens"] == 0 and encoded["usage"]["prompt_tokens"] == len(ids)
    assert sorted(e["item_indices"][0] for e in encoded["ec_transfer_params"].values()) == [0, 1]
    features, ec = _metadata_only(encoded)
    plain = _post(http, 1, {**_body(ids, [_part(_data_url(p)) for p in pngs]), "cache_salt": "enc-only-plain"})
    got = _post(http, 1, _fbody(ids, features, ec))
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]
    # What needs the language model is refused by name.
    body = _body(ids, [_part(_data_url(p)) for p in pngs])
    body["sampling_params"].update(n=2, temperature=1.0)
    err = _error(_post(http, 2, body), 400)
    assert "--mm-encoder-only" in err["message"] and "n must be 1" in err["message"]
    err = _error(_post(http, 2, _fbody(ids, features, ec)), 400)
    assert "no metadata-only items" in err["message"]
    # Unpinned requests never land on it (they would get no tokens).
    for k in range(12):
        r = http.post(GENERATE, json={"token_ids": [5, 6, 7 + k], "sampling_params": {"max_tokens": 2}})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2, r.text


# --- units ---------------------------------------------------------------------------------
def test_encoder_only_needs_an_ec_producer():
    from worker.engine.config import EngineConfig

    with pytest.raises(ValueError, match="--mm-encoder-only runs only the vision encoder"):
        EngineConfig(model="m", mm_encoder_only=True)
    assert EngineConfig(model="m", mm_encoder_only=True, ec_role="ec_both").enforce_eager


def test_ec_transfer_config():
    assert parse_ec_transfer_config(None) is None
    assert parse_ec_transfer_config(PRODUCER) == "ec_producer"
    with pytest.raises(ValueError, match="ECExampleConnector' is not supported"):
        parse_ec_transfer_config('{"ec_connector": "ECExampleConnector", "ec_role": "ec_producer"}')
    with pytest.raises(ValueError, match="ec_role must be one of"):
        parse_ec_transfer_config('{"ec_connector": "ECCPUConnector", "ec_role": "producer"}')
    with pytest.raises(ValueError, match="not JSON"):
        parse_ec_transfer_config("{")


def test_exports_drop_the_least_recent_and_announce_what_they_hold():
    exports = EncoderExports(max_bytes=10 * 3 * 4)  # 10 rows of 3 floats
    a, b = torch.ones(4, 3), torch.full((8, 3), 2.0)
    exports.put("features:a#1x4x4", a)
    a[0, 0] = 9  # a host copy: the encoder cache's tensor may change or go
    assert exports.get("features:a#1x4x4")[0, 0] == 1
    exports.put("b#1x4x8", b)  # 12 rows > 10: "a" goes
    assert "features:a#1x4x4" not in exports and exports.get("b#1x4x8") is not None
    items = [MultiModalItem("image", cache_key(h, g), 3 + 10 * i, n, g, b"", [], "remote")
             for i, (h, g, n) in enumerate([("features:a", [1, 4, 4], 4), ("b", [1, 4, 8], 8)])]
    out = announce(items, ["features:a", "b"], exports, "h", 7)
    assert out["a"] == {"item_indices": [0], "metadata": {}}  # gone: no address, media stays on the request
    assert out["b"] == {"item_indices": [1], "metadata": {"image_grid_thw": [1, 4, 8]}, "peer_host": "h",
                        "peer_port": 7, "size_bytes": 8 * 3 * 4, "shape": [8, 3], "remote_key": "b#1x4x8"}


def test_a_client_named_item_never_takes_an_images_export():
    """An image a client named H (features / uuid) and the image whose content hash is H
    are exported, announced and pulled under different keys (a client cannot plant an
    encoding under another image's name)."""
    exports = EncoderExports()
    planted, real = torch.full((4, 3), 7.0), torch.ones(4, 3)
    exports.put(cache_key("features:H", [1, 4, 4]), planted)
    exports.put(cache_key("H", [1, 4, 4]), real)
    item = MultiModalItem("image", cache_key("H", [1, 4, 4]), 3, 4, [1, 4, 4], b"", [], "uint8_hwc")
    key = announce([item], ["H"], exports, "h", 7)["H"]["remote_key"]
    assert torch.equal(exports.get(key), real)


def test_a_malformed_announcement_leaves_nothing_behind(model_dir):
    """A 400 at admission (bad ec_transfer_params) registers nothing: the same id can be
    sent again and the engine goes idle."""
    import numpy as np

    from common.errors import BadRequest
    from common.multimodal import Qwen2VLImageConfig, load_image, resize_image
    from common.protocol import GenerateRequest, SamplingParams
    from tests.support.engine_helpers import make_engine
    from tests.unit.engine.test_qwen2_vl_engine import IMAGE

    engine = make_engine(model_dir, tokens_only=True)
    cfg = Qwen2VLImageConfig.from_model_dir(model_dir)
    image = np.ascontiguousarray(resize_image(load_image(_data_url(_png(91, 56, 56)),
                                                         allowed_local_media_path=None), cfg))
    ids = _prompt([4])
    item = MultiModalItem("image", "content-91", ids.index(IMAGE), 4, [1, 4, 4], image.tobytes(), list(image.shape),
                          "uint8_hwc")

    def req(ec):
        return GenerateRequest(request_id="x", prompt_token_ids=ids, mm_items=[item], ec_transfer_params=ec,
                               params=SamplingParams(temperature=0.0, max_tokens=2))
    with pytest.raises(BadRequest, match="ec_transfer_params"):
        engine.add_request(req([1]))
    assert not engine.requests and not engine.has_unfinished()
    out = engine.generate([req(None)])
    assert len(out["x"][0].token_ids) == 2


def test_uuid_names_the_item_across_workers(stack):
    """vLLM's content-part ``uuid``: the client's identifier of the item is its mm_hash, so
    the encoder worker announces it under that name and features can use it."""
    http = stack
    pngs = [_png(61, 56, 56)]
    ids = _prompt([4])
    body = _body(ids, [{**_part(_data_url(pngs[0])), "uuid": "img-61"}], return_token_ids=True)
    body["sampling_params"]["max_tokens"] = 1
    r = _post(http, 0, body)
    assert r.status_code == 200, r.text
    encoded = r.json()
    assert list(encoded["ec_transfer_params"]) == ["img-61"]
    features, ec = _metadata_only(encoded)
    assert features["mm_hashes"] == {"image": ["img-61"]}
    plain = _post(http, 1, {**_body(ids, [_part(_data_url(pngs[0]))]), "cache_salt": "uuid-plain"})
    got = _post(http, 1, _fbody(ids, features, ec))
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]
    # Only a uuid (a reference to a cached item) is refused by name; so is a uuid that is no string.
    msg = _error(_post(http, 1, _body(ids, [{"type": "image_url", "uuid": "img-61"}])), 400)["message"]
    assert "given only by its uuid" in msg
    msg = _error(_post(http, 1, _body(ids, [{**_part(_data_url(pngs[0])), "uuid": 7}])), 400)["message"]
    assert "`uuid` must be a non-empty string" in msg


def test_chat_image_uuid_reaches_the_rendered_content_parts(stack):
    parts = [{"type": "text", "text": "see "}, {**_img(_data_url(_png(62, 56, 56))), "uuid": "img-62"}]
    r = stack.post("/v1/chat/completions/render", json={"messages": _chat(parts)["messages"]})
    assert r.status_code == 200, r.text
    assert [p.get("uuid") for p in r.json()["content_parts"]] == ["img-62"]
    enc = _post_chat(stack, 0, {**_chat(parts), "max_tokens": 1})
    assert list(enc["ec_transfer_params"]) == ["img-62"]
    r = stack.post("/v1/chat/completions", json=_chat([{"type": "image_url", "uuid": "img-62"}]))
    assert r.status_code == 400 and "given only by its uuid" in r.text, r.text


def test_malformed_announcements_never_hurt_a_worker(stack, model_dir):
    """Random ec_transfer_params on image requests (metadata-only items, and items with
    pixels): 200, 400 or 503, never a 500, and both workers keep serving."""
    import random

    http = stack
    rnd = random.Random(7)
    pngs = [_png(71, 56, 56)]
    ids = _prompt([4])
    meta_only, ec = _metadata_only(_encode(http, ids, pngs))
    (h, entry), = ec.items()
    with_pixels = _features(model_dir, ids, pngs)  # hash "hash0"
    junk = [None, True, 0, -1, 1.5, "", "x" * 300, [], [1], {}, {"a": 1}, [entry["shape"][0], "64"],
            [entry["shape"][0], entry["shape"][1], 1], [True, entry["shape"][1]], 70000, "127.0.0.1", "::1", "a b"]
    statuses = set()
    for k in range(60):
        bad = dict(entry)
        for field in rnd.sample(["peer_host", "peer_port", "shape", "size_bytes", "metadata", "item_indices"],
                                rnd.randint(1, 3)):
            bad[field] = rnd.choice(junk)
        features, name = (with_pixels, "hash0") if rnd.random() < 0.3 else (meta_only, h)
        params = rnd.choice([{name: bad}, {name: [bad]}, [bad], "x", {name: bad, "other": bad}])
        body = _fbody(ids, features, params)
        body["sampling_params"]["max_tokens"] = 2
        r = _post(http, 1, body)
        assert r.status_code in (200, 400, 503), (k, params, r.text)
        statuses.add(r.status_code)
    assert 400 in statuses
    for rank in (0, 1):  # both workers still answer
        assert _post(http, rank, {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}}).status_code == 200


def test_a_model_without_vision_cannot_export_encodings(llama_dir):
    from tests.support.engine_helpers import make_engine

    with pytest.raises(ValueError, match="has no vision encoder to export outputs of"):
        make_engine(llama_dir, ec_role="ec_producer")
