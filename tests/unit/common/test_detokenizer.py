"""Incremental detokenizer vs full decode (byte-level BPE with multi-byte UTF-8
split over tokens), stop strings across token boundaries, logprob token texts."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from common.protocol import SamplingParams, TokenLogprobs
from common.detokenizer import (IncrementalDetokenizer, attach_token_texts,
                                       decode_token_texts, find_stop_string, needs_detokenizer,
                                       token_text_bytes)

CORPUS = ["hello world, the stop word is here. héllo wörld € 日本語 ünïcödé 🙂 naïve café"] * 4


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    t.train_from_iterator(CORPUS, trainer)
    return t


def run_stream(tok, prompt, ids, chunks=1, **kw):
    """Feed ``ids`` ``chunks`` at a time; return (emitted pieces, detokenizer)."""
    d = IncrementalDetokenizer(tok, prompt, SamplingParams(**kw))
    pieces = []
    for i in range(0, len(ids), chunks):
        last = i + chunks >= len(ids)
        text, stop = d.update(ids[i:i + chunks], finished=last)
        pieces.append(text)
        if stop is not None:
            return pieces, d, stop
    return pieces, d, None


@pytest.mark.parametrize("skip_special", [True, False])
def test_random_token_streams_match_full_decode(tok, skip_special):
    rng = random.Random(1234)
    vocab = tok.get_vocab_size()
    prompt = tok.encode("hello world").ids
    for trial in range(150):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 25))]
        pieces, d, _ = run_stream(tok, prompt, ids, chunks=rng.choice([1, 1, 2, 3]),
                                  skip_special_tokens=skip_special)
        # vLLM's fast detokenizer: DecodeStream, which never emits an unfinished character.
        stream = decoders.DecodeStream(ids=prompt, skip_special_tokens=skip_special)
        want = "".join(stream.step(tok, t) or "" for t in ids)
        assert "".join(pieces) == want, (trial, ids)
        assert d.output_token_ids == ids


def test_multibyte_char_not_emitted_until_complete(tok):
    text = " 日本語 🙂"
    ids = tok.encode(text).ids
    assert len(ids) > len(text.split())  # characters really are split over tokens
    d = IncrementalDetokenizer(tok, tok.encode("hello").ids, SamplingParams())
    out = []
    for i, tid in enumerate(ids):
        piece, _ = d.update([tid])
        assert "\ufffd" not in piece
        out.append(piece)
    assert "".join(out) + d.flush() == text


def test_trailing_incomplete_bytes_never_emitted(tok):
    # vLLM (tokenizers' DecodeStream) never emits a character that is still incomplete
    # when the output ends: no trailing U+FFFD.
    ids = tok.encode(" 日").ids
    part = ids[:-1]  # stop in the middle of the character
    d = IncrementalDetokenizer(tok, [], SamplingParams())
    text, _ = d.update(part, finished=True)
    stream = decoders.DecodeStream(skip_special_tokens=True)
    assert text == "".join(stream.step(tok, t) or "" for t in part) and "\ufffd" not in text
    assert tok.decode(part).endswith("\ufffd")
    assert d.flush() == ""


def test_stop_string_split_across_tokens(tok):
    ids = tok.encode("hello world, the stop word is here.").ids
    pieces, d, stop = run_stream(tok, [], ids, stop=["stop word"])
    assert stop == "stop word"
    assert "".join(pieces) == "hello world, the "
    assert d.output_text == "hello world, the "
    # the token completing the stop string is the last one kept
    assert d.output_token_ids == ids[:len(d.output_token_ids)]
    assert "stop word" in tok.decode(d.output_token_ids)
    assert "stop wor" not in tok.decode(d.output_token_ids[:-1])


def test_stop_string_included_and_multi_token_steps_drop_rest(tok):
    ids = tok.encode("hello world, the stop word is here.").ids
    pieces, d, stop = run_stream(tok, [], ids, chunks=len(ids), stop=["world", "the"],
                                 include_stop_str_in_output=True)
    assert stop == "world" and "".join(pieces) == "hello world"
    assert d.dropped_token_count > 0
    assert tok.decode(d.output_token_ids).startswith("hello world")
    assert d.output_token_ids == ids[:len(ids) - d.dropped_token_count]


def test_partial_stop_string_never_streamed(tok):
    ids = tok.encode("the stop wo and more text after it").ids
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["stop word"]))
    emitted = ""
    for tid in ids:
        text, stop = d.update([tid])
        assert stop is None
        emitted += text
        # held back: the last len("stop word") - 1 characters
        assert len(emitted) <= max(len(d.output_text) - 8, 0)
    assert "stop wo" in emitted  # released once text moved past it
    assert emitted + d.flush() == "the stop wo and more text after it"


def test_stop_string_respects_min_tokens(tok):
    ids = tok.encode("the the the end").ids
    first_two = len(tok.encode("the the").ids)
    pieces, d, stop = run_stream(tok, [], ids, stop=["the"], min_tokens=first_two)
    assert stop == "the"
    assert "".join(pieces) == "the the "


def test_stop_terminated_token_text_excluded(tok):
    ids = tok.encode("hello").ids + [tok.token_to_id("</s>")]
    d = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=False))
    text, stop = d.update(ids, stop_terminated=True)
    assert text == "hello" and stop is None and d.finished
    assert d.output_token_ids == ids
    d = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=False,
                                                       include_stop_str_in_output=True))
    assert d.update(ids, stop_terminated=True)[0] == "hello</s>"


def test_spaces_between_special_tokens_off_joins_specials(tok):
    s, e = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    ids = [s, e, s] + tok.encode("hi").ids
    pieces, _, _ = run_stream(tok, [], ids, skip_special_tokens=False,
                              spaces_between_special_tokens=False)
    assert "".join(pieces) == "<s></s><s>hi"


def test_find_stop_string_earliest_and_window():
    assert find_stop_string("abcdef", 2, ["ef", "cd"], False) == ("ef", 4)
    assert find_stop_string("abcdef", 3, ["ef", "de"], False) == ("de", 3)
    assert find_stop_string("abcdef", 3, ["de"], True) == ("de", 5)
    assert find_stop_string("abcdef", 1, ["ef"], True) == ("ef", -1)
    assert find_stop_string("abcdef", 1, ["bc"], False) is None  # already checked text
    assert find_stop_string("abc", 0, ["a"], False) is None


def test_needs_detokenizer():
    assert needs_detokenizer(SamplingParams(), output_text=True)
    assert not needs_detokenizer(SamplingParams(), output_text=False)
    assert needs_detokenizer(SamplingParams(stop=["x"]), output_text=False)
    assert not needs_detokenizer(SamplingParams(detokenize=False), output_text=True)


def test_decode_token_texts_bytelevel_and_bytes(tok):
    ids = tok.encode(" €").ids
    texts = decode_token_texts(tok, ids)
    assert texts == [tok.decode([i]) for i in ids]
    assert token_text_bytes("€") == [0xE2, 0x82, 0xAC]
    assert token_text_bytes("\ufffd") == [0xEF, 0xBF, 0xBD]
    lp = TokenLogprobs(token_ids=ids[:1], logprobs=[-0.1], ranks=[1], top_ids=[ids[:2]],
                       top_logprobs=[[-0.1, -2.0]])
    attach_token_texts(lp, tok)
    assert lp.token_texts == texts[:1] and lp.top_texts == [texts[:2]]


def test_metaspace_leading_space_restored_and_context_decoding():
    vocab = {"<unk>": 0, "\u2581hello": 1, "\u2581world": 2, "s": 3}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    assert t.decode([2]) == "world"  # decode() of a lone token strips the space
    assert decode_token_texts(t, [2, 3]) == [" world", "s"]
    d = IncrementalDetokenizer(t, [1], SamplingParams())
    assert d.update([2])[0] == " world"  # decoded in the context of the prompt
    assert d.update([3])[0] == "s"


def test_logprob_texts_complete_split_characters_with_context(tok):
    ids = tok.encode(" ü").ids  # ' ', then the two UTF-8 bytes of 'ü' as separate tokens
    assert len(ids) == 3 and tok.decode([ids[1]]) == "\ufffd"
    lp = TokenLogprobs(token_ids=ids, logprobs=[-1.0] * 3, ranks=[1] * 3,
                       top_ids=[[i, ids[0]] for i in ids], top_logprobs=[[-1.0, -2.0]] * 3)
    attach_token_texts(lp, tok)
    # vLLM: the first byte alone is incomplete (""), the second completes "ü"
    assert lp.token_texts == [" ", "", "ü"]
    assert lp.top_texts[2] == ["ü", " "]
    # context from earlier steps (a delta holding one token)
    assert decode_token_texts(tok, ids[2:], context_token_ids=ids[:2]) == ["ü"]
    assert decode_token_texts(tok, ids[2:]) == [""]


def test_text_ending_in_incomplete_character_stays_held_at_finish(tok):
    first = tok.encode(" 日本語").ids[0]
    assert tok.decode([first]) == " 日本\ufffd"  # one token: two characters and a partial one
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["日本"]))
    assert d.update([first]) == ("", None)  # held: the text ends in an incomplete character
    # vLLM's DecodeStream has not produced this token's text, so no stop string matches.
    assert d.update([], finished=True) == ("", None)


@pytest.mark.parametrize("include", [False, True])
def test_random_stop_strings_match_first_completed_occurrence(tok, include):
    rng = random.Random(99 if include else 7)
    alphabet = "ab éü日 "
    for trial in range(120):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4)))
                 for _ in range(rng.randrange(1, 3))]
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text
        pieces, d, stop = run_stream(tok, [], ids, chunks=rng.choice([1, 2]), stop=stops,
                                     include_stop_str_in_output=include)
        ends = [(text.find(s) + len(s), k) for k, s in enumerate(stops) if s in text]
        if not ends:
            assert stop is None and "".join(pieces) == text, trial
            continue
        end, k = min(ends)
        assert stop == stops[k], trial
        want = text[:end] if include else text[:end - len(stops[k])]
        assert "".join(pieces) == want, (trial, text, stops)
