"""Structured outputs through real `tokserve worker` processes behind a real broker
(direct ZeroMQ, common/client.py) on a tiny random-weight Llama: for every case of
tests/support/structured_output_cases.py (23 JSON schemas, regexes, choices, EBNF
grammars, json_object, a structural tag), greedy and sampled with n>1, each output is
valid; also with n-gram speculative decoding on a KV cache small enough to preempt,
with a LoRA adapter, an abort mid-grammar (matchers and blocks back), and the 400s
of a spec that does not compile or breaks the rules."""
from __future__ import annotations

import asyncio
import json

import pytest

from common.client import AsyncClient, Client, RequestError
from common.protocol import GenerateRequest, SamplingParams, StructuredOutputs
from tests.support.procs import ProcGroup, cluster_info, wait_for, wait_for_workers
from tests.support.structured_output_cases import cases, grammar_text_decoder, is_valid

pytest.importorskip("xgrammar")
pytestmark = pytest.mark.timeout(600)

CASES = cases()
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
PLAIN, SPEC, LORA = 0, 1, 2


@pytest.fixture(scope="module")
def cluster(llama_dir, tmp_path_factory):
    from tests.support.lora_factory import build_adapter

    adapter = build_adapter(llama_dir, tmp_path_factory.mktemp("so-lora") / "a", ["q_proj", "v_proj"], rank=4)
    common = ["--model", str(llama_dir), "--threads", "1", "--block-size", "16", "--max-num-seqs", "32",
              "--max-model-len", "1024"]
    with ProcGroup(tmp_path_factory.mktemp("so-worker-logs")) as procs:
        broker = procs.broker()
        procs.worker(broker, PLAIN, *common, "--num-kv-blocks", "256",
                     "--structured-outputs-config", '{"backend": "xgrammar"}')
        # 20 blocks x 16 tokens for up to 32 growing sequences: recompute preemption is certain.
        procs.worker(broker, SPEC, *common, "--num-kv-blocks", "20", "--max-num-batched-tokens", "64",
                     "--speculative-config", NGRAM, "--spec-max-step-tokens", "0")
        procs.worker(broker, LORA, *common, "--num-kv-blocks", "256", "--enable-lora", "--max-lora-rank", "8",
                     "--lora-modules", f"a={adapter}")
        try:
            wait_for_workers(broker.frontend, 3, timeout=180)
        except TimeoutError:
            pytest.fail("workers did not register\n" + procs.tails())
        yield broker, procs


def _load(broker, rank):
    info = wait_for(lambda: cluster_info(broker.frontend), 30, "the broker's cluster info")  # None: no answer yet
    return next(w.load for w in info.workers if w.rank == rank)


def _run(broker, reqs) -> dict[str, dict[int, tuple[list[int], str]]]:
    async def run_all():
        async with AsyncClient(broker.frontend) as client:
            async def one(r):
                got: dict[int, tuple[list[int], str]] = {}
                async for d in client.generate(r):
                    ids, reason = got.get(d.index, ([], None))
                    got[d.index] = (ids + list(d.token_ids), d.finish_reason or reason)
                return r.request_id, got
            return dict(await asyncio.gather(*(one(r) for r in reqs)))

    return asyncio.run(run_all())


def _requests(rank: int, temperature: float, n: int, tag: str, prompt_of=lambda i: [1, 2, 3, i],
              lora=None) -> list[GenerateRequest]:
    return [GenerateRequest(request_id=f"{tag}-{name}", prompt_token_ids=prompt_of(i), data_parallel_rank=rank,
                            lora_name=lora, params=SamplingParams(max_tokens=500, temperature=temperature, seed=i,
                                                                  n=n, structured_outputs=so))
            for i, (name, so, _) in enumerate(CASES)]


def _check(reqs, got, decode) -> int:
    """Every "stop" choice valid, nearly all choices "stop"; the number of choices."""
    checks = {f"{r.request_id}": c for r, (_, _, c) in zip(reqs, CASES)}
    stops = total = 0
    for rid, choices in got.items():
        for ids, reason in choices.values():
            total += 1
            assert reason in ("stop", "length"), (rid, reason)
            if reason == "stop":
                stops += 1
                text = decode(ids)
                assert is_valid(checks[rid], text), (rid, text)
    assert stops >= 0.9 * total, f"only {stops} of {total} choices ended with stop"
    return total


@pytest.fixture(scope="module")
def decode(llama_dir):
    from common.tokenizer import load_tokenizer
    from worker.engine.models.config import ModelConfig

    mc = ModelConfig.from_dir(llama_dir)
    return grammar_text_decoder(load_tokenizer(llama_dir), mc.vocab_size, mc.eos_token_ids)


