"""Sampler: each processing step against hand-computed expectations on small logits,
seeded reproducibility, logprobs/ranks, prompt logprobs and token-id scoring."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from common.protocol import SamplingParams
from worker.engine.sample.logprobs import (clamp_logprob, compute_prompt_logprobs, extend_token_logprobs,
                                    score_token_ids, to_token_logprobs)
from worker.engine.sample import sampling_metadata
from worker.engine.sample.sampler import Sampler, apply_top_k_top_p
from worker.engine.sample.sampling_metadata import (SamplingMetadata, SamplingRow, make_generator,
                                             tokenize_bad_words)

V = 8
NEG_INF = float("-inf")


def row(prompt=(0,), output=(), seed=None, index=0, stop_ids=(), bad=None, **kw) -> SamplingRow:
    params = SamplingParams(seed=seed, **kw)
    gen = make_generator(seed, index, "cpu") if seed is not None else None
    return SamplingRow(params=params, prompt_token_ids=list(prompt), output_token_ids=list(output),
                       generator=gen, stop_ids_for_min_tokens=list(stop_ids), bad_words_ids=bad)


def run(logits, rows):
    meta = SamplingMetadata.build(rows, logits.shape[-1], "cpu")
    return Sampler()(logits.clone(), meta), meta


def processed(logits, r):
    """Logits of one row after the argmax-changing processors (bias, masks, penalties)."""
    from worker.engine.sample.sampler import apply_logits_processors
    meta = SamplingMetadata.build([r], logits.shape[-1], "cpu")
    return apply_logits_processors(logits.clone().unsqueeze(0), meta)[0]


BASE = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0, 0.0, -0.5])


def test_greedy_is_argmax_and_fast_path_builds_nothing():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    out, meta = run(logits, [row(temperature=0.0) for _ in range(5)])
    assert torch.equal(out.sampled, logits.argmax(-1))
    assert out.logprobs is None
    assert meta.all_greedy and meta.temperature is None and meta.penalties is None
    assert meta.full_vocab is None and meta.top_k_candidates is None


def test_repetition_penalty_prompt_and_output():
    r = row(prompt=[0, 1], output=[3], repetition_penalty=2.0)
    got = processed(BASE, r)
    want = BASE.clone()
    want[0] = 2.0 / 2  # positive: divided
    want[1] = -1.0 * 2  # negative: multiplied
    want[3] = 3.0 / 2  # seen in output
    assert torch.allclose(got, want)


def test_frequency_and_presence_penalties_use_output_only():
    r = row(prompt=[5], output=[3, 3, 2], frequency_penalty=0.5, presence_penalty=0.25)
    got = processed(BASE, r)
    want = BASE.clone()
    want[3] -= 0.5 * 2 + 0.25
    want[2] -= 0.5 * 1 + 0.25
    assert torch.allclose(got, want)  # token 5 only in the prompt: untouched


def test_penalties_only_touch_rows_that_ask():
    logits = torch.stack([BASE, BASE])
    meta = SamplingMetadata.build([row(output=[3], presence_penalty=1.0), row(output=[3])], V, "cpu")
    from worker.engine.sample.sampler import apply_logits_processors
    out = apply_logits_processors(logits.clone(), meta)
    assert out[0, 3] == 2.0 and torch.equal(out[1], BASE)


def test_logit_bias_clamped_and_allowed_token_ids():
    got = processed(BASE, row(logit_bias={4: 1000.0, 0: -1.5}))
    want = BASE.clone()
    want[4] += 100.0  # clamped to +100
    want[0] -= 1.5
    assert torch.allclose(got, want)
    got = processed(BASE, row(allowed_token_ids=[1, 4]))
    assert torch.isinf(got[[0, 2, 3, 5, 6, 7]]).all()
    assert got[1] == -1.0 and got[4] == -2.0
    out, _ = run(BASE.unsqueeze(0), [row(temperature=0.0, allowed_token_ids=[1, 4])])
    assert out.sampled.item() == 1


def test_bad_words_single_and_multi_token():
    got = processed(BASE, row(output=[6, 2], bad=[[3], [2, 5], [6, 2, 0], [7, 1]]))
    assert got[3] == NEG_INF  # single-token word: always banned
    assert got[5] == NEG_INF  # output ends with [2]
    assert got[0] == NEG_INF  # output ends with [6, 2]
    assert got[1] == -1.0  # prefix [7] absent
    assert torch.equal(got[[2, 4, 6, 7]], BASE[[2, 4, 6, 7]])


def test_bad_word_continuation_banned_when_prefix_ends_output():
    assert processed(BASE, row(output=[4, 2], bad=[[2, 5]]))[5] == NEG_INF
    assert processed(BASE, row(output=[2, 4], bad=[[2, 5]]))[5] == 1.0
    assert processed(BASE, row(output=[], bad=[[2, 5]]))[5] == 1.0


def test_min_tokens_masks_stop_ids_until_reached():
    r = row(output=[1], min_tokens=2, stop_ids=[3, 0])
    got = processed(BASE, r)
    assert got[3] == NEG_INF and got[0] == NEG_INF
    out, _ = run(BASE.unsqueeze(0), [row(output=[1], temperature=0.0, min_tokens=2, stop_ids=[3, 0])])
    assert out.sampled.item() == 5
    got = processed(BASE, row(output=[1, 1], min_tokens=2, stop_ids=[3, 0]))
    assert torch.equal(got, BASE)


def _kept(logits, n=2000, **kw):
    """Token ids the real sampler can produce for one row's params (n draws)."""
    out, _ = run(logits.unsqueeze(0).repeat(n, 1), [row(**kw) for _ in range(n)])
    return sorted(set(out.sampled.tolist()))


