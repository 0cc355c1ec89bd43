"""Real RL clients against a real stack (broker, one worker, gateways): each test replays
the exact requests a client library sends and parses the answer as the library does.

The requests and the parsing are captured from the libraries' source:

* TRL 1.16 ``trl/generation/vllm_client.py``: ``VLLMClient.generate`` (``/v1/completions``
  with ``return_token_ids`` and ``return_tokens_as_token_ids``), ``VLLMClient.chat``
  (``/v1/chat/completions``, same flags), ``parse_logprobs`` (``int(token.removeprefix
  ("token_id:"))``), ``get_server_info`` (``GET /server_info?config_format=json``, reads
  ``vllm_config["weight_transfer_config"]``) and ``init_communicator``'s check.
* SkyRL's ``RemoteInferenceClient`` (``skyrl/backends/.../remote_inference_client.py``):
  ``/collective_rpc`` bodies ``{"method": "skyrl_start_weight_update", "kwargs":
  {"is_checkpoint_format": true}}``, ``{"method": "skyrl_finish_weight_update"}``,
  ``{"method": "skyrl_sleep_for_weight_sync", "kwargs": {"offload_kv": ...}}``,
  ``{"method": "skyrl_wake_for_weight_sync", "kwargs": {"tags": [...]}}``; it reads
  ``body["results"]``.
* AReaL parses chat logprob tokens the same way as TRL (``int(tok.split(":")[1])``).
* TRL 1.16 weight sync: ``VLLMClient.init_communicator`` / ``weight_update`` /
  ``update_named_params`` / ``reset_prefix_cache`` / ``close_communicator``, and the async GRPO
  client (trl/experimental/async_grpo/vllm_client.py, weight_transfer.py): ``pause``,
  ``start_weight_update``, ``update_weights``, ``finish_weight_update``, ``resume``,
  ``load_lora_adapter``, ``unload_lora_adapter``.  The trainer's NCCL group is replayed over
  gloo with common.dist_weight_transfer.TrainerWeightSender (same packed broadcast).
* SkyRL's ``RemoteInferenceClient`` (PyPI ``skyrl`` 0.3.0, the newest published):
  ``_generate_single``, ``sample`` (n > 1, prompt logprobs), ``pause`` / ``resume`` /
  ``sleep`` / ``wake_up`` / ``reset_prefix_cache`` / ``get_world_size`` (``_call_server``),
  ``start_weight_update`` / ``update_weights_nccl`` / ``finish_weight_update`` with the
  broadcast strategy's ``init_info``, and a checkpoint reload between start and finish.
"""
from __future__ import annotations

import json
import math
import threading

import httpx
import pytest

from tests.integration.test_openai_http import build_chat_model
from tests.support.gateway_helpers import GENERATE, sse_payloads, start_gateway
from tests.support.procs import ProcGroup, wait_for, wait_for_workers

API_KEY = "clients-secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 512
WORKER_ARGS = ("--max-num-seqs", "8", "--num-kv-blocks", "128", "--threads", "1",
               "--max-model-len", str(MAX_MODEL_LEN))
PROMPT_IDS = [[72, 101, 108, 108, 111], [66, 121, 101, 32]]


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("clients-models")
    return (build_chat_model(tiny_model("qwen3", 0), root / "a"),
            build_chat_model(tiny_model("qwen3", 1), root / "b"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory, models):
    a, _ = models
    with ProcGroup(tmp_path_factory.mktemp("clients-stack")) as procs:
        broker = procs.broker()
        procs.worker(broker, 0, "--model", str(a), *WORKER_ARGS)
        wait_for_workers(broker.frontend, 1, timeout=120)
        rl = start_gateway(procs, broker.frontend, "--tokenizer", str(a), "--enable-rl", "--api-key", API_KEY)
        plain = start_gateway(procs, broker.frontend, "--tokenizer", str(a), "--return-tokens-as-token-ids")
        with httpx.Client(base_url=rl.url, timeout=120, headers=AUTH) as http, \
                httpx.Client(base_url=plain.url, timeout=60) as plain_http:
            yield http, plain_http


@pytest.fixture(autouse=True)
def _stack_left_serving(request):
    """Every test leaves the shared stack unpaused and awake, even one that failed between a
    pause and its resume: otherwise one failure would hang or fail every later test."""
    yield
    if "stack" not in request.fixturenames:
        return
    http, _ = request.getfixturevalue("stack")
    if http.get("/is_paused").json().get("is_paused"):
        http.post("/resume")
    if http.get("/is_sleeping").json().get("is_sleeping"):
        http.post("/wake_up")


# ------------------------------------------------------------------ TRL's parsing
def trl_parse_logprobs(choices_logprobs):
    """TRL 1.16 ``parse_logprobs``, as written there."""
    if choices_logprobs[0] is None:
        return None, None
    all_logprobs, all_token_ids = [], []
    for logprobs in choices_logprobs:
        if "content" in logprobs:
            positions = [(e["token"], e["logprob"], {t["token"]: t["logprob"] for t in e["top_logprobs"]})
                         for e in logprobs["content"]]
        else:
            positions = list(zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"],
                                 strict=True))
        seq_logprobs, seq_token_ids = [], []
        for token, logprob, top_logprobs in positions:
            top_logprobs = {token: logprob, **(top_logprobs or {})}
            items = sorted(top_logprobs.items(), key=lambda item: -item[1])
            seq_token_ids.append([int(token.removeprefix("token_id:")) for token, _ in items])
            seq_logprobs.append([None if math.isnan(lp) else lp for _, lp in items])
        all_logprobs.append(seq_logprobs)
        all_token_ids.append(seq_token_ids)
    return all_logprobs, all_token_ids


