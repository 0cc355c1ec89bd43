"""Tokenizer.encode of a long text, done in pieces (common/tokenizer.py
``_encode_in_chunks``), gives exactly the ids the whole text encodes to: on trained
byte-level (GPT/Qwen-style) and metaspace (SentencePiece-style) BPE vocabularies, with
and without a BOS/EOS post-processor, on text with words, numbers, punctuation, runs of
spaces and newlines."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from common import tokenizer as tokmod
from common.tokenizer import Tokenizer

WORDS = ["hello", "world", "the", "tokenizer", "ab", "ba", "x", "123", "4567", "é", "naïve", "don't", "ñandú",
         "<tag>", "!!", "...", "\t", "  ", "   ", "\n", "\n\n", " \n", "日本語"]


def _text(n: int, seed: int) -> str:
    rnd = random.Random(seed)
    out, size = [], 0
    while size < n:
        w = rnd.choice(WORDS)
        sep = rnd.choice([" ", " ", " ", "", "  ", "\n"])
        out.append(w + sep)
        size += len(w) + len(sep)
    return "".join(out)


def _trained(kind: str, post: bool) -> HFTokenizer:
    tok = HFTokenizer(models.BPE(unk_token=None if kind == "bytelevel" else "<unk>"))
    if kind == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>", "<unk>"], initial_alphabet=alphabet)
    tok.train_from_iterator([_text(20_000, s) for s in range(5)], trainer)
    if post:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[
            ("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))])
    return tok


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
@pytest.mark.parametrize("post", [False, True])
def test_long_text_encodes_to_the_same_ids_in_pieces(monkeypatch, kind, post):
    monkeypatch.setattr(tokmod, "_CHUNK", 2048)  # many cuts on a test-sized text
    hf = _trained(kind, post)
    ours = Tokenizer(hf)
    for seed in range(3):
        text = _text(40_000, 100 + seed)
        for special in (False, True):
            want = hf.encode(text, add_special_tokens=special).ids
            assert ours.encode(text, add_special_tokens=special) == want, (kind, post, seed, special)
    # The pieces path really ran (it returns None where it falls back to a whole encode).
    assert ours._encode_in_chunks(_text(40_000, 7), False) is not None


def test_a_cut_inside_an_added_token_is_refused(monkeypatch):
    """An added token with a space inside ("ab ba"): the window check refuses cuts there."""
    monkeypatch.setattr(tokmod, "_CHUNK", 512)
    hf = _trained("bytelevel", False)
    hf.add_tokens(["ab ba"])
    ours = Tokenizer(hf)
    text = "ab ba " * 20_000
    want = hf.encode(text).ids
    assert want.count(hf.token_to_id("ab ba")) == 20_000
    assert ours.encode(text) == want


def test_max_chars_per_token_is_the_longest_vocabulary_string():
    hf = _trained("bytelevel", False)
    assert Tokenizer(hf).max_chars_per_token == max(len(t) for t in hf.get_vocab(with_added_tokens=True))