@pytest.fixture(params=["candidates", "full_vocab"])
def sampling_path(request, monkeypatch):
    """Run top-k rows through the top-k candidate path, or force the full-vocab path."""
    if request.param == "full_vocab":
        monkeypatch.setattr(sampling_metadata, "MAX_CANDIDATE_TOP_K", 0)
    return request.param


def test_top_k_top_p_min_p_hand_computed(sampling_path):
    assert _kept(BASE, top_k=2) == [0, 3]
    assert _kept(BASE, top_k=-1) == list(range(V))
    p = torch.softmax(BASE, -1)
    order = torch.argsort(p, descending=True).tolist()
    cum = torch.cumsum(p[order], 0)
    # smallest prefix with mass >= top_p (of the distribution renormalised over top-6)
    cum6 = torch.cumsum(p[order[:6]] / p[order[:6]].sum(), 0)
    for top_p in (0.3, 0.6, 0.75, 0.9, 0.99):
        n = int((cum < top_p).sum().item()) + 1
        assert _kept(BASE, top_p=top_p) == sorted(order[:n]), top_p
        n6 = int((cum6 < top_p).sum().item()) + 1
        assert _kept(BASE, top_p=top_p, top_k=6) == sorted(order[:n6]), top_p
    # top-p applies to the distribution renormalised over the top-k survivors
    pk = p[order[:3]] / p[order[:3]].sum()
    assert pk[0] > 0.6 and _kept(BASE, top_k=3, top_p=0.6) == [3]
    assert pk[0] + pk[1] > 0.8 > pk[0] and _kept(BASE, top_k=3, top_p=0.8) == [0, 3]
    # min_p: keep tokens with p >= min_p * p_max
    for min_p in (0.1, 0.3, 0.5):
        want = sorted(torch.nonzero(p >= min_p * p.max()).flatten().tolist())
        assert _kept(BASE, min_p=min_p) == want
        assert _kept(BASE, min_p=min_p, top_k=4) == sorted(set(want) & set(order[:4]))
    # temperature reshapes the distribution before top_p
    pt = torch.softmax(BASE / 0.5, -1)
    assert pt.max() > 0.75 and _kept(BASE, temperature=0.5, top_p=0.75) == [3]
    assert _kept(BASE, temperature=0.5, top_p=0.75, top_k=5) == [3]