def trl_generate_payload(model, prompts, n=2, logprobs=2, max_tokens=8):
    """``VLLMClient.generate``'s body (its defaults: temperature 1.0, top_p 1, top_k -1, min_p 0)."""
    return {"model": model, "prompt": prompts, "return_token_ids": True, "return_tokens_as_token_ids": True,
            "n": n, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
            "max_tokens": max_tokens, "logprobs": logprobs, "seed": 7}


def model_id(http):
    return http.get("/v1/models").json()["data"][0]["id"]


# ------------------------------------------------------------------ AReaL's parsing
def areal_generation_payload(input_ids, max_new_tokens=8, greedy=True):
    """AReaL 1.0.4 ``VLLMBackend.build_generation_request`` (areal/engine/vllm_remote.py) with
    its GenerationHyperparameters defaults: a flat vLLM payload, ``use_beam_search: false``."""
    return {"top_p": 1.0, "top_k": int(1e8), "max_tokens": max_new_tokens, "temperature": 0.0 if greedy else 1.0,
            "stop_token_ids": [], "ignore_eos": False, "skip_special_tokens": True,
            "return_tokens_as_token_ids": True, "logprobs": 0, "use_beam_search": False, "stream": False,
            "prompt": list(input_ids)}


def areal_parse_generation_response(response):
    """AReaL 1.0.4 ``VLLMBackend.parse_generation_response``, as written there."""
    meta_info = response["choices"][0]
    if "tokens" in meta_info["logprobs"]:
        output_tokens = [int(t.split(":")[1]) for t in meta_info["logprobs"]["tokens"]]
        output_logprobs = meta_info["logprobs"]["token_logprobs"]
    elif "content" in meta_info["logprobs"]:
        outputs = meta_info["logprobs"]["content"]
        output_tokens = [int(t["token"].split(":")[1]) for t in outputs]
        output_logprobs = [t["logprob"] for t in outputs]
    else:
        raise ValueError("Unexpected vLLM response format.")
    return output_tokens, output_logprobs, meta_info["finish_reason"]


def test_areal_completions_and_chat_requests(stack):
    """AReaL's two request shapes (token ids -> /v1/completions; messages -> /v1/chat/completions
    with ``logprobs: true``) parse into the ids the server generated."""
    http, _ = stack
    r = http.post("/v1/completions", json=areal_generation_payload(PROMPT_IDS[0]))
    assert r.status_code == 200, r.text
    tokens, logprobs, finish = areal_parse_generation_response(r.json())
    assert len(tokens) == len(logprobs) == 8 and finish == "length"
    plain = http.post("/v1/completions", json={**areal_generation_payload(PROMPT_IDS[0]),
                                               "return_token_ids": True}).json()["choices"][0]
    assert tokens == plain["token_ids"]

    chat = {**areal_generation_payload(PROMPT_IDS[0]), "logprobs": True,
            "messages": [{"role": "user", "content": "Hello"}]}
    chat.pop("prompt")
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    tokens, logprobs, _ = areal_parse_generation_response(r.json())
    again = http.post("/v1/chat/completions", json={**chat, "return_tokens_as_token_ids": False,
                                                    "return_token_ids": True}).json()["choices"][0]
    assert tokens == again["token_ids"] and len(tokens) == len(logprobs) == 8


# ------------------------------------------------------------------ return_tokens_as_token_ids
def test_trl_generate_completions_token_ids(stack):
    http, _ = stack
    model = model_id(http)
    body = trl_generate_payload(model, PROMPT_IDS)
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 4
    prompt_ids = [c["prompt_token_ids"] for c in choices[::2]]
    assert prompt_ids == PROMPT_IDS
    logprobs, token_ids = trl_parse_logprobs([c["logprobs"] for c in choices])
    for c, lps, ids in zip(choices, logprobs, token_ids):
        assert len(ids) == len(c["token_ids"]) == 8
        # the sampled token is among each position's entries, and every entry parsed as an id
        for pos_ids, pos_lps, sampled in zip(ids, lps, c["token_ids"]):
            assert sampled in pos_ids and 1 <= len(pos_ids) <= 3
            assert pos_lps == sorted(pos_lps, reverse=True)
        lp = c["logprobs"]
        assert lp["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
        assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)
        # vLLM's text_offset counts the placeholder strings
        offsets = [0]
        for tok in lp["tokens"][:-1]:
            offsets.append(offsets[-1] + len(tok))
        assert lp["text_offset"] == offsets

    # Same request without the flag: same ids and logprobs, decoded token strings.
    plain = http.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()["choices"]
    for a, b in zip(choices, plain):
        assert a["token_ids"] == b["token_ids"]
        assert a["logprobs"]["token_logprobs"] == b["logprobs"]["token_logprobs"]
        assert not any(t.startswith("token_id:") for t in b["logprobs"]["tokens"])


