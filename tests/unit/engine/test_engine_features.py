"""Engine scheduling features keep outputs intact: chunked prefill, preemption,
prefix caching (+ salts), priority, n>1 and seeds, stop conditions, text mode."""
from __future__ import annotations

import pytest

from common.errors import BadRequest
from tests.support.engine_helpers import hf_greedy, make_engine, outputs, random_prompts, request, run_to_completion
from tests.support.model_factory import EOS_ID, EXTRA_EOS_ID


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, 20, 70, seed=7)


@pytest.fixture(scope="module")
def reference(llama_dir, prompts):
    """Greedy outputs with a roomy engine and no chunking, the baseline for the others."""
    engine = make_engine(llama_dir, max_num_batched_tokens=512, enable_chunked_prefill=False,
                         enable_prefix_caching=False)
    return outputs(engine, [request(str(i), p, max_tokens=12, ignore_eos=True) for i, p in enumerate(prompts)])


def test_reference_is_hf_greedy(llama_dir, prompts, reference):
    assert reference["0"][0] == hf_greedy(llama_dir, prompts[0], 12)[0]


def test_chunked_prefill_with_tiny_budget_gives_identical_outputs(llama_dir, prompts, reference):
    engine = make_engine(llama_dir, max_num_batched_tokens=7)
    got = outputs(engine, [request(str(i), p, max_tokens=12, ignore_eos=True) for i, p in enumerate(prompts)])
    assert got == reference


def test_preemption_with_tiny_kv_budget_gives_identical_outputs(llama_dir, prompts, reference):
    # 7 blocks of 16 = 112 tokens for six sequences of up to ~80 tokens: constant preemption.
    engine = make_engine(llama_dir, num_kv_blocks=7, block_size=16, max_model_len=112)
    got = outputs(engine, [request(str(i), p, max_tokens=12, ignore_eos=True) for i, p in enumerate(prompts)])
    assert engine.scheduler.num_preemptions > 0
    assert got == reference
    assert engine.block_manager.num_free_blocks == 7


def test_prefix_cache_hits_report_cached_tokens_and_keep_outputs(llama_dir, prompts, reference):
    engine = make_engine(llama_dir, block_size=16)
    shared = prompts[0][:40] if len(prompts[0]) > 40 else prompts[0]
    base = list(range(3, 67))  # 64 tokens
    first = engine.generate([request("a", base, max_tokens=4, ignore_eos=True)])["a"][0]
    assert first.num_cached_tokens == 0
    # Same 64 tokens: 3 full blocks reused, the last block recomputed (last token rule).
    again = engine.generate([request("b", base, max_tokens=4, ignore_eos=True)])["b"][0]
    assert again.num_cached_tokens == 48 and again.token_ids == first.token_ids
    # Sharing 40 tokens = 2 full blocks; output equals an uncached run.
    other = base[:40] + shared[:10]
    hit = engine.generate([request("c", other, max_tokens=6, ignore_eos=True)])["c"][0]
    cold = make_engine(llama_dir, enable_prefix_caching=False).generate(
        [request("c", other, max_tokens=6, ignore_eos=True)])["c"][0]
    assert hit.num_cached_tokens == 32 and hit.token_ids == cold.token_ids
    # Salts isolate: a salted request misses, a second one with the same salt hits.
    s1 = engine.generate([request("s1", base, max_tokens=2, cache_salt="alice")])["s1"][0]
    s2 = engine.generate([request("s2", base, max_tokens=2, cache_salt="alice")])["s2"][0]
    s3 = engine.generate([request("s3", base, max_tokens=2, cache_salt="bob")])["s3"][0]
    assert (s1.num_cached_tokens, s2.num_cached_tokens, s3.num_cached_tokens) == (0, 48, 0)
    # Prompt-logprob requests recompute everything.
    pl = engine.generate([request("pl", base, max_tokens=2, prompt_logprobs=0)])["pl"][0]
    assert pl.num_cached_tokens == 0
    assert engine.block_manager.hit_tokens == 48 + 32 + 48