def test_top_k_path_frequencies_match_renormalised_probs(sampling_path):
    n = 6000
    out, meta = run(BASE.unsqueeze(0).repeat(n, 1), [row(top_k=3) for _ in range(n)])
    assert (meta.top_k_candidates is not None) == (sampling_path == "candidates")
    p = torch.softmax(BASE, -1)[[3, 0, 5]]
    freq = torch.bincount(out.sampled, minlength=V).float()[[3, 0, 5]] / n
    assert torch.allclose(freq, p / p.sum(), atol=0.03)


def test_mixed_paths_in_one_batch():
    logits = torch.stack([BASE] * 4)
    rows = [row(top_k=1), row(temperature=0.0, allowed_token_ids=[6]), row(top_k=1000, top_p=0.3),
            row(top_k=2, seed=3)]
    out, meta = run(logits, rows)
    assert meta.full_vocab.row_ids == [2] and meta.top_k_candidates.row_ids == [0, 3]
    assert out.sampled[:3].tolist() == [3, 6, 3] and out.sampled[3].item() in (0, 3)


def test_top_k_top_p_masks_each_row_with_its_own_values():
    logits = torch.stack([BASE, BASE, BASE])
    x = logits.clone()
    k = torch.tensor([1, V, 3])
    apply_top_k_top_p(x, k, 3, None)
    assert torch.isfinite(x).sum(-1).tolist() == [1, V, 3]
    x = logits.clone()
    apply_top_k_top_p(x, k, 3, torch.tensor([1.0, 0.5, 1.0]))
    assert torch.isfinite(x).sum(-1).tolist() == [1, 1, 3]


def test_random_sampling_matches_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]]).clamp_min(1e-30)).repeat(4000, 1)
    out, _ = run(logits, [row(temperature=1.0) for _ in range(4000)])
    freq = torch.bincount(out.sampled, minlength=4).float() / 4000
    assert torch.allclose(freq[:3], torch.tensor([0.5, 0.3, 0.2]), atol=0.04)
    assert freq[3] == 0


def test_seeded_rows_reproducible_regardless_of_batch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 1000, generator=g)
    others = torch.randn(6, 1000, generator=g)

    def tokens(batch_logits, rows, target):
        seq = []
        for _ in range(5):
            out, _ = run(batch_logits, rows)
            seq.append(out.sampled[target].item())
        return seq

    alone = tokens(logits, [row(seed=42, temperature=1.0)], 0)
    mixed_rows = [row(temperature=0.7), row(temperature=0.0), row(seed=42, temperature=1.0),
                  row(seed=7, temperature=1.0, top_k=5), row(temperature=1.2)]
    batch = torch.cat([others[:2], logits, others[2:4]])
    assert tokens(batch, mixed_rows, 2) == alone
    # n>1: choice i uses seed + i -> distinct but reproducible streams
    # same on the top-k candidate path, where the batch's largest k differs
    alone_k = tokens(logits, [row(seed=9, top_k=5, top_p=0.9)], 0)
    mixed_k = [row(top_k=50), row(seed=9, top_k=5, top_p=0.9), row(seed=1, top_k=200)]
    assert tokens(torch.cat([others[:1], logits, others[1:2]]), mixed_k, 1) == alone_k
    c1 = tokens(logits, [row(seed=42, index=1, temperature=1.0)], 0)
    c1_again = tokens(logits, [row(seed=42, index=1, temperature=1.0)], 0)
    assert c1 == c1_again and c1 != alone


def test_greedy_and_random_rows_in_one_batch():
    logits = torch.stack([BASE, BASE])
    out, _ = run(logits, [row(temperature=0.0), row(temperature=1.0, top_k=1)])
    assert out.sampled.tolist() == [3, 3]


