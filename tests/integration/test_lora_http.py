"""Multi-LoRA end to end: a real broker, two real workers started with --enable-lora
and one --lora-modules adapter, a gateway with --allow-runtime-lora.

Outputs are checked against transformers + peft on the same tiny base; vLLM's
routes and shapes: /v1/models adapter cards, `model` selecting the adapter and
named in the response, /v1/load_lora_adapter and /v1/unload_lora_adapter with
vLLM's messages and error types; adapter-aware dispatch; a restarted worker gets
the adapters loaded at runtime; the direct client names an adapter too.
"""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from common.client import Client
from common.protocol import GenerateRequest, SamplingParams
from tests.support.engine_helpers import hf_greedy, random_prompts
from tests.support.gateway_helpers import GENERATE, iter_sse, start_gateway
from tests.support.lora_factory import ATTENTION, MLP, build_adapter, edit_adapter_config, peft_greedy
from tests.support.procs import ProcGroup, cluster_info, wait_for, wait_for_workers

pytest.importorskip("peft")

WORKER_ARGS = ("--max-num-seqs", "8", "--num-kv-blocks", "128", "--threads", "1", "--max-model-len", "256",
               "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16")
PROMPT = random_prompts(1, 7, 8, seed=21)[0]


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("http-loras")
    return {"qv": build_adapter(llama_dir, root / "qv", ["q_proj", "v_proj"], rank=4, seed=1),
            "all": build_adapter(llama_dir, root / "all", ATTENTION + MLP + ["lm_head"], rank=8, seed=2),
            "mlp": build_adapter(llama_dir, root / "mlp", MLP + ["embed_tokens"], rank=16, seed=3)}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, llama_dir, adapters):
    with ProcGroup(tmp_path_factory.mktemp("lora-stack")) as procs:
        broker = procs.broker()
        args = ("--model", str(llama_dir), *WORKER_ARGS, "--lora-modules", f"qv={adapters['qv']}")
        for rank in (0, 1):
            procs.worker(broker, rank, *args)
        wait_for_workers(broker.frontend, 2, timeout=120)
        gw = start_gateway(procs, broker.frontend, "--allow-runtime-lora")
        with httpx.Client(base_url=gw.url, timeout=120) as http:
            yield procs, broker, http, args


def _generate(http, model, prompt=PROMPT, max_tokens=8, rank=None, **body):
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    payload = {"token_ids": prompt, "sampling_params": {"max_tokens": max_tokens, "temperature": 0,
                                                        "ignore_eos": True}, **body}
    if model is not None:
        payload["model"] = model
    return http.post(GENERATE, json=payload, headers=headers)


def _tokens(resp) -> list[int]:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def _load(http, name, path, **extra):
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **extra})


def _unload(http, name):
    return http.post("/v1/unload_lora_adapter", json={"lora_name": name})


def _error(resp, status):
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


def _resident(broker, rank) -> list[str]:
    info = cluster_info(broker.frontend)
    return next(w.load.resident_loras for w in info.workers if w.rank == rank)


def test_models_lists_adapters_with_their_parent(stack, llama_dir, adapters):
    _, _, http, _ = stack
    cards = http.get("/v1/models").json()["data"]
    base, lora = cards[0], {c["id"]: c for c in cards[1:]}
    assert base["id"] == str(llama_dir) and base["parent"] is None
    assert lora["qv"]["root"] == str(adapters["qv"]) and lora["qv"]["parent"] == base["id"]
    assert lora["qv"]["object"] == "model" and lora["qv"]["owned_by"] == base["owned_by"]


def test_model_selects_the_adapter_stream_and_not(stack, llama_dir, adapters):
    _, _, http, _ = stack
    want = peft_greedy(llama_dir, adapters["qv"], PROMPT, 8)[0]
    resp = _generate(http, "qv")
    assert _tokens(resp) == want and resp.json()["model"] == "qv"
    with http.stream("POST", GENERATE, json={"model": "qv", "token_ids": PROMPT, "stream": True,
                                             "sampling_params": {"max_tokens": 8, "temperature": 0,
                                                                 "ignore_eos": True}}) as r:
        chunks = [json.loads(p) for p in iter_sse(r.iter_lines()) if p != "[DONE]"]
    assert [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]] == want
    base = _generate(http, None)
    assert _tokens(base) == hf_greedy(llama_dir, PROMPT, 8)[0] != want
    assert base.json()["model"] == str(llama_dir)
    assert _error(_generate(http, "nope"), 404)["param"] == "model"