def test_priority_orders_and_preempts(llama_dir):
    engine = make_engine(llama_dir, max_num_seqs=1)
    finished = []
    tokens: dict = {}

    def collect(deltas):
        for d in deltas:
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finish_reason:
                finished.append(d.request_id)

    engine.add_request(request("low", [5, 6, 7], max_tokens=6, ignore_eos=True, priority=5))
    while len(tokens.get("low", ())) < 2:
        collect(engine.step())
    engine.add_request(request("mid", [8, 9], max_tokens=3, ignore_eos=True, priority=1))
    engine.add_request(request("high", [10, 11], max_tokens=3, ignore_eos=True, priority=-2))
    while engine.has_unfinished():
        collect(engine.step())
    assert finished == ["high", "mid", "low"]
    assert engine.scheduler.num_preemptions >= 1
    # The preempted request's output is unaffected by the recompute.
    solo = make_engine(llama_dir).generate([request("low", [5, 6, 7], max_tokens=6, ignore_eos=True)])
    assert solo["low"][0].token_ids == tokens["low"]


def test_n_choices_share_the_prompt_and_seeds_reproduce(llama_dir):
    prompt = list(range(3, 45))  # 42 tokens: 2 full blocks + a partial one
    engine = make_engine(llama_dir, block_size=16)
    engine.add_request(request("n", prompt, n=3, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True))
    engine.step()  # prefill + first tokens of all three choices
    seqs = engine.requests["n"].sequences
    assert [s.index for s in seqs] == [0, 1, 2]
    shared = seqs[0].block_ids[:2]
    assert all(s.block_ids[:2] == shared for s in seqs)
    assert [engine.block_manager.ref_count(b) for b in shared] == [3, 3]
    rest = run_to_completion(engine)
    first_run = [[*seqs[i].output_ids] for i in range(3)]
    assert all(len(t) == 8 for t in first_run) and len({tuple(t) for t in first_run}) > 1
    assert [rest[("n", i)][-1].finish_reason for i in range(3)] == ["length"] * 3
    # Same seed, other engine and a busy batch around it: same tokens per choice.
    busy = make_engine(llama_dir, block_size=16, max_num_batched_tokens=16)
    noise = [request(f"x{i}", p, temperature=1.0, max_tokens=10) for i, p in enumerate(random_prompts(4, 5, 30))]
    res = busy.generate(noise[:2] + [request("n", prompt, n=3, temperature=1.0, seed=1234, max_tokens=8,
                                              ignore_eos=True)] + noise[2:])
    assert [d.token_ids for d in res["n"]] == first_run
    # n identical greedy choices are refused, as vLLM does.
    with pytest.raises(BadRequest, match=r"n must be 1 when using greedy sampling, got 2\."):
        make_engine(llama_dir).add_request(request("g", prompt, n=2, max_tokens=5))


def test_stop_token_ids_eos_min_tokens_and_ignore_eos(qwen2_dir):
    engine = make_engine(qwen2_dir)
    prompt = [5, 9, 33, 71, 2, 8]
    free = engine.generate([request("f", prompt, max_tokens=10, ignore_eos=True)])["f"][0]
    stop_at = free.token_ids[3]
    cut = free.token_ids.index(stop_at) + 1
    d = engine.generate([request("s", prompt, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_at])])["s"][0]
    assert d.token_ids == free.token_ids[:cut] and (d.finish_reason, d.stop_reason) == ("stop", stop_at)
    # EOS forced by a logit bias: stop with no stop_reason; the EOS id is in the output.
    eos = engine.generate([request("e", prompt, logit_bias={EOS_ID: 100.0})])["e"][0]
    assert eos.token_ids == [EOS_ID] and (eos.finish_reason, eos.stop_reason) == ("stop", None)
    # The second generation_config eos id acts as a stop token id.
    extra = engine.generate([request("x", prompt, logit_bias={EXTRA_EOS_ID: 100.0})])["x"][0]
    assert extra.token_ids == [EXTRA_EOS_ID] and (extra.finish_reason, extra.stop_reason) == ("stop", EXTRA_EOS_ID)
    # min_tokens: stop ids are masked for the first 3 tokens, so EOS comes 4th (vLLM).
    mt = engine.generate([request("m", prompt, logit_bias={EOS_ID: 100.0}, min_tokens=3)])["m"][0]
    assert len(mt.token_ids) == 4 and mt.token_ids[-1] == EOS_ID and mt.finish_reason == "stop"
    assert EOS_ID not in mt.token_ids[:3] and EXTRA_EOS_ID not in mt.token_ids[:3]
    # ignore_eos: runs to max_tokens.
    ig = engine.generate([request("i", prompt, logit_bias={EOS_ID: 100.0}, ignore_eos=True, max_tokens=4)])["i"][0]
    assert ig.token_ids == [EOS_ID] * 4 and ig.finish_reason == "length"