def test_logprobs_are_raw_with_ranks():
    logits = torch.stack([BASE, BASE])
    # penalties and temperature must not change the reported logprobs
    rows = [row(temperature=0.0, logprobs=3, allowed_token_ids=[6]),
            row(temperature=0.5, logprobs=1, repetition_penalty=1.5, output=[3])]
    out, meta = run(logits, rows)
    raw = torch.log_softmax(BASE, -1)
    lp = out.logprobs
    assert out.sampled[0].item() == 6
    assert lp.top_ids.shape == (2, 3)
    assert lp.top_ids[0].tolist() == [3, 0, 5]
    assert torch.allclose(lp.top_logprobs[0], raw[[3, 0, 5]])
    assert math.isclose(lp.token_logprobs[0].item(), raw[6].item(), rel_tol=1e-6)
    assert lp.ranks[0].item() == 5  # 3, 0, 5, 2 are larger than token 6's 0.0
    lists = lp.tolists()
    t0 = to_token_logprobs(lists, 0, 3)
    assert t0.token_ids == [6] and t0.ranks == [5] and t0.top_ids == [[3, 0, 5]]
    t1 = to_token_logprobs(lists, 1, 1)
    assert len(t1.top_ids[0]) == 1 and t1.top_ids[0] == [3]
    merged = extend_token_logprobs(t0, t1)
    assert merged.token_ids == [6, out.sampled[1].item()] and len(merged.top_ids) == 2


def test_rank_counts_strictly_greater():
    logits = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    out, _ = run(logits, [row(temperature=0.0, logprobs=0)])
    assert out.sampled.item() == 0 and out.logprobs.ranks.item() == 1
    assert out.logprobs.top_ids.shape == (1, 0)
    out, _ = run(logits, [row(temperature=0.0, logprobs=-1, allowed_token_ids=[2])])
    assert out.logprobs.ranks.item() == 4 and out.logprobs.top_ids.shape == (1, 4)


def test_logprob_clamp():
    assert clamp_logprob(float("nan")) == -9999.0
    assert clamp_logprob(float("-inf")) == -9999.0
    assert clamp_logprob(-12345.0) == -9999.0 and clamp_logprob(-1.5) == -1.5


def test_prompt_logprobs_and_score_token_ids():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, V, generator=g)
    targets = torch.tensor([4, 0, 7])
    res = compute_prompt_logprobs(logits, targets, 2)
    raw = torch.log_softmax(logits, -1)
    assert torch.allclose(res.token_logprobs, raw.gather(1, targets[:, None])[:, 0])
    want_rank = (raw > raw.gather(1, targets[:, None])).sum(-1) + 1
    assert res.ranks.tolist() == want_rank.tolist()
    assert torch.equal(res.top_ids, raw.topk(2, -1).indices)
    scores = score_token_ids(logits, [[1, 2], [5], [3, -1, 6]])
    assert scores.dtype == np.float32 and scores.shape == (3, 3)
    assert np.allclose(scores[0, :2], raw[0, [1, 2]].numpy())
    assert scores[0, 2] == -np.inf and scores[1, 1] == -np.inf and scores[2, 1] == -np.inf
    assert np.isclose(scores[2, 2], raw[2, 6].item())
    with pytest.raises(ValueError):
        score_token_ids(logits, [[1]])


class _WordTok:
    """Minimal encoder: words map to ids, a leading space gives a different id."""

    vocab = {"bad": [1], " bad": [2], "two words": [3, 4], " two words": [5, 6],
             "x": [7], " x": [7, 8]}

    def encode(self, text, add_special_tokens=False):
        return list(self.vocab.get(text, []))