@pytest.mark.parametrize("temperature,n", [(0.0, 1), (1.0, 3)])
def test_every_case_is_valid(cluster, decode, temperature, n):
    broker, _ = cluster
    reqs = _requests(PLAIN, temperature, n, f"plain{temperature}")
    assert _check(reqs, _run(broker, reqs), decode) == len(CASES) * n
    load = _load(broker, PLAIN)
    assert load.grammar_matchers == 0 and load.grammars_compiling == 0


def test_speculative_decoding_under_preemption(cluster, decode, llama_dir):
    broker, _ = cluster
    before = _load(broker, SPEC).num_preemptions
    # Prompts that quote JSON: the n-gram drafts follow the grammar some of the time.
    quote = list(b'{"name":"abc","age":7,"tags":["x","y"]}' * 2)
    reqs = _requests(SPEC, 1.0, 2, "spec", prompt_of=lambda i: quote[: 30 + i])
    got = _run(broker, reqs)
    _check(reqs, got, decode)
    load = _load(broker, SPEC)
    assert load.num_preemptions > before, "the KV cache must be small enough to preempt"
    assert load.grammar_matchers == 0 and load.free_kv_blocks == load.total_kv_blocks


def test_spec_decode_accepts_grammar_valid_drafts(cluster, decode):
    broker, _ = cluster
    quote = list(b"yes yes yes yes yes yes yes yes")
    req = GenerateRequest(request_id="drafts", prompt_token_ids=quote, data_parallel_rank=SPEC,
                          params=SamplingParams(max_tokens=60, temperature=0.0,
                                                structured_outputs=StructuredOutputs(regex="(yes ){2,8}yes")))
    with Client(broker.frontend) as client:
        deltas = list(client.generate(req))
    text = decode([t for d in deltas for t in d.token_ids])
    assert deltas[-1].finish_reason == "stop" and is_valid(("regex", "(yes ){2,8}yes"), text), text
    stats = deltas[-1].spec_decode
    assert stats.num_draft_tokens > 0 and sum(stats.histogram[1:]) > 0


def test_lora_requests_are_constrained(cluster, decode):
    broker, _ = cluster
    reqs = _requests(LORA, 1.0, 2, "lora", lora="a")[:12]
    got = _run(broker, reqs)
    _check(reqs, got, decode)


def test_abort_mid_grammar_frees_matchers_and_blocks(cluster):
    broker, _ = cluster
    never_ends = StructuredOutputs(json=json.dumps({"type": "array", "items": {"type": "integer"}}),
                                   disable_any_whitespace=True)
    req = GenerateRequest(request_id="abort-me", prompt_token_ids=list(range(1, 40)), data_parallel_rank=PLAIN,
                          params=SamplingParams(max_tokens=900, temperature=1.0, n=3, ignore_eos=True,
                                                structured_outputs=never_ends))
    with Client(broker.frontend) as client:
        stream = client.generate(req)
        next(stream)
        wait_for(lambda: _load(broker, PLAIN).grammar_matchers == 3, 30, "the three choices' matchers")
        client.abort(["abort-me"])
        rest = list(stream)
        assert rest and rest[-1].finish_reason == "abort"

    def freed():
        load = _load(broker, PLAIN)
        return (load.running == 0 and load.waiting == 0 and load.grammar_matchers == 0
                and load.free_kv_blocks == load.total_kv_blocks)

    wait_for(freed, 30, "worker 0 to free the aborted request's matchers and KV blocks")


@pytest.mark.parametrize("so,status,words", [
    (StructuredOutputs(grammar='root ::= "a" undefined_rule'), 400, "does not compile"),
    (StructuredOutputs(regex="(unclosed"), 400, "does not compile"),
    (StructuredOutputs(json='{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}'), 400,
     "does not compile"),
    (StructuredOutputs(regex="a", choice=["a"]), 400, "exactly one"),
    (StructuredOutputs(json="not json"), 400, "not valid JSON"),
])
def test_bad_specs_are_400s_with_the_reason(cluster, so, status, words):
    broker, _ = cluster
    req = GenerateRequest(request_id=f"bad-{words}", prompt_token_ids=[1, 2], data_parallel_rank=PLAIN,
                          params=SamplingParams(max_tokens=5, structured_outputs=so))
    with Client(broker.frontend) as client:
        with pytest.raises(RequestError) as exc:
            list(client.generate(req))
    assert exc.value.status == status and words in exc.value.message, exc.value.message
    assert _load(broker, PLAIN).grammars_compiling == 0