def test_max_tokens_defaults(qwen2_dir):
    engine = make_engine(qwen2_dir, max_model_len=64)
    prompt = [5, 6, 7, 8]
    # Omitted by the client: capped by generation_config max_new_tokens (32).
    d = engine.generate([request("d", prompt, ignore_eos=True, max_tokens_is_default=True)])["d"][0]
    assert len(d.token_ids) == 32 and d.finish_reason == "length"
    # Explicit null: up to max_model_len - prompt_len.
    n = engine.generate([request("n", prompt, ignore_eos=True)])["n"][0]
    assert len(n.token_ids) == 60 and n.finish_reason == "length"


def test_generation_config_source(qwen2_dir, tmp_path):
    """--generation-config as vLLM: auto (the model's file, above), vllm (ignored), or
    a folder; the generate endpoint takes max_tokens from it, as vLLM's scale-out
    serving does (its other sampling defaults belong to the OpenAI endpoints)."""
    prompt = [5, 6, 7, 8]
    omitted = lambda rid: request(rid, prompt, ignore_eos=True, max_tokens_is_default=True)  # noqa: E731
    plain = make_engine(qwen2_dir, max_model_len=64, generation_config="vllm")
    assert plain.model_info.default_max_tokens is None and plain.generation_defaults == {}
    assert len(plain.generate([omitted("v")])["v"][0].token_ids) == 60
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text('{"max_new_tokens": 5, "temperature": 0.2, "top_k": 7}')
    custom = make_engine(qwen2_dir, max_model_len=64, generation_config=str(folder))
    assert custom.generation_defaults == {"temperature": 0.2, "top_k": 7, "max_tokens": 5}
    assert len(custom.generate([omitted("c")])["c"][0].token_ids) == 5
    explicit = request("e", prompt, ignore_eos=True, max_tokens=9)  # the client's value wins
    assert len(custom.generate([explicit])["e"][0].token_ids) == 9
    with pytest.raises(ValueError, match="no generation_config.json"):
        make_engine(qwen2_dir, generation_config=str(tmp_path))


def test_generation_config_sampling_keys_are_not_generate_defaults(qwen2_dir, tmp_path):
    """vLLM 0.32's scale-out generate endpoint (token_in_token_out/serving.py) takes
    only max_tokens from get_diff_sampling_param(); the request's SamplingParams keep
    their own defaults for temperature, top_k, repetition_penalty... (those defaults
    belong to the OpenAI endpoints' to_sampling_params).  So a seeded request that
    omits them samples as one sending vLLM's neutral values, whatever the file says,
    and as under --generation-config vllm."""
    from common.protocol import GenerateRequest, SamplingParams

    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(
        '{"max_new_tokens": 12, "temperature": 0.05, "top_k": 1, "top_p": 0.5, "min_p": 0.2,'
        ' "repetition_penalty": 1.8}')
    prompt = [5, 6, 7, 8]

    def tokens(engine, rid, **params):
        req = GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                              params=SamplingParams(seed=11, ignore_eos=True, **params))
        return engine.generate([req])[rid][0].token_ids

    custom = make_engine(qwen2_dir, max_model_len=64, generation_config=str(folder))
    assert custom.generation_defaults["temperature"] == 0.05 and custom.generation_defaults["top_k"] == 1
    omitted = tokens(custom, "o", max_tokens_is_default=True)
    assert len(omitted) == 12  # max_new_tokens applies
    neutral = tokens(custom, "n", max_tokens=12, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                     repetition_penalty=1.0)
    assert omitted == neutral
    from_file = tokens(custom, "f", max_tokens=12, temperature=0.05, top_p=0.5, top_k=1, min_p=0.2,
                       repetition_penalty=1.8)
    assert from_file != omitted
    plain = make_engine(qwen2_dir, max_model_len=64, generation_config="vllm")
    assert tokens(plain, "v", max_tokens=12) == omitted