def test_tokenize_bad_words_with_and_without_space():
    assert tokenize_bad_words(_WordTok(), ["bad"]) == [[1], [2]]
    assert tokenize_bad_words(_WordTok(), ["two words"]) == [[3, 4], [5, 6]]
    # spaced form of a different length is dropped (vLLM)
    assert tokenize_bad_words(_WordTok(), ["x"]) == [[7]]
    with pytest.raises(ValueError):
        tokenize_bad_words(_WordTok(), ["zzz"])


def test_persistent_row_caches_follow_the_live_output_list():
    r = row(prompt=[1, 1, 4], output=[], repetition_penalty=1.5, frequency_penalty=0.5,
            allowed_token_ids=[0, 2, 3, 5])
    for new_tok in (3, 2, 3, 5):
        r.output_token_ids.append(new_tok)  # the engine appends to the live list
        fresh = row(prompt=[1, 1, 4], output=list(r.output_token_ids), repetition_penalty=1.5,
                    frequency_penalty=0.5, allowed_token_ids=[0, 2, 3, 5])
        assert torch.equal(processed(BASE, r), processed(BASE, fresh))
    cpu = torch.device("cpu")
    ids, counts = r.penalty_tensors(cpu)
    assert ids.tolist() == [1, 4, 3, 2, 5] and counts.tolist() == [0, 0, 2, 1, 1]
    del r.output_token_ids[2:]  # a shrunk list (e.g. recompute) rebuilds the counts
    ids, counts = r.penalty_tensors(cpu)
    assert ids.tolist() == [1, 4, 3, 2] and counts.tolist() == [0, 0, 1, 1]
    r.output_token_ids.extend([2, 6])
    ids, counts = r.penalty_tensors(cpu)
    assert ids.tolist() == [1, 4, 3, 2, 6] and counts.tolist() == [0, 0, 1, 2, 1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sampler_matches_cpu_semantics():
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 300, generator=g)
    rows = [row(temperature=0.0, logprobs=3, output=[1, 2], repetition_penalty=1.3),
            row(temperature=0.8, top_k=5, seed=3, allowed_token_ids=list(range(50))),
            row(temperature=1.0, top_p=0.5, min_p=0.1, logit_bias={7: 5.0}),
            row(temperature=0.0, bad=[[int(logits[3].argmax())]])]
    for r in rows:
        if r.params.seed is not None:
            r.generator = make_generator(r.params.seed, 0, dev)
    cpu_rows = [row(temperature=0.0, logprobs=3, output=[1, 2], repetition_penalty=1.3)]
    cpu_out, _ = run(logits[:1], cpu_rows)
    meta = SamplingMetadata.build(rows, 300, dev)
    out = Sampler()(logits.to(dev), meta)
    assert out.sampled.device.type == "cuda"
    assert out.sampled[0].item() == cpu_out.sampled[0].item()
    top5 = set(logits[1, :50].topk(5).indices.tolist())
    assert out.sampled[1].item() in top5
    assert out.sampled[3].item() != int(logits[3].argmax())
    assert torch.allclose(out.logprobs.top_logprobs[0].cpu(), cpu_out.logprobs.top_logprobs[0],
                          atol=1e-5)


def test_prompt_logprobs_blocks_match_one_shot(monkeypatch):
    from worker.engine.sample import logprobs as lp_mod
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(7, V, generator=g)
    targets = torch.randint(0, V, (7,), generator=g)
    rows = [[t, (t + 1) % V] for t in targets.tolist()]
    whole = compute_prompt_logprobs(logits, targets, 3)
    whole_scores = score_token_ids(logits, rows)
    monkeypatch.setattr(lp_mod, "PROMPT_ROWS_PER_BLOCK", 3)
    blocked = compute_prompt_logprobs(logits, targets, 3)
    for f in ("token_ids", "token_logprobs", "ranks", "top_ids", "top_logprobs"):
        assert torch.equal(getattr(whole, f), getattr(blocked, f)), f
    assert np.array_equal(score_token_ids(logits, rows), whole_scores)
    assert np.allclose(whole_scores[:, 0], whole.token_logprobs.numpy())
