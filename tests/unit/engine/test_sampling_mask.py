"""sampling_mask (mask replay): the ids that survived the sampler's filters, per
sampled token, against hand-computed supports on an 8-token vocabulary, through both
sampling paths (full vocabulary, small-top-k candidates), in mixed batches, and out
of the engine."""
from __future__ import annotations

import pytest
import torch

from tests.support.engine_helpers import make_engine, request
from tests.unit.engine.test_sampler import BASE, row, run

# BASE = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0, 0.0, -0.5]; by logit: 3 > 0 > 5 > 2 > 6 > 7 > 1 > 4.
# softmax: 3: .592, 0: .218, 5: .080, 2: .049, 6: .029, 7: .018, 1: .011, 4: .004
CASES = [
    (dict(top_k=3), [0, 3, 5]),  # the candidates path (small top_k)
    (dict(top_p=0.8), [0, 3]),  # mass above 5 is .809 >= .8: dropped
    (dict(top_p=0.85), [0, 3, 5]),
    (dict(top_k=3, top_p=0.7), [0, 3]),  # top_p renormalised over the top 3
    (dict(min_p=0.1), [0, 3, 5]),  # p >= .0592
    (dict(min_p=0.05), [0, 2, 3, 5]),  # p >= .0296: 6 (.0294) falls out
    (dict(top_k=4, min_p=0.2), [0, 3]),
    (dict(allowed_token_ids=[1, 2, 4]), [1, 2, 4]),
    (dict(allowed_token_ids=[1, 2, 4, 6], top_k=3), [1, 2, 6]),
    (dict(logit_bias={3: -100.0, 7: 5.0}), list(range(8))),  # a bias is clamped to +-100: still finite
    (dict(logit_bias={3: -100.0}, top_k=2), [0, 5]),
    (dict(), list(range(8))),
]


@pytest.mark.parametrize("params,expected", CASES, ids=[str(c[0]) for c in CASES])
def test_support_after_filters(params, expected):
    out, _ = run(BASE.unsqueeze(0), [row(temperature=1.0, seed=3, **params)])
    masks = masks_of(BASE.unsqueeze(0), [row(temperature=1.0, seed=3, **params)])
    assert masks == [expected]
    assert out.masks is None  # only when asked


def masks_of(logits, rows):
    from worker.engine.sample.sampler import Sampler
    from worker.engine.sample.sampling_metadata import SamplingMetadata

    meta = SamplingMetadata.build(rows, logits.shape[-1], "cpu")
    out = Sampler()(logits.clone(), meta, return_mask=True)
    for r, m in zip(out.sampled.tolist(), out.masks):
        assert r in m  # the sampled token is always in its support
    return out.masks


def test_bad_words_ban_their_last_token():
    masks = masks_of(BASE.unsqueeze(0), [row(temperature=1.0, top_k=3, output=[6], bad=[[3], [6, 0]])])
    assert masks == [[2, 5, 6]]  # 3 banned outright, 0 after the output ends in 6; the top 3 of the rest


def test_greedy_rows_hold_the_argmax_in_a_mixed_batch():
    logits = torch.stack([BASE, BASE.flip(0), BASE, BASE])
    masks = masks_of(logits, [row(temperature=0.0), row(temperature=1.0, top_k=2),
                                   row(temperature=0.0, allowed_token_ids=[1, 4]),
                                   row(temperature=0.7, top_p=0.8)])
    # row 1 is BASE reversed: its top 2 are ids 4 (3.0) and 7 (2.0).  Row 3 at
    # temperature 0.7 sharpens: 3 alone holds .73 of the mass, 0 brings it past .8.
    assert masks == [[3], [4, 7], [1], [0, 3]]


def test_full_vocab_path_with_a_large_top_k():
    logits = torch.randn(2, 600, generator=torch.Generator().manual_seed(0))
    masks = masks_of(logits, [row(temperature=1.0, top_k=300), row(temperature=1.0, top_k=300, min_p=0.5)])
    assert masks[0] == sorted(logits[0].topk(300).indices.tolist())
    probs = logits[1].softmax(-1)
    assert masks[1] == (probs >= 0.5 * probs.max()).nonzero().squeeze(1).tolist()


def test_engine_sends_one_mask_per_token(llama_dir):
    engine = make_engine(llama_dir, return_sampling_mask=True)
    res = engine.generate([request("g", [5, 6, 7], max_tokens=4, ignore_eos=True),
                           request("k", [5, 6, 7], max_tokens=5, temperature=1.0, top_k=4, seed=1, ignore_eos=True)])
    (g,), (k,) = res["g"], res["k"]
    assert g.sampling_mask == [[t] for t in g.token_ids]
    assert len(k.sampling_mask) == 5 and all(len(m) == 4 and t in m for m, t in zip(k.sampling_mask, k.token_ids))
    engine.add_request(request("s", [5, 6, 7], max_tokens=3, ignore_eos=True))
    deltas = []
    while engine.has_unfinished():
        deltas.extend(engine.step())
    assert [len(d.sampling_mask) for d in deltas] == [1, 1, 1]  # each delta: its own tokens'


def test_stop_string_trims_the_masks_of_dropped_tokens(llama_dir):
    """A stop string cuts tokens from the output; their masks go with them."""
    engine = make_engine(llama_dir, return_sampling_mask=True)
    letters = dict(temperature=1.0, seed=0, allowed_token_ids=list(range(97, 123)), max_tokens=12, ignore_eos=True,
                   output_text=True)  # byte ids of a..z: printable text to stop on
    (free,) = engine.generate([request("f", [72, 101], **letters)])["f"]
    assert all(len(m) == 26 for m in free.sampling_mask)
    text = free.text
    # The first character after the second that has not appeared before it.
    stop = next(c for i, c in enumerate(text) if i >= 2 and c not in text[:i])
    (cut,) = engine.generate([request("c", [72, 101], stop=[stop], **letters)])["c"]
    assert len(cut.sampling_mask) == len(cut.token_ids) < len(free.token_ids)
    assert cut.sampling_mask == free.sampling_mask[:len(cut.token_ids)]