def test_runtime_load_use_unload(stack, llama_dir, adapters, tmp_path):
    _, _, http, _ = stack
    resp = _load(http, "x", adapters["all"])
    assert resp.status_code == 200 and resp.text == "Success: LoRA adapter 'x' added successfully."
    assert "x" in {c["id"] for c in http.get("/v1/models").json()["data"]}
    want = peft_greedy(llama_dir, adapters["all"], PROMPT, 8)[0]
    for rank in (0, 1):  # loaded on every worker
        assert _tokens(_generate(http, "x", rank=rank)) == want, rank

    err = _error(_load(http, "x", adapters["qv"]), 400)
    assert err["type"] == "InvalidUserInput" and "has already been loaded" in err["message"]
    assert _load(http, "x", adapters["mlp"], load_inplace=True).status_code == 200  # replaced in place
    assert _tokens(_generate(http, "x")) == peft_greedy(llama_dir, adapters["mlp"], PROMPT, 8)[0]

    resp = _unload(http, "x")
    assert resp.status_code == 200 and resp.text == "Success: LoRA adapter 'x' removed successfully."
    assert _error(_generate(http, "x"), 404)["message"].startswith("The model `x` does not exist.")
    assert "x" not in {c["id"] for c in http.get("/v1/models").json()["data"]}
    err = _error(_unload(http, "x"), 404)
    assert err == {"message": "The lora adapter 'x' cannot be found.", "type": "NotFoundError", "param": None,
                   "code": 404}

    missing = _error(_load(http, "m", tmp_path / "nowhere"), 404)
    assert missing["message"] == f"Loading lora m failed: No adapter found for {tmp_path / 'nowhere'}"
    too_big = edit_adapter_config(adapters["qv"], tmp_path / "big", r=64)
    assert "--max-lora-rank 16" in _error(_load(http, "big", too_big), 400)["message"]
    dora = edit_adapter_config(adapters["qv"], tmp_path / "dora", use_dora=True)
    assert "DoRA" in _error(_load(http, "dora", dora), 400)["message"]
    assert _error(_load(http, "", adapters["qv"]), 400)["type"] == "InvalidUserInput"
    assert _error(_unload(http, ""), 400)["message"] == "'lora_name' needs to be provided to unload a LoRA adapter."
    assert "conflicts with a served base model" in _error(_load(http, str(llama_dir), adapters["qv"]), 400)["message"]
    assert _error(http.post("/v1/load_lora_adapter", content=b"{nope", headers={"Content-Type": "application/json"}),
                  400)
    assert _error(_load(http, "moe", adapters["qv"], is_3d_lora_weight=True), 400)["param"] == "is_3d_lora_weight"
    # Type errors name the field as vLLM's validation handler does (the pydantic body's location).
    assert _error(_load(http, "x", adapters["qv"], load_inplace="yes"), 400)["param"] == "body.load_inplace"
    assert _error(_load(http, 7, adapters["qv"]), 400)["param"] == "body.lora_name"
    # Nothing refused was registered, and the workers still serve.
    assert {c["id"] for c in http.get("/v1/models").json()["data"][1:]} == {"qv"}
    assert _tokens(_generate(http, "qv")) == peft_greedy(llama_dir, adapters["qv"], PROMPT, 8)[0]


def test_loading_an_adapter_does_not_disturb_streams(stack, llama_dir, adapters):
    _, _, http, _ = stack
    prompts = random_prompts(2, 6, 12, seed=33)
    wants = [peft_greedy(llama_dir, adapters["qv"], p, 40)[0] for p in prompts]
    results: list = [None, None]
    started = threading.Barrier(3)

    def stream(i):
        got = []
        with http.stream("POST", GENERATE, json={"model": "qv", "token_ids": prompts[i], "stream": True,
                                                 "sampling_params": {"max_tokens": 40, "temperature": 0,
                                                                     "ignore_eos": True}},
                         headers={"X-data-parallel-rank": str(i)}) as r:
            for payload in iter_sse(r.iter_lines()):
                if payload == "[DONE]":
                    break
                if not got:
                    started.wait(30)
                got += [t for ch in json.loads(payload)["choices"] for t in ch["token_ids"]]
        results[i] = got

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    started.wait(30)  # both streams are producing tokens
    assert _load(http, "during", adapters["all"]).status_code == 200
    assert _tokens(_generate(http, "during", max_tokens=4)) == peft_greedy(llama_dir, adapters["all"], PROMPT, 4)[0]
    assert _unload(http, "during").status_code == 200
    for t in threads:
        t.join(60)
    assert results == wants


