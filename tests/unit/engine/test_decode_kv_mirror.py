"""Decode K/V mirror (worker/engine/attention/backends/torch_sdpa.py: DecodeKVMirror): consecutive
decode-only steps append to a per-layer contiguous copy instead of re-gathering
every block.  Its outputs must be bit-identical to the gather path's."""
from __future__ import annotations

import torch

from tests.unit.engine.test_model import PagedSeqs, _tokens
from worker.engine.loading.loader import load_model


def _pair(path, headroom: int | None = None):
    """(model using the mirror, reference model that always gathers)."""
    mirrored, gathering = load_model(path), load_model(path)
    for layer in gathering.layers:
        layer.attn.impl.mirror.MAX_BYTES = 0
    if headroom is not None:
        for layer in mirrored.layers:
            layer.attn.impl.mirror.HEADROOM = headroom
    return mirrored, gathering


def _step_both(a: PagedSeqs, b: PagedSeqs, chunks) -> None:
    got, ref = a.step(chunks), b.step(chunks)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)


def test_mirror_matches_gather_across_batch_changes(tiny_model):
    mirrored, gathering = _pair(tiny_model("qwen3"))
    a, b = PagedSeqs(mirrored), PagedSeqs(gathering)
    toks = {name: _tokens(60, seed=i) for i, name in enumerate("ABCD")}
    _step_both(a, b, [("A", toks["A"][:20]), ("B", toks["B"][:7]), ("C", toks["C"][:33])])
    mirror = mirrored.layers[0].attn.impl.mirror
    assert mirror.k is None  # prefill steps never build it
    kept = None
    for pos in range(6):  # decode-only steps over uneven lengths: built once, then appended to
        _step_both(a, b, [("A", [toks["A"][20 + pos]]), ("B", [toks["B"][7 + pos]]), ("C", [toks["C"][33 + pos]])])
        assert mirror.k is not None and mirror.k.shape[0] == 3
        if pos:
            assert mirror.k is kept
        kept = mirror.k
    # B leaves, D arrives: the mixed step drops the mirror ...
    _step_both(a, b, [("A", [toks["A"][26]]), ("D", toks["D"][:9]), ("C", [toks["C"][39]])])
    assert mirror.k is None
    # ... and the next decode-only steps rebuild it for the new rows.
    for pos in range(4):
        _step_both(a, b, [("A", [toks["A"][27 + pos]]), ("C", [toks["C"][40 + pos]]), ("D", [toks["D"][9 + pos]])])
    assert mirror.k is not None and mirror.k.shape[0] == 3
    # A row dropped between two decode-only steps: rebuilt, still identical.
    _step_both(a, b, [("C", [toks["C"][44]]), ("D", [toks["D"][13]])])
    assert mirror.k.shape[0] == 2


def test_mirror_rebuilds_when_full(tiny_model):
    """A tiny headroom forces rebuilds on growth; outputs stay identical."""
    mirrored, gathering = _pair(tiny_model("llama"), headroom=1)
    a, b = PagedSeqs(mirrored), PagedSeqs(gathering)
    toks = _tokens(40, seed=7)
    _step_both(a, b, [("x", toks[:10]), ("y", toks[:3])])
    caps = set()
    for pos in range(12):
        _step_both(a, b, [("x", [toks[10 + pos]]), ("y", [toks[3 + pos]])])
        caps.add(mirrored.layers[0].attn.impl.mirror.k.shape[2])  # [B, kvh, cap, D]
    assert len(caps) > 1