def test_server_default_return_tokens_as_token_ids(stack):
    """vLLM's --return-tokens-as-token-ids: the default when the request leaves the field out."""
    _, plain = stack
    body = {"model": model_id(plain), "prompt": PROMPT_IDS[0], "max_tokens": 3, "temperature": 0, "logprobs": 1,
            "return_token_ids": True}
    c = plain.post("/v1/completions", json=body).json()["choices"][0]
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
    c = plain.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()["choices"][0]
    assert not any(t.startswith("token_id:") for t in c["logprobs"]["tokens"])
    # vLLM's /inference/v1/generate in text mode: placeholders without bytes at every level
    r = plain.post(GENERATE, json={"token_ids": PROMPT_IDS[0], "output_mode": "text",
                                   "sampling_params": {"max_tokens": 3, "temperature": 0, "logprobs": 1}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(e["bytes"] is None and all(t["bytes"] is None and t["token"].startswith("token_id:")
                                          for t in e["top_logprobs"]) for e in content)


def test_completions_echo_token_ids(stack):
    http, _ = stack
    body = {"model": model_id(http), "prompt": PROMPT_IDS[0], "max_tokens": 3, "temperature": 0, "echo": True,
            "logprobs": 1, "return_tokens_as_token_ids": True, "return_token_ids": True}
    c = http.post("/v1/completions", json=body).json()["choices"][0]
    tokens = c["logprobs"]["tokens"]
    assert tokens == [f"token_id:{t}" for t in PROMPT_IDS[0] + c["token_ids"]]
    assert c["logprobs"]["token_logprobs"][0] is None


def test_trl_chat_token_ids(stack):
    http, _ = stack
    model = model_id(http)
    payload = {"model": model, "n": 2, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
               "min_p": 0.0, "max_tokens": 6, "logprobs": True, "top_logprobs": 2, "return_token_ids": True,
               "return_tokens_as_token_ids": True, "seed": 11}
    messages = [{"role": "user", "content": "Hi there"}]
    r = http.post("/v1/chat/completions", json={**payload, "messages": messages})
    assert r.status_code == 200, r.text
    response = r.json()
    assert response["prompt_token_ids"]
    choices = response["choices"]
    _, token_ids = trl_parse_logprobs([c["logprobs"] for c in choices])
    plain = http.post("/v1/chat/completions", json={**payload, "messages": messages,
                                                     "return_tokens_as_token_ids": False}).json()["choices"]
    for c, ids, p in zip(choices, token_ids, plain):
        assert all(t in pos for pos, t in zip(ids, c["token_ids"]))
        assert c["token_ids"] == p["token_ids"]
        for e, pe, t in zip(c["logprobs"]["content"], p["logprobs"]["content"], c["token_ids"]):
            assert e["token"] == f"token_id:{t}"
            # vLLM: the sampled entry's bytes are its decoded text's, the top entries' their strings'
            assert e["bytes"] == pe["bytes"] == list(pe["token"].encode("utf-8"))
            assert len(e["top_logprobs"]) == 2
            for top in e["top_logprobs"]:
                assert top["token"].startswith("token_id:")
                assert top["bytes"] == list(top["token"].encode("utf-8"))
            assert [x["logprob"] for x in e["top_logprobs"]] == [x["logprob"] for x in pe["top_logprobs"]]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_stream_token_ids(stack, route):
    http, _ = stack
    common = {"model": model_id(http), "max_tokens": 6, "temperature": 0, "stream": True, "logprobs": True,
              "return_tokens_as_token_ids": True, "return_token_ids": True}
    if route == "chat":
        body = {**common, "messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 1}
    else:
        body = {**common, "prompt": PROMPT_IDS[1], "logprobs": 1}
    r = http.post(f"/v1/{'chat/' if route == 'chat' else ''}completions", json=body)
    assert r.status_code == 200, r.text
    ids, tokens = [], []
    for payload in sse_payloads(r):
        if payload == "[DONE]":
            continue
        for c in json.loads(payload)["choices"]:
            ids.extend(c.get("token_ids") or [])
            lp = c.get("logprobs")
            if lp:
                tokens.extend([e["token"] for e in lp["content"]] if route == "chat" else lp["tokens"])
    assert len(ids) == 6
    assert tokens == [f"token_id:{t}" for t in ids]


# ------------------------------------------------------------------ /server_info
def test_trl_server_info(stack):
    http, _ = stack
    r = http.get("/server_info", params={"config_format": "json"})
    assert r.status_code == 200, r.text
    config = r.json()["vllm_config"]
    # TRL's init_communicator check
    assert config["weight_transfer_config"] == {"backend": "gloo"}  # CPU workers: NCCL's protocol over gloo
    assert config["model_config"]["dtype"] == "torch.float32"  # --dtype auto on a CPU worker
    assert config["model_config"]["logprobs_mode"] == "raw_logprobs"
    assert config["model_config"]["max_model_len"] == MAX_MODEL_LEN
    assert config["model_config"]["model"] == model_id(http)
    assert config["lora_config"] is None
    assert config["parallel_config"]["data_parallel_size"] == http.get("/get_world_size").json()["world_size"] == 1
    assert config["parallel_config"]["tensor_parallel_size"] == 1
    assert config["scheduler_config"]["max_num_seqs"] == 8
    text = http.get("/server_info").json()
    assert isinstance(text["vllm_config"], str) and f"max_model_len={MAX_MODEL_LEN}" in text["vllm_config"]
    assert set(text) == {"vllm_config", "vllm_env", "system_env"}
    bad = http.get("/server_info", params={"config_format": "yaml"})
    assert bad.status_code == 400 and "config_format" in bad.json()["error"]["message"]
    assert httpx.get(str(http.base_url) + "/server_info", timeout=10).status_code == 401


# ------------------------------------------------------------------ /collective_rpc
def rpc(http, body):
    r = http.post("/collective_rpc", json=body)
    assert r.status_code == 200, r.text
    return r.json()["results"]


def greedy(http, max_tokens=8):
    body = {"model": model_id(http), "prompt": PROMPT_IDS[0], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    return http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"]


class _Stream(threading.Thread):
    """A streaming completion through the gateway: its token ids and finish reason."""

    def __init__(self, http, max_tokens):
        super().__init__(daemon=True)
        self.body = {"model": model_id(http), "prompt": PROMPT_IDS[1], "max_tokens": max_tokens, "temperature": 0,
                     "ignore_eos": True, "stream": True, "return_token_ids": True}
        self.url, self.headers = str(http.base_url), dict(AUTH)
        self.tokens: list[int] = []
        self.finish = self.error = None

    def run(self):
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=self.body, headers=self.headers,
                              timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        for c in json.loads(line[6:])["choices"]:
                            self.tokens.extend(c.get("token_ids") or [])
                            self.finish = c.get("finish_reason") or self.finish
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def test_skyrl_weight_sync_over_collective_rpc(stack, models):
    """SkyRL's non-colocated sync: pause(keep), sleep for the sync, wake the weights, the
    update, wake the KV cache, resume; a rollout in flight is frozen, never aborted."""
    http, _ = stack
    a, b = models
    before = greedy(http)
    total = 300
    stream = _Stream(http, total)
    stream.start()
    wait_for(lambda: len(stream.tokens) >= 3 or stream.error is not None, 60, "the stream to start")
    assert http.post("/pause", params={"mode": "keep", "clear_cache": "false"}).status_code == 200
    assert len(stream.tokens) < total and stream.finish is None  # frozen mid-rollout
    assert rpc(http, {"method": "skyrl_sleep_for_weight_sync", "kwargs": {"offload_kv": True}}) == [None]
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    assert rpc(http, {"method": "skyrl_wake_for_weight_sync", "kwargs": {"tags": ["weights"]}}) == [None]
    assert rpc(http, {"method": "skyrl_start_weight_update", "kwargs": {"is_checkpoint_format": True}}) == [None]
    # vLLM's own worker method name, positional args as vLLM's collective_rpc passes them
    assert rpc(http, {"method": "update_weights", "args": [{"path": str(b)}]}) == [None]
    assert rpc(http, {"method": "skyrl_finish_weight_update"}) == [None]
    assert rpc(http, {"method": "skyrl_wake_for_weight_sync", "kwargs": {"tags": ["kv_cache"]}}) == [None]
    assert http.post("/resume").status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    stream.join(120)
    assert stream.error is None and stream.finish == "length" and len(stream.tokens) == total
    after = greedy(http)
    assert after != before  # B's weights serve now
    # back to A through vLLM's worker method names
    rpc(http, {"method": "start_weight_update"})
    rpc(http, {"method": "update_weights", "kwargs": {"update_info": {"path": str(a)}}})
    rpc(http, {"method": "finish_weight_update"})
    assert greedy(http) == before


def test_collective_rpc_refusals(stack):
    http, plain = stack
    r = http.post("/collective_rpc", json={"method": "execute_model", "args": []})
    assert r.status_code == 400
    err = r.json()["error"]
    assert "'execute_model'" in err["message"] and err["type"] == "BadRequestError" and err["code"] == 400
    r = http.post("/collective_rpc", json={"kwargs": {}})
    assert r.status_code == 400 and "Missing 'method'" in r.json()["error"]["message"]
    r = http.post("/collective_rpc", json={"method": "skyrl_start_weight_update",
                                           "kwargs": {"is_checkpoint_format": False}})
    assert r.status_code == 400 and "is_checkpoint_format" in r.json()["error"]["message"]
    r = http.post("/collective_rpc", json={"method": "sleep", "kwargs": {"level": 1, "oops": 2}})
    assert r.status_code == 400 and "'oops'" in r.json()["error"]["message"]
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}  # nothing ran
    assert httpx.post(str(http.base_url) + "/collective_rpc", json={"method": "sleep"}, timeout=10).status_code == 401


def test_without_enable_rl_dev_routes_are_absent(stack):
    _, plain = stack
    assert plain.get("/server_info", params={"config_format": "json"}).status_code == 404
    assert plain.post("/collective_rpc", json={"method": "sleep"}).status_code == 404


def test_kv_event_sources(stack):
    http, plain = stack
    # vLLM's {dp_rank: KVEventsConfig} of ZeroMQ KV-event publishers: none here (docs/routing.md)
    assert plain.get("/kv_event_sources").json() == {}
    assert http.get("/kv_event_sources").json() == {}
    assert httpx.get(str(http.base_url) + "/kv_event_sources", timeout=10).status_code == 401


def test_partial_utf8_logprob_tokens_as_vllm(stack):
    """vLLM's logprob detokenizer (``_verify_tokens``): a token ending in a partial UTF-8
    character is re-decoded with the tokens before it (for prompt tokens: from position 1,
    position 0 has no logprob entry): "" while the character is incomplete, the whole
    character on the token that completes it.  Token ids are bytes here (0xC3 0xA9 = é)."""
    http, _ = stack
    prompt = [0xC3, 0xA9, 33, 104, 0xC3, 0xA9]
    body = {"model": model_id(http), "prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True,
            "logprobs": 0, "prompt_logprobs": 0}
    c = http.post("/v1/completions", json=body).json()["choices"][0]
    assert c["logprobs"]["tokens"][:6] == ["\ufffd", "", "!", "h", "", "é"]
    assert [next(iter(p.values()))["decoded_token"] for p in c["prompt_logprobs"][1:]] == ["", "!", "h", "", "é"]


# ------------------------------------------------------------------ TRL's weight sync
def _trainer_tensors(model_dir):
    from safetensors.torch import load_file

    return sorted(load_file(str(model_dir / "model.safetensors")).items())


def _in_thread(fn, errors):
    def run():
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - surfaced by the test's assert on ``errors``
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _trl_connect(http):
    """TRL 1.16 ``VLLMClient.init_communicator`` (trl/generation/vllm_client.py), the same in
    ``trl/experimental/async_grpo/weight_transfer.py`` ``init_weight_transfer``: world size
    from ``GET /get_world_size`` + 1, then ``POST /init_weight_transfer_engine {"init_info":
    {master_address, master_port, rank_offset: 1, world_size, packed: true}}`` (``packed``
    with vLLM >= 0.28) while the trainer joins the rendezvous as rank 0.  TRL's trainer side
    is NCCL on CUDA; here common.dist_weight_transfer.TrainerWeightSender speaks the same
    packed broadcast over gloo, and the workers pick gloo themselves (no ``backend`` sent)."""
    from common.dist_weight_transfer import TrainerWeightSender
    from tests.support.procs import free_port

    world_size = http.get("/get_world_size").json()["world_size"] + 1
    sender = TrainerWeightSender("127.0.0.1", free_port(), world_size=world_size, packed=True, backend="gloo",
                                 timeout_s=60)
    init_info = {"master_address": "127.0.0.1", "master_port": sender.info.master_port, "rank_offset": 1,
                 "world_size": world_size, "packed": True}
    errors = []
    joined = _in_thread(sender.connect, errors)
    r = http.post("/init_weight_transfer_engine", json={"init_info": init_info})
    assert r.status_code == 200, r.text
    assert r.json() == {"message": "Weight transfer initialized"}  # TRL's _post parses it as JSON
    joined.join(60)
    assert not errors and sender.group is not None
    return sender


def _trl_update_info(named):
    """``update_named_params``' body: ``{"update_info": {names, dtype_names, shapes}}`` (vLLM >= 0.28
    leaves ``packed`` out: the group was opened packed)."""
    return {"names": [n for n, _ in named], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named]}


def _trl_update_weights(http, sender, named) -> None:
    """One ``/update_weights`` while the trainer broadcasts the bucket (as TRL's clients do)."""
    errors = []
    sending = _in_thread(lambda: sender.send(named), errors)
    r = http.post("/update_weights", json={"update_info": _trl_update_info(named)})
    assert r.status_code == 200 and r.json() == {"message": "Weights updated"}, r.text
    sending.join(60)
    assert not errors


def _reset_to(http, sender, model_dir) -> None:
    """After a weight-sync test: drop the trainer's group and load ``model_dir`` back."""
    sender.close()
    http.post("/shutdown_weight_transfer_engine")
    rpc(http, {"method": "start_weight_update"})
    rpc(http, {"method": "update_weights", "kwargs": {"update_info": {"path": str(model_dir)}}})
    rpc(http, {"method": "finish_weight_update"})


def test_trl_vllm_client_weight_update_and_reset_prefix_cache(stack, models):
    """TRL 1.16 ``VLLMClient`` (trl/generation/vllm_client.py): ``init_communicator``, then
    ``update_named_params`` inside ``weight_update()`` (``POST /start_weight_update {}``,
    ``POST /update_weights {"update_info": ...}`` concurrent with the broadcast, ``POST
    /finish_weight_update {}``), then ``reset_prefix_cache`` (``POST /reset_prefix_cache``, no
    body; ``_post`` parses the answer as JSON).  ``close_communicator`` sends nothing (it drops
    the trainer's store and socket).

    TRL's server mode never pauses: each rank receives the bucket on its engine thread
    between two steps (as vLLM does) and stages it until ``/finish_weight_update``.  The
    same bodies behind ``/pause?mode=keep`` (what TRL's async GRPO client does) write the
    weights in place."""
    http, _ = stack
    a, b = models
    before = greedy(http)
    sender = _trl_connect(http)
    try:
        named = _trainer_tensors(b)
        # -- VLLMClient.update_model_params as written: no pause
        r = http.post("/start_weight_update", json={})
        assert r.status_code == 200 and r.json() == {"message": "Weight update started"}
        _trl_update_weights(http, sender, named)
        assert greedy(http) == before  # staged: still A until the finish
        assert http.post("/finish_weight_update", json={}).json() == {"message": "Weight update finished"}
        staged_then_swapped = greedy(http)
        assert staged_then_swapped != before

        # -- the same calls behind a pause
        assert http.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
        assert http.post("/start_weight_update", json={}).status_code == 200
        _trl_update_weights(http, sender, named)
        assert http.post("/finish_weight_update", json={}).json() == {"message": "Weight update finished"}
        assert http.post("/resume").json() == {"status": "resumed"}
        after = greedy(http)
        assert after == staged_then_swapped  # B again: the same weights, written in place

        # -- VLLMClient.reset_prefix_cache (vLLM >= 0.26: self._post, a JSON answer)
        r = http.post("/reset_prefix_cache")
        assert r.status_code == 200 and r.json() == {"success": True}
        assert greedy(http) == after
    finally:
        _reset_to(http, sender, a)
    assert greedy(http) == before


def test_trl_async_grpo_weight_sync(stack, models):
    """TRL 1.16 async GRPO (trl/experimental/async_grpo/vllm_client.py and weight_transfer.py):
    ``get_dtype`` (``/server_info?config_format=json`` -> ``model_config.dtype`` must match the
    trainer's), ``init_weight_transfer``, ``pause`` (``POST /pause?mode=keep``, no body),
    ``send_weights``: ``start_weight_update`` (``{"is_checkpoint_format": true}``),
    ``update_weights`` (``{"update_info": ...}``) concurrent with the broadcast,
    ``finish_weight_update`` (no body), then ``resume`` (``POST /resume``).  Each checks only
    ``status_code == 200``.  A rollout in flight is frozen across the sync, never aborted."""
    http, _ = stack
    a, b = models
    before = greedy(http)
    named = _trainer_tensors(b)
    r = http.get("/server_info", params={"config_format": "json"})
    assert r.status_code == 200
    vllm_dtype = r.json()["vllm_config"]["model_config"]["dtype"].removeprefix("torch.")
    assert vllm_dtype == str(named[0][1].dtype).removeprefix("torch.")  # TRL raises on a mismatch
    sender = _trl_connect(http)
    stream = _Stream(http, 200)
    stream.start()
    try:
        wait_for(lambda: len(stream.tokens) >= 3 or stream.error is not None, 60, "the stream to start")
        assert http.post("/pause", params={"mode": "keep"}).status_code == 200
        assert http.post("/start_weight_update", json={"is_checkpoint_format": True}).status_code == 200
        _trl_update_weights(http, sender, named)
        assert http.post("/finish_weight_update").status_code == 200
        assert http.post("/resume").status_code == 200
        stream.join(120)
        assert stream.error is None and stream.finish == "length" and len(stream.tokens) == 200
        assert greedy(http) != before
    finally:
        _reset_to(http, sender, a)
    assert greedy(http) == before


# ------------------------------------------------------------------ SkyRL's RemoteInferenceClient
# From the ``skyrl`` wheel on PyPI (0.3.0, the newest published; ``skyrl_train`` 0.4.0 is the
# older package whose client spoke SkyRL's own server routes), file
# skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py.
def skyrl_sampling_params(max_tokens=8, logprobs=1):
    """``get_vllm_sampling_params`` (inference_servers/engine_utils.py) with ``SamplingParams``'
    defaults (temperature 1.0, top_p 1.0, top_k -1, min_p 0.0, logprobs 1, stop None)."""
    return {"min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True,
            "max_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
            "logprobs": logprobs, "stop": None}


def skyrl_call_server(http, endpoint, json=None, method="POST", params=None):
    """``RemoteInferenceClient._call_server``: ``body = await resp.json() if resp.content_length
    else None``, then ``raise_for_status`` (reads ``body["error"]["message"]``)."""
    r = http.request(method, endpoint, json=json, params=params)
    assert r.status_code == 200, r.text
    body = r.json() if int(r.headers.get("content-length") or 0) else None
    return {"status": r.status_code, "body": body}


def test_skyrl_generate(stack):
    """SkyRL ``RemoteInferenceClient._generate_single``: ``POST /inference/v1/generate`` with
    ``{"sampling_params", "model", "token_ids"}`` and an ``X-Session-ID`` header; it reads
    ``choices[0]["token_ids"]``, ``["finish_reason"]`` and ``logprobs.content[*].logprob``."""
    http, _ = stack
    model = model_id(http)
    payload = {"sampling_params": {**skyrl_sampling_params(), "seed": 3}, "model": model, "token_ids": PROMPT_IDS[0]}
    r = http.post(GENERATE, json=payload, headers={"Content-Type": "application/json", "X-Session-ID": "traj-1"})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    response_ids, stop_reason = choice["token_ids"], choice["finish_reason"]
    response_logprobs = [info["logprob"] for info in choice["logprobs"]["content"]]
    assert len(response_ids) == len(response_logprobs) == 8 and stop_reason == "length"
    assert all(lp <= 0 for lp in response_logprobs)
    assert choice.get("routed_experts") is None
    # logprobs None (SkyRL's get_logprobs False): no logprobs to read
    payload["sampling_params"]["logprobs"] = None
    choice = http.post(GENERATE, json=payload).json()["choices"][0]
    assert choice["token_ids"] == response_ids and choice.get("logprobs") is None


def test_skyrl_sample_n(stack):
    """SkyRL ``RemoteInferenceClient.sample`` (Tinker's sample): ``POST /inference/v1/generate``
    with ``sampling_params {"n": num_samples, "logprobs": 0, "output_kind": 2, "prompt_logprobs":
    k or None, ...mapped Tinker params}``; it reads each choice's ``token_ids``,
    ``logprobs.content[*].logprob``, ``finish_reason`` and the top-level ``prompt_logprobs``
    (``{str(token_id): {"logprob": ...}}`` per position)."""
    http, _ = stack
    token_ids = PROMPT_IDS[0]
    for k in (0, 2):
        sampling_params = {"n": 3, "logprobs": 0, "output_kind": 2, "prompt_logprobs": k,
                           "temperature": 1.0, "max_tokens": 5, "seed": 5}
        payload = {"sampling_params": sampling_params, "model": model_id(http), "token_ids": token_ids}
        r = http.post(GENERATE, json=payload, headers={"Content-Type": "application/json", "X-Session-ID": "s"})
        assert r.status_code == 200, r.text
        response = r.json()
        raw = response["prompt_logprobs"]
        prompt_logprobs = [(pos.get(str(tid)) or {}).get("logprob") if pos is not None else None
                           for tid, pos in zip(token_ids, raw)]
        assert prompt_logprobs[0] is None and all(isinstance(lp, float) for lp in prompt_logprobs[1:])
        if k:
            topk = [sorted([(int(t), e["logprob"]) for t, e in pos.items()], key=lambda x: x[1], reverse=True)[:k]
                    if pos is not None else None for pos in raw]
            assert topk[0] is None and all(len(p) == k for p in topk[1:])
        sequences = [{"tokens": c["token_ids"], "logprobs": [lp["logprob"] for lp in c["logprobs"]["content"]],
                      "stop_reason": c.get("finish_reason")} for c in response["choices"]]
        assert len(sequences) == 3
        assert all(len(s["tokens"]) == len(s["logprobs"]) == 5 and s["stop_reason"] == "length" for s in sequences)
    # include_prompt_logprobs false: "prompt_logprobs": null
    payload["sampling_params"]["prompt_logprobs"] = None
    response = http.post(GENERATE, json=payload).json()
    assert len(response["choices"]) == 3 and response.get("prompt_logprobs") is None


ROLLOUT_TOKENS = MAX_MODEL_LEN - 2 * len(PROMPT_IDS[1])


def _paused_mid_rollout(http, max_tokens: int, attempts: int = 3) -> "_Stream":
    """A streaming rollout paused (SkyRL's ``pause``: keep) while it still has tokens to go.

    On a starved machine the rollout can finish between its first tokens and the pause
    landing; that run proves nothing about pausing, so it is resumed and tried again with
    a fresh stream (a finished stream is told by its finish reason, which the client reads
    only after the last token)."""
    for _ in range(attempts):
        stream = _Stream(http, max_tokens)
        stream.start()
        wait_for(lambda: len(stream.tokens) >= 3 or stream.error is not None, 60, "the stream to start")
        assert stream.error is None, stream.error
        got = skyrl_call_server(http, "/pause", params={"mode": "keep", "clear_cache": "false"})
        assert got["body"] == {"status": "paused"}
        if stream.finish is None and len(stream.tokens) < max_tokens:
            return stream
        skyrl_call_server(http, "/resume")
        stream.join(120)
    pytest.fail(f"every one of {attempts} rollouts of {max_tokens} tokens finished before a pause landed")


def test_skyrl_control_plane(stack):
    """SkyRL ``RemoteInferenceClient`` control plane, fanned out by ``_call_all_servers``:
    ``get_world_size`` (``GET /get_world_size`` with a ``{}`` JSON body; reads
    ``body["world_size"]``), ``pause`` (``POST /pause?mode=keep&clear_cache=false``),
    ``resume`` (``POST /resume``), ``sleep`` (``POST /sleep?level=2[&tags=...]``), ``wake_up``
    (``POST /wake_up[?tags=...]``), ``reset_prefix_cache`` (``POST /reset_prefix_cache
    {"reset_running_requests": false}``).  A rollout in flight survives pause and resume."""
    http, _ = stack
    assert skyrl_call_server(http, "/get_world_size", {}, method="GET")["body"]["world_size"] == 1
    before = greedy(http)
    for mode in ("keep", "wait", "abort"):  # PauseMode values; pause_generation is keep
        if mode == "keep":
            stream = _paused_mid_rollout(http, ROLLOUT_TOKENS)
            assert skyrl_call_server(http, "/resume")["body"] == {"status": "resumed"}
            stream.join(120)
            assert stream.error is None and stream.finish == "length" and len(stream.tokens) == ROLLOUT_TOKENS
        else:
            assert skyrl_call_server(http, "/pause", params={"mode": mode, "clear_cache": "true"})["status"] == 200
            assert skyrl_call_server(http, "/resume")["status"] == 200

    # sleep: level is sent as a string; tags only when given
    assert skyrl_call_server(http, "/sleep", params={"level": "2"})["status"] == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    assert skyrl_call_server(http, "/wake_up", params={"tags": ["weights"]})["status"] == 200
    assert skyrl_call_server(http, "/wake_up", params={})["status"] == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert skyrl_call_server(http, "/sleep", params={"level": "1", "tags": ["weights", "kv_cache"]})["status"] == 200
    assert skyrl_call_server(http, "/wake_up", params={"tags": ["weights", "kv_cache"]})["status"] == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    got = skyrl_call_server(http, "/reset_prefix_cache", {"reset_running_requests": False})
    assert got["body"] == {"success": True}
    assert greedy(http) == before


def test_skyrl_checkpoint_weight_update(stack, models):
    """SkyRL ``RemoteInferenceClient.start_weight_update`` / ``finish_weight_update`` (bodies
    ``{"method": "skyrl_start_weight_update", "kwargs": {"is_checkpoint_format": true}}`` and
    ``{"method": "skyrl_finish_weight_update"}`` on ``/collective_rpc``) around vLLM's disk
    reload (``update_weights`` with ``{"update_info": {"path": ...}}``), each answer parsed by
    ``_call_server`` as ``{"status", "body"}``.  (The client's CUDA IPC chunks,
    ``update_weights_ipc``, are refused; its broadcast chunks: the next test.)"""
    http, _ = stack
    a, b = models
    before = greedy(http)
    got = skyrl_call_server(http, "/collective_rpc", {"method": "skyrl_start_weight_update",
                                                       "kwargs": {"is_checkpoint_format": True}})
    assert got["body"] == {"results": [None]}
    assert skyrl_call_server(http, "/update_weights", {"update_info": {"path": str(b)}})["body"] == {
        "message": "Weights updated"}
    assert skyrl_call_server(http, "/collective_rpc", {"method": "skyrl_finish_weight_update"})["body"] == {
        "results": [None]}
    assert greedy(http) != before
    # CUDA IPC handles cannot reach a CPU worker: refused by name, nothing runs
    r = http.post("/collective_rpc", json={"method": "update_weights_ipc", "kwargs": {"update_info": {"names": []}}})
    assert r.status_code == 400 and "'update_weights_ipc'" in r.json()["error"]["message"]
    skyrl_call_server(http, "/collective_rpc", {"method": "skyrl_start_weight_update",
                                                 "kwargs": {"is_checkpoint_format": True}})
    skyrl_call_server(http, "/update_weights", {"update_info": {"path": str(a)}})
    skyrl_call_server(http, "/collective_rpc", {"method": "skyrl_finish_weight_update"})
    assert greedy(http) == before


def test_skyrl_broadcast_weight_sync(stack, models):
    """SkyRL's broadcast weight sync (``skyrl`` 0.3.0, weight_sync/broadcast_strategy.py
    ``BroadcastWeightTransferSender._send_chunks_vllm_native`` through
    ``RemoteInferenceClient``): ``get_world_size``, ``init_weight_update_communicator``
    (``POST /init_weight_transfer_engine {"init_info": BroadcastInitInfo.to_api_payload()}``:
    master_address, master_port, rank_offset, world_size and no ``packed``), then
    ``start_weight_update`` (``/collective_rpc`` ``skyrl_start_weight_update``),
    ``update_weights_nccl`` (``/collective_rpc {"method": "update_weights_nccl", "kwargs":
    {"update_info": {names, dtype_names, shapes, "packed": true}}}``) concurrent with
    ``trainer_send_weights(packed=True)``, ``finish_weight_update``; around it the trainer's
    ``pause_generation`` (keep) and ``resume_generation``.  The trainer side: gloo here.

    SkyRL says ``packed`` in update_info (vLLM < 0.28's place), not in init_info: the workers
    follow the update's ``packed`` (server fix; they followed init_info only, and waited for
    per-tensor broadcasts the trainer never sent)."""
    from common.dist_weight_transfer import TrainerWeightSender
    from tests.support.procs import free_port

    http, _ = stack
    a, b = models
    before = greedy(http)
    named = _trainer_tensors(b)
    per_server = skyrl_call_server(http, "/get_world_size", {}, method="GET")["body"]["world_size"]
    world_size = per_server + 1
    sender = TrainerWeightSender("127.0.0.1", free_port(), world_size=world_size, packed=True, backend="gloo",
                                 timeout_s=60)
    init_info = {"master_address": "127.0.0.1", "master_port": sender.info.master_port, "rank_offset": 1,
                 "world_size": world_size}
    errors = []
    joined = _in_thread(sender.connect, errors)
    assert skyrl_call_server(http, "/init_weight_transfer_engine", {"init_info": init_info})["status"] == 200
    joined.join(60)
    assert not errors
    try:
        skyrl_call_server(http, "/pause", params={"mode": "keep", "clear_cache": "false"})
        got = skyrl_call_server(http, "/collective_rpc", {"method": "skyrl_start_weight_update",
                                                           "kwargs": {"is_checkpoint_format": True}})
        assert got["body"] == {"results": [None]}
        update_info = {**_trl_update_info(named), "packed": True}
        sending = _in_thread(lambda: sender.send(named), errors)
        got = skyrl_call_server(http, "/collective_rpc", {"method": "update_weights_nccl",
                                                           "kwargs": {"update_info": update_info}})
        assert got["body"] == {"results": [None]}
        sending.join(60)
        assert not errors
        assert skyrl_call_server(http, "/collective_rpc", {"method": "skyrl_finish_weight_update"})["body"] == {
            "results": [None]}
        skyrl_call_server(http, "/resume")
        assert greedy(http) != before
    finally:
        sender.close()
        http.post("/resume")
        http.post("/shutdown_weight_transfer_engine")
        rpc(http, {"method": "start_weight_update"})
        rpc(http, {"method": "update_weights", "kwargs": {"update_info": {"path": str(a)}}})
        rpc(http, {"method": "finish_weight_update"})
    assert greedy(http) == before


# ------------------------------------------------------------------ TRL async GRPO's LoRA sync
@pytest.fixture(scope="module")
def lora_stack(tmp_path_factory, models):
    pytest.importorskip("peft")
    from tests.support.lora_factory import build_adapter

    a, _ = models
    root = tmp_path_factory.mktemp("clients-lora")
    adapters = [build_adapter(a, root / f"step{i}", ["q_proj", "v_proj"], rank=4, seed=i) for i in (1, 2)]
    with ProcGroup(tmp_path_factory.mktemp("clients-lora-stack")) as procs:
        broker = procs.broker()
        procs.worker(broker, 0, "--model", str(a), *WORKER_ARGS, "--enable-lora", "--max-loras", "2",
                     "--max-lora-rank", "8")
        wait_for_workers(broker.frontend, 1, timeout=120)
        gw = start_gateway(procs, broker.frontend, "--tokenizer", str(a), "--enable-rl", "--allow-runtime-lora",
                           "--api-key", API_KEY)
        with httpx.Client(base_url=gw.url, timeout=120, headers=AUTH) as http:
            yield http, adapters


def test_trl_async_grpo_lora_sync(lora_stack):
    """TRL 1.16 async GRPO's adapter sync (trl/experimental/async_grpo/async_grpo_trainer.py, the
    LoRA branch of the weight sync, through async_grpo/vllm_client.py): ``pause`` (``POST
    /pause?mode=keep``), ``load_lora_adapter`` (``POST /v1/load_lora_adapter {"lora_name":
    "<name>-v<version>", "lora_path", "load_inplace": false}``, 200 expected, 404 means the
    routes are off), ``resume``, later ``unload_lora_adapter`` of the stale version (``POST
    /v1/unload_lora_adapter {"lora_name"}``, answer ignored).  The rollout worker
    (async_rollout_worker.py ``_generate_one_turn``) then names the adapter in ``/v1/completions``
    and reads ``choices[0]["token_ids"]`` and ``["logprobs"]["token_logprobs"]``."""
    http, adapters = lora_stack
    base = model_id(http)

    def turn(model):
        payload = {"model": model, "prompt": PROMPT_IDS[0], "max_tokens": 6, "temperature": 0.0, "top_p": 1.0,
                   "top_k": -1, "repetition_penalty": 1.0, "n": 1, "return_token_ids": True, "logprobs": 0,
                   "seed": 12345}
        r = http.post("/v1/completions", json=payload)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) == 6
        return choice["token_ids"]

    base_ids = turn(base)
    outputs = {}
    for version, path in enumerate(adapters, start=1):
        assert http.post("/pause", params={"mode": "keep"}).status_code == 200
        r = http.post("/v1/load_lora_adapter", json={"lora_name": f"policy-v{version}", "lora_path": str(path),
                                                     "load_inplace": False})
        assert r.status_code == 200, r.text
        assert r.text == f"Success: LoRA adapter 'policy-v{version}' added successfully."
        assert http.post("/resume").status_code == 200
        outputs[version] = turn(f"policy-v{version}")
    assert outputs[1] != base_ids or outputs[2] != base_ids
    assert {m["id"] for m in http.get("/v1/models").json()["data"]} >= {"policy-v1", "policy-v2"}
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "policy-v1"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'policy-v1' removed successfully."
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "policy-v1"}).status_code == 404  # ignored by TRL
    assert turn("policy-v2") == outputs[2] and turn(base) == base_ids
    # SkyRL's RemoteInferenceClient.load_lora_adapter posts to its own server's route
    # /skyrl/v1/load_lora_adapter (vLLM has none); its unload_lora_adapter is vLLM's, as above.
    assert http.post("/skyrl/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapters[0])}
                     ).status_code == 404