def test_dispatch_prefers_the_worker_holding_the_adapter(stack, llama_dir, adapters):
    _, broker, http, _ = stack
    assert _load(http, "z", adapters["mlp"]).status_code == 200
    want = peft_greedy(llama_dir, adapters["mlp"], PROMPT, 4)[0]
    assert _tokens(_generate(http, "z", max_tokens=4, rank=1)) == want
    wait_for(lambda: "z" in _resident(broker, 1), 10, "rank 1 to report z resident")
    prompts = random_prompts(6, 5, 10, seed=41)
    for p in prompts:  # idle pool: least-loaded rotation alone would alternate ranks
        assert _tokens(_generate(http, "z", prompt=p, max_tokens=3)) == \
            peft_greedy(llama_dir, adapters["mlp"], p, 3)[0]
    time.sleep(1.5)  # a heartbeat after the last step
    assert "z" not in _resident(broker, 0)
    assert _unload(http, "z").status_code == 200


def test_restarted_worker_gets_the_runtime_adapters(stack, llama_dir, adapters):
    procs, broker, http, args = stack
    assert _load(http, "late", adapters["all"]).status_code == 200
    victim = next(p for p in procs.procs if p.name == "worker1" and p.alive())
    victim.kill9()
    wait_for_workers(broker.frontend, 1, timeout=30)
    procs.worker(broker, 1, *args)  # starts with --lora-modules qv only
    wait_for_workers(broker.frontend, 2, timeout=120)
    want = peft_greedy(llama_dir, adapters["all"], PROMPT, 6)[0]
    wait_for(lambda: _generate(http, "late", max_tokens=6, rank=1).status_code == 200, 30,
             "the restarted worker to serve the runtime adapter")
    assert _tokens(_generate(http, "late", max_tokens=6, rank=1)) == want
    assert _unload(http, "late").status_code == 200
    assert _error(_generate(http, "late", rank=1), 404)


def test_direct_client_names_the_adapter(stack, llama_dir, adapters):
    _, broker, _, _ = stack
    with Client(broker.frontend) as client:
        req = GenerateRequest("direct-lora", PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                              lora_name="qv")
        tokens = [t for d in client.generate(req) for t in d.token_ids]
        assert tokens == peft_greedy(llama_dir, adapters["qv"], PROMPT, 6)[0]
        client.load_lora("direct", str(adapters["all"]))
        req = GenerateRequest("direct-2", PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                              lora_name="direct")
        assert [t for d in client.generate(req) for t in d.token_ids] == \
            peft_greedy(llama_dir, adapters["all"], PROMPT, 6)[0]
        client.unload_lora("direct")


def test_adapter_loaded_through_another_gateway_is_served_at_once(stack, llama_dir, adapters):
    procs, broker, http, _ = stack
    other = start_gateway(procs, broker.frontend, "--info-ttl", "60")  # its cluster view would stay stale
    with httpx.Client(base_url=other.url, timeout=60) as http2:
        assert _tokens(_generate(http2, "qv", max_tokens=2))  # caches the cluster view
        assert _load(http, "elsewhere", adapters["mlp"]).status_code == 200
        assert _tokens(_generate(http2, "elsewhere", max_tokens=4)) == \
            peft_greedy(llama_dir, adapters["mlp"], PROMPT, 4)[0]
        assert _unload(http, "elsewhere").status_code == 200
    other.proc.stop()


def test_server_info_reports_the_lora_config_and_both_ranks(stack):
    """vLLM's /server_info (an --enable-rl gateway): lora_config as the workers run it."""
    procs, broker, http, _ = stack
    rl = start_gateway(procs, broker.frontend, "--enable-rl")
    config = httpx.get(rl.url + "/server_info", params={"config_format": "json"}, timeout=30).json()["vllm_config"]
    assert config["lora_config"] == {"max_loras": 2, "max_lora_rank": 16, "max_cpu_loras": 2}
    assert config["parallel_config"]["data_parallel_size"] == 2
    assert config["model_config"]["max_model_len"] == 256
