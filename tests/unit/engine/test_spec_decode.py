"""Speculative decoding (n-gram drafts) in the engine: outputs identical to ordinary
decoding (greedy ids, logprobs, stops, penalties, chunked prefill, prefix cache,
preemption, mixed batches), sampled outputs distributed identically (chi-square at
a fixed seed set), the proposer, per-request counts and the config's refusals."""
from __future__ import annotations

import numpy as np
import pytest

from tests.support.engine_helpers import hf_greedy, make_engine, random_prompts, request
from worker.engine.spec_decode.config import SpeculativeConfig
from worker.engine.spec_decode.ngram import propose_ngram

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _repetitive(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a random phrase: the continuation often quotes them."""
    out = []
    for i, p in enumerate(random_prompts(n, 4, 12, seed=seed)):
        out.append((p * 4)[: 8 + 5 * i % 40])
    return out


def _run(engine, prompts, **params):
    res = engine.generate([request(str(i), p, **params) for i, p in enumerate(prompts)])
    return [res[str(i)] for i in range(len(prompts))]


def _spec_engine(model_dir, **kw):
    """Drafts for every decode (no per-step cap): exercises verification the most."""
    return make_engine(model_dir, speculative_config=dict(NGRAM), spec_max_step_tokens=kw.pop("cap", 0), **kw)


def test_ngram_proposer_matches_vllms_choice():
    t = np.array([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3])
    assert propose_ngram(t, 3, 1, 3).tolist() == [9, 1, 2]  # longest suffix, earliest occurrence
    assert propose_ngram(np.array([1, 1, 1, 1]), 3, 1, 3).tolist() == [1]  # what is left after it
    assert propose_ngram(t, 3, 4, 5).tolist() == []  # the longest match (3) is below min
    assert propose_ngram(np.array([4, 5, 6, 7]), 3, 1, 3).tolist() == []


@pytest.fixture(scope="module")
def engines(llama_dir):
    return make_engine(llama_dir), _spec_engine(llama_dir)


def test_greedy_ids_and_logprobs_equal_without_speculation(engines, llama_dir):
    base, spec = engines
    prompts = _repetitive(8, seed=1)
    want = _run(base, prompts, max_tokens=40, ignore_eos=True, logprobs=2)
    got = _run(spec, prompts, max_tokens=40, ignore_eos=True, logprobs=2)
    for w, g in zip(want, got):
        assert g[0].token_ids == w[0].token_ids
        np.testing.assert_allclose(g[0].logprobs.logprobs, w[0].logprobs.logprobs, atol=1e-4)
        assert g[0].logprobs.top_ids == w[0].logprobs.top_ids
    assert got[0][0].token_ids == hf_greedy(llama_dir, prompts[0], 40)[0]
    steps = [g[0].spec_decode for g in got]
    assert sum(sum(s.histogram[1:]) for s in steps) > 0, "no draft was ever accepted: the test proves nothing"
    for s, g in zip(steps, got):
        accepted = sum(j * c for j, c in enumerate(s.histogram))
        assert accepted <= s.num_draft_tokens == sum(s.per_step_drafted)
        assert sum(s.histogram) == len(s.per_step_accepted) and accepted == sum(s.per_step_accepted)
        # Each verify step emits its accepted drafts and one token of its own.
        assert accepted + sum(s.histogram) <= len(g[0].token_ids)


def test_stops_penalties_and_limits_are_exact(engines):
    base, spec = engines
    prompts = _repetitive(6, seed=2)
    params = [dict(max_tokens=17, ignore_eos=True, repetition_penalty=1.3),
              dict(max_tokens=30, ignore_eos=True, frequency_penalty=0.7, presence_penalty=0.4),
              dict(max_tokens=25, min_tokens=12),
              dict(max_tokens=9, ignore_eos=True)]
    for p in params:
        want = [r[0].token_ids for r in _run(base, prompts, **p)]
        got = [r[0].token_ids for r in _run(spec, prompts, **p)]
        assert got == want, p
    # A stop token inside an accepted run ends the output right there.
    first = _run(base, prompts[:1], max_tokens=30, ignore_eos=True)[0][0].token_ids
    stop = first[10]
    want = _run(base, prompts[:1], max_tokens=30, ignore_eos=True, stop_token_ids=[stop])[0][0]
    got = _run(spec, prompts[:1], max_tokens=30, ignore_eos=True, stop_token_ids=[stop])[0][0]
    assert got.token_ids == want.token_ids and got.token_ids[-1] == stop and got.stop_reason == stop


def test_chunked_prefill_prefix_cache_preemption_and_mixed_batches(llama_dir):
    prompts = _repetitive(10, seed=3) + random_prompts(4, 5, 60, seed=4)
    kw = dict(max_num_batched_tokens=24, num_kv_blocks=10, block_size=16, max_model_len=160, max_num_seqs=8)
    base = make_engine(llama_dir, **kw)
    spec = _spec_engine(llama_dir, **kw)
    lens = [10 + (7 * i) % 31 for i in range(len(prompts))]

    def run(engine):
        reqs = [request(str(i), p, max_tokens=m, ignore_eos=True) for i, (p, m) in enumerate(zip(prompts, lens))]
        reqs.append(request("sampled", prompts[0], max_tokens=12, n=2, temperature=1.0, seed=7, ignore_eos=True))
        res = engine.generate(reqs)
        return {k: [d.token_ids for d in v] for k, v in res.items()}

    want, got = run(base), run(spec)
    # Seeded sampling draws one number per verified position, so its tokens differ from
    # plain decoding's; they are reproducible run to run (the distribution is checked below).
    sampled = got.pop("sampled")
    del want["sampled"]
    assert got == want
    assert spec.scheduler.num_preemptions > 0, "the KV cache must be tight enough to preempt"
    again = run(spec)  # prefix-cache hits this time
    assert again.pop("sampled") == sampled
    assert again == want
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks


def _sampled(engine, prompt):
    """Tokens of 300 seeded requests (top-2 at temperature 1: drafts are proposed at
    almost every step and accepted about half the time)."""
    seeds = range(300)
    res = engine.generate([request(f"s{s}", prompt, seed=10_000 + s, max_tokens=10, ignore_eos=True,
                                   temperature=1.0, top_k=2) for s in seeds])
    return np.array([res[f"s{s}"][0].token_ids for s in seeds]), [res[f"s{s}"][0].spec_decode for s in seeds]


def _min_p_value(a: np.ndarray, b: np.ndarray) -> float:
    """The smallest per-position chi-square homogeneity p-value of two samples."""
    worst = 1.0
    for pos in range(a.shape[1]):
        vocab = sorted(set(a[:, pos]) | set(b[:, pos]))
        table = np.array([[np.sum(col == v) for v in vocab] for col in (a[:, pos], b[:, pos])])
        table = table[:, table.sum(0) >= 5]  # sparse cells make the test meaningless
        if table.shape[1] > 1:
            worst = min(worst, _chi2_homogeneity_p(table))
    return worst


@pytest.fixture(scope="module")
def plain_samples(llama_dir):
    return _sampled(make_engine(llama_dir, max_num_seqs=64), _repetitive(1, seed=5)[0])[0]


def test_sampled_outputs_are_distributed_as_without_speculation(llama_dir, plain_samples):
    """Per position, spec vs plain decoding over a fixed seed list (no flakiness): a
    chi-square homogeneity test at a level where a false alarm is negligible."""
    spec, stats = _sampled(_spec_engine(llama_dir, max_num_seqs=64), _repetitive(1, seed=5)[0])
    drafted = sum(s.num_draft_tokens for s in stats)
    accepted = sum(j * c for s in stats for j, c in enumerate(s.histogram))
    assert drafted > 500 and 0.1 < accepted / drafted < 0.9  # a real mix of accepts and rejects
    assert _min_p_value(plain_samples, spec) > 1e-3


def test_the_distribution_test_catches_a_biased_acceptance_rule(llama_dir, plain_samples, monkeypatch):
    import worker.engine.sample.verify as verify

    monkeypatch.setattr(verify, "accepted_prefix", lambda sampled, r, spec: len(spec))  # keep every draft
    spec, _ = _sampled(_spec_engine(llama_dir, max_num_seqs=64), _repetitive(1, seed=5)[0])
    assert _min_p_value(plain_samples, spec) < 1e-4


def _chi2_homogeneity_p(table: np.ndarray) -> float:
    """p-value of Pearson's chi-square test that the rows share one distribution."""
    import torch

    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    df = (table.shape[0] - 1) * (table.shape[1] - 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_chi2_helper_flags_a_biased_sample():
    assert _chi2_homogeneity_p(np.array([[100, 100, 100], [98, 103, 99]])) > 0.5
    assert _chi2_homogeneity_p(np.array([[100, 100, 100], [160, 70, 70]])) < 1e-4


def test_step_cap_and_backoff_limit_what_is_verified(llama_dir):
    """A CPU step verifies drafts only up to its token cap, the drafts going to the
    choices that accept most; a choice whose drafts keep failing stops drafting."""
    from worker.engine.spec_decode.speculator import NgramSpeculator

    engine = _spec_engine(llama_dir, cap=6)
    seen = []
    plan = engine.runner.plan

    def spy(scheduled):
        decodes = [s for s in scheduled if s.num_new_tokens - len(s.spec) == 1 and s.seq.num_output_tokens]
        seen.append((len(decodes), sum(len(s.spec) for s in decodes)))
        return plan(scheduled)

    engine.runner.plan = spy
    prompts = _repetitive(4, seed=6)
    want = [r[0].token_ids for r in _run(make_engine(llama_dir), prompts, max_tokens=24, ignore_eos=True)]
    assert [r[0].token_ids for r in _run(engine, prompts, max_tokens=24, ignore_eos=True)] == want
    assert all(rows + drafts <= 6 for rows, drafts in seen if drafts) and any(d for _, d in seen)

    spec = NgramSpeculator(engine.spec.config)
    seq = engine._new_sequence(_request_obj(engine), 0, [5, 6, 7, 5, 6])
    seq.num_computed_tokens = seq.num_tokens - 1
    spec.propose([seq], 256)
    assert spec.drafts(seq) == [7, 5, 6]
    for _ in range(3):
        spec.record(seq, 3, 0)
    spec.propose([seq], 256)
    assert spec.drafts(seq) == []  # backed off after rejections; it retries later
    for _ in range(40):
        spec.propose([seq], 256)
    assert spec.drafts(seq) == [7, 5, 6]


def _request_obj(engine):
    from worker.engine.records import Request

    req = request("x", [5, 6, 7, 5, 6], max_tokens=20)
    r = Request(req, arrival_seq=0, max_tokens=20, eos_token_ids=[257], now=0.0)
    r.spec_stats = engine.spec.new_stats()
    return r


def test_config_is_vllms_and_refusals_name_the_problem():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    assert SpeculativeConfig.parse({"method": "[ngram]", "num_speculative_tokens": 2,
                                    "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert SpeculativeConfig.parse(None) is None
    for bad, needle in [({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                        ({"method": "ngram"}, "num_speculative_tokens"),
                        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                          "prompt_lookup_max": 2}, "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
                        ({"method": "eagle", "num_speculative_tokens": 2}, "eagle"),
                        ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_method": "x"},
                         "acceptance_method"),
                        ("{not json", "not valid JSON")]:
        with pytest.raises(ValueError, match=needle):
            SpeculativeConfig.parse(bad)
    from worker.engine.config import EngineConfig

    with pytest.raises(ValueError, match="tensor-parallel"):
        EngineConfig(model="m", tensor_parallel_size=2, speculative_config=dict(NGRAM))


# --- draft-model proposer ---------------------------------------------------------

def _noisy_copy(model_dir, out, scale: float, seed: int = 0):
    """The checkpoint with seeded noise on every weight: a draft that agrees with its
    target often, not always."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    if not out.exists():
        shutil.copytree(model_dir, out)
        gen = torch.Generator().manual_seed(seed)
        weights = load_file(str(out / "model.safetensors"))
        save_file({k: v + scale * v.std() * torch.randn(v.shape, generator=gen) for k, v in weights.items()},
                  str(out / "model.safetensors"))
    return out


def _draft_engine(model_dir, draft_dir, k=3, **kw):
    return make_engine(model_dir, spec_max_step_tokens=kw.pop("cap", 0),
                       speculative_config={"method": "draft_model", "model": str(draft_dir),
                                           "num_speculative_tokens": k}, **kw)


@pytest.fixture(scope="module")
def noisy_draft(llama_dir, tmp_path_factory):
    return _noisy_copy(llama_dir, tmp_path_factory.mktemp("drafts") / "noisy", 0.3)


def test_draft_model_greedy_equals_plain(engines, llama_dir, noisy_draft):
    base, _ = engines
    prompts = random_prompts(6, 5, 40, seed=21)
    want = _run(base, prompts, max_tokens=30, ignore_eos=True, logprobs=1)
    for draft, full in ((llama_dir, True), (noisy_draft, False)):
        got = _run(_draft_engine(llama_dir, draft), prompts, max_tokens=30, ignore_eos=True, logprobs=1)
        accepted = drafted = 0
        for w, g in zip(want, got):
            assert g[0].token_ids == w[0].token_ids
            np.testing.assert_allclose(g[0].logprobs.logprobs, w[0].logprobs.logprobs, atol=1e-4)
            s = g[0].spec_decode
            accepted += sum(j * c for j, c in enumerate(s.histogram))
            drafted += s.num_draft_tokens
        if full:  # the target drafting for itself: every draft is accepted
            assert drafted > 0 and accepted == drafted
        else:
            assert 0 < accepted < drafted


def test_draft_model_with_chunked_prefill_prefix_cache_and_preemption(llama_dir, noisy_draft):
    prompts = random_prompts(10, 5, 60, seed=22)
    kw = dict(max_num_batched_tokens=24, num_kv_blocks=10, block_size=16, max_model_len=160, max_num_seqs=8)
    lens = [10 + (7 * i) % 31 for i in range(len(prompts))]

    def run(engine):
        res = engine.generate([request(str(i), p, max_tokens=m, ignore_eos=True)
                               for i, (p, m) in enumerate(zip(prompts, lens))])
        return {k: [d.token_ids for d in v] for k, v in res.items()}

    want = run(make_engine(llama_dir, **kw))
    spec = _draft_engine(llama_dir, noisy_draft, **kw)
    assert run(spec) == want
    assert spec.scheduler.num_preemptions > 0
    assert run(spec) == want  # prefix-cache hits: the draft's KV of cached blocks is reused too
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks


def test_draft_model_sampling_keeps_the_distribution(llama_dir, plain_samples):
    """The target as its own greedy draft: each draft is the argmax, kept about half the
    time under top-2 sampling."""
    spec, stats = _sampled(_draft_engine(llama_dir, llama_dir, max_num_seqs=64), _repetitive(1, seed=5)[0])
    drafted = sum(s.num_draft_tokens for s in stats)
    accepted = sum(j * c for s in stats for j, c in enumerate(s.histogram))
    assert drafted > 500 and 0.1 < accepted / drafted < 0.95
    assert _min_p_value(plain_samples, spec) > 1e-3


def test_draft_model_refusals(llama_dir, tmp_path):
    import json
    import shutil

    other = tmp_path / "other-vocab"
    other.mkdir()
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["vocab_size"] = 300
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="same vocabulary size. Target model vocab_size=320. Draft model "
                                         "vocab_size=300"):
        _draft_engine(llama_dir, other)
    with pytest.raises(ValueError, match="not a model folder"):
        _draft_engine(llama_dir, tmp_path / "missing")
    with pytest.raises(ValueError, match="needs 'model'"):
        SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="draft_tensor_parallel_size must be 1"):
        SpeculativeConfig.parse({"method": "draft_model", "model": "/m", "num_speculative_tokens": 2,
                                 "draft_tensor_parallel_size": 2})
    assert SpeculativeConfig.parse({"model": str(llama_dir), "num_speculative_tokens": 2}).method == "draft_model"
    shutil.rmtree(other)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_verification_rows_on_each_cpu_attention_backend(llama_dir, backend):
    """The last token plus drafts is a short prefill with context in every backend."""
    prompts = _repetitive(4, seed=23)
    want = _run(make_engine(llama_dir, attention_backend=backend), prompts, max_tokens=20, ignore_eos=True)
    engine = _spec_engine(llama_dir, attention_backend=backend)
    assert engine.attention_backend.name == backend
    got = _run(engine, prompts, max_tokens=20, ignore_eos=True)
    assert [g[0].token_ids for g in got] == [w[0].token_ids for w in want]
    assert sum(sum(g[0].spec_decode.histogram[1:]) for g in got) > 0


def test_draft_model_cache_sleeps_and_wakes_with_the_target(llama_dir, noisy_draft):
    engine = _draft_engine(llama_dir, noisy_draft)
    prompts = random_prompts(3, 5, 30, seed=24)
    want = [r[0].token_ids for r in _run(make_engine(llama_dir), prompts, max_tokens=16, ignore_eos=True)]
    assert [r[0].token_ids for r in _run(engine, prompts, max_tokens=16, ignore_eos=True)] == want
    engine.rl.sleep(1)
    assert engine.spec.runner.kv_cache is None
    assert engine.rl.wake_up()
    assert engine.spec.runner.kv_cache is not None
    assert [r[0].token_ids for r in _run(engine, prompts, max_tokens=16, ignore_eos=True)] == want


def test_token_mirror_follows_appends_and_cuts(llama_dir):
    from worker.engine.spec_decode.speculator import SeqDrafting, _token_array

    engine = make_engine(llama_dir)
    seq = engine._new_sequence(_request_obj(_spec_engine(llama_dir)), 0, list(range(5, 70)))
    st = SeqDrafting()  # the speculator's state of seq
    assert _token_array(seq, st).tolist() == seq.token_ids
    for t in range(200):  # past the first buffer: grown in place
        seq.append_token(t % 50)
        assert _token_array(seq, st).tolist() == seq.token_ids
    del seq.token_ids[-3:]  # a stop string cut the list
    seq.token_ids.append(7)
    assert _token_array(seq, st).tolist() == seq.token_ids


def test_draft_model_limits(llama_dir, tmp_path):
    """A draft with a shorter context drafts only within it; a long catch-up is chunked
    to the step's token budget; n > 1 stats reach the wire once."""
    import json
    import shutil

    short = tmp_path / "short"
    shutil.copytree(llama_dir, short)
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 64
    (short / "config.json").write_text(json.dumps(cfg))
    prompts = [p * 2 for p in random_prompts(3, 30, 40, seed=25)]  # 60-80 tokens: past the draft's context
    want = [r[0].token_ids for r in _run(make_engine(llama_dir), prompts, max_tokens=20, ignore_eos=True)]
    assert [r[0].token_ids for r in _run(_draft_engine(llama_dir, short), prompts, max_tokens=20,
                                         ignore_eos=True)] == want  # it used to crash its rotary table

    engine = _draft_engine(llama_dir, llama_dir, max_num_batched_tokens=32)
    forward = engine.spec.runner.forward
    sizes = []
    engine.spec.runner.forward = lambda views: sizes.append(sum(v.num_new_tokens for v in views)) or forward(views)
    got = _run(engine, prompts, max_tokens=20, ignore_eos=True)
    assert [r[0].token_ids for r in got] == want
    assert sizes and max(sizes) <= 32  # an 80-token context caught up in budget-sized chunks
    assert sum(sum(r[0].spec_decode.histogram[1:]) for r in got) > 0

    multi = _run(_spec_engine(llama_dir), _repetitive(1, seed=26), max_tokens=12, n=3, temperature=1.0, seed=1,
                 ignore_eos=True)[0]
    assert sum(d.spec_decode is not None for d in multi) == 1


def test_routed_experts_cover_accepted_drafts(tiny_model):
    """A choice that finishes inside a run of accepted drafts reports the routing of
    every position, as without speculation."""
    import io

    moe = tiny_model("mixtral")
    base = _repetitive(4, seed=27)
    prompts = [p for p in base for _ in range(8)]
    lens = [6 + 3 * j for _ in base for j in range(8)]  # some finish right after accepting drafts

    def routing(engine):
        res = engine.generate([request(str(i), p, max_tokens=m, ignore_eos=True)
                               for i, (p, m) in enumerate(zip(prompts, lens))])
        return [(res[str(i)][0].token_ids, np.load(io.BytesIO(res[str(i)][0].routed_experts)))
                for i in range(len(prompts))]

    want = routing(make_engine(moe, enable_return_routed_experts=True))
    got = routing(_spec_engine(moe, enable_return_routed_experts=True))
    for (wt, wr), (gt, gr) in zip(want, got):
        assert gt == wt
        np.testing.assert_array_equal(gr, wr)