def test_text_mode_with_stop_string(llama_dir):
    engine = make_engine(llama_dir)
    prompt = [72, 101, 108, 108, 111]  # "Hello" in the byte tokenizer
    base = engine.generate([request("t", prompt, max_tokens=16, ignore_eos=True, output_text=True,
                                    allowed_token_ids=list(range(97, 123)))])["t"][0]
    text = base.text
    assert len(text) == 16 and text.isalpha() and text == bytes(base.token_ids).decode()
    stop = text[6:8]
    at = text.find(stop)
    d = engine.generate([request("s", prompt, max_tokens=16, ignore_eos=True, output_text=True, stop=[stop],
                                 allowed_token_ids=list(range(97, 123)), logprobs=1)])["s"][0]
    assert (d.finish_reason, d.stop_reason) == ("stop", stop)
    assert d.text == text[:at]
    assert d.token_ids == base.token_ids[:at + len(stop)]  # token ids keep the stop string's tokens
    assert d.logprobs.token_texts == [chr(t) for t in d.token_ids]
    # Tokens mode with a stop string also stops (no text returned).
    t = engine.generate([request("k", prompt, max_tokens=16, ignore_eos=True, stop=[stop],
                                 allowed_token_ids=list(range(97, 123)))])["k"][0]
    assert t.text is None and t.token_ids == d.token_ids and t.stop_reason == stop


def test_everything_at_once_under_pressure(llama_dir):
    """Shared prefixes, n=2, staggered arrivals, tiny step budget and a tiny KV pool
    (constant preemption + prefix-cache reuse): greedy and seeded outputs still match a roomy run."""
    base = random_prompts(1, 40, 41, seed=11)[0]
    tails = random_prompts(8, 1, 20, seed=12)
    prompts = [base[: 8 * (i % 4 + 1)] + t for i, t in enumerate(tails)]
    # n=2 requests sample with a seed (greedy allows only n=1): seeded choices are as reproducible.
    reqs = [request(str(i), p, max_tokens=6 + i % 3, ignore_eos=True, n=1 + i % 2, temperature=0.7 * (i % 2), seed=i)
            for i, p in enumerate(prompts)]
    roomy = make_engine(llama_dir, enable_prefix_caching=False, max_num_batched_tokens=512)
    expected = outputs(roomy, reqs)
    engine = make_engine(llama_dir, num_kv_blocks=12, block_size=8, max_model_len=96, max_num_batched_tokens=12)
    got: dict = {}
    pending = list(reqs)
    while pending or engine.has_unfinished():
        if pending:
            engine.add_request(pending.pop(0))
        for d in engine.step():
            got.setdefault(d.request_id, {}).setdefault(d.index, []).extend(d.token_ids)
    assert {rid: [got[rid][i] for i in sorted(got[rid])] for rid in got} == expected
    assert engine.scheduler.num_preemptions > 0 and engine.block_manager.hit_tokens > 0
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))


def test_abort_releases_text_held_back_for_stop_strings(llama_dir):
    """vLLM's abort output carries the text held back for stop-string matching, so the
    client ends with the same text as without stop strings."""
    prompt = random_prompts(1, 10, 11, seed=5)[0]
    texts = {}
    for name, stop in (("plain", None), ("held", ["\x01never"])):
        engine = make_engine(llama_dir)
        engine.add_request(request(name, prompt, max_tokens=50, ignore_eos=True, output_text=True, stop=stop))
        deltas = []
        for _ in range(10):
            deltas += engine.step()
        deltas += engine.abort(name)
        assert deltas[-1].finish_reason == "abort"
        texts[name] = "".join(d.text or "" for d in deltas)
    assert texts["plain"] and texts["held"] == texts["plain"]


def test_seed_minus_one_means_unseeded(llama_dir):
    """vLLM turns seed=-1 into None: two such requests must not repeat each other."""
    engine = make_engine(llama_dir)
    outs = [engine.generate([request(rid, [5, 6, 7], temperature=1.0, seed=-1, max_tokens=12, ignore_eos=True)])
            [rid][0].token_ids for rid in ("a", "b")]
    assert outs[0] != outs[1]
