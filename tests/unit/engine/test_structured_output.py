"""Structured outputs in the engine (components/structured_output.py): the bitmask op
against xgrammar's, our TokenizerInfo against from_huggingface, the grammar cache, the
spec checks, the matcher's draft rollback and reasoning start, and in-process engines:
every schema's outputs valid (greedy, sampled, n>1), compile failure -> 400 with the
compiler's reason, a slow compile not blocking others, termination, freeing on
finish / abort, preemption, spec decode, chunked prefill + prefix cache, LoRA,
logprobs and sampling masks."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from common.errors import BadRequest, Overloaded  # noqa: E402
from common.protocol import StructuredOutputs  # noqa: E402
from common.tokenizer import Tokenizer  # noqa: E402
from tests.support.engine_helpers import make_engine, random_prompts, request  # noqa: E402
from tests.support.structured_output_cases import cases, grammar_text_decoder, is_valid  # noqa: E402
from worker.engine.config import structured_outputs_config  # noqa: E402
from worker.engine.structured_output.backend_xgrammar import admits_nothing, build_tokenizer_info  # noqa: E402
from worker.engine.structured_output.bitmask import BitmaskBuffer, apply_bitmask_torch_  # noqa: E402
from worker.engine.structured_output.grammar_cache import GrammarCache  # noqa: E402
from worker.engine.structured_output.reasoning import prompt_ended_reasoning  # noqa: E402
from worker.engine.structured_output.sequence_matcher import DeadEnd, SequenceMatcher  # noqa: E402
from worker.engine.structured_output.spec import MAX_SPEC_CHARS, GrammarKey, grammar_key  # noqa: E402

CASES = cases()
JSON_AB = json.dumps({"type": "object", "properties": {"a": {"enum": ["x", "yy"]}}, "required": ["a"]})


# --- the bitmask ---------------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [320, 1000, 32 * 7])
def test_torch_bitmask_matches_xgrammars_apply(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen)
    words = (vocab + 31) // 32
    full = torch.randint(-2**31, 2**31 - 1, (6, words), generator=gen, dtype=torch.int64).to(torch.int32)
    indices = [4, 0, 2]
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, full, indices=indices, backend="torch_native")  # row i masks row i
    got = logits.clone()
    apply_bitmask_torch_(got, full[indices], torch.tensor(indices))  # ours: only the constrained rows
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 3, 5]], logits[[1, 3, 5]])  # rows without a mask untouched
    assert torch.isinf(got[4]).any() and not torch.isinf(got[4]).all()


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [2, 3, 4], [5, 1, 3]])
def test_cpu_kernel_path_matches_the_torch_op(rows):
    vocab = 32000
    gen = torch.Generator().manual_seed(len(rows))
    buf = BitmaskBuffer(vocab, torch.device("cpu"))
    mask = buf.rows(len(rows))
    mask.copy_(torch.randint(-2**31, 2**31 - 1, mask.shape, generator=gen, dtype=torch.int64).to(torch.int32))
    logits = torch.randn(6, vocab, generator=gen)
    want = logits.clone()
    apply_bitmask_torch_(want, mask.clone(), torch.tensor(rows))
    buf.apply_(logits, len(rows), rows)
    assert torch.equal(logits, want)


def test_bitmask_buffer_grows_and_applies_the_filled_rows():
    buf = BitmaskBuffer(70, torch.device("cpu"))
    rows = buf.rows(2)
    rows.fill_(0)
    rows[0, 0] = 0b101  # tokens 0 and 2
    rows[1, 2] = 1 << 3  # token 67
    logits = torch.zeros(3, 70)
    buf.apply_(logits, 2, [2, 0])
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [67]
    assert torch.isfinite(logits[1]).all()
    assert buf.rows(20).shape == (20, 3)


# --- TokenizerInfo from our tokenizer ------------------------------------------------------
def _trained_tokenizer(tmp: Path, kind: str) -> Path:
    """A small real BPE: byte-level (GPT-2 / Llama-3 style) or byte-fallback ("▁", <0x..>)."""
    from tokenizers import Tokenizer as HFTok, decoders, models, normalizers, pre_tokenizers, trainers

    text = ["the quick brown fox jumps over the lazy dog " * 3, "structured outputs with xgrammar {\"a\": 1}",
            "hello world, hello tokens! 12345 67890"] * 20
    if kind == "byte_level":
        tok = HFTok(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = HFTok(models.BPE(byte_fallback=True, unk_token=None))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"] +
                                      [f"<0x{b:02X}>" for b in range(256)])
    tok.train_from_iterator(text, trainer)
    out = tmp / kind
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return out


@pytest.mark.parametrize("kind", ["test_model", "byte_level", "byte_fallback"])
def test_tokenizer_info_matches_from_huggingface(kind, llama_dir, tmp_path):
    from transformers import PreTrainedTokenizerFast

    folder = llama_dir if kind == "test_model" else _trained_tokenizer(tmp_path, kind)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    ours = Tokenizer.from_file(folder / "tokenizer.json", config)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **{
        k: v for k, v in config.items() if k in ("bos_token", "eos_token")})
    vocab_size = len(hf.get_vocab()) + 7  # a padded lm_head
    eos = hf.eos_token_id
    want = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[eos])
    got = build_tokenizer_info(ours, vocab_size, [eos])
    assert got.vocab_type == want.vocab_type
    assert got.add_prefix_space == want.add_prefix_space
    assert got.vocab_size == want.vocab_size == vocab_size
    assert got.decoded_vocab == want.decoded_vocab
    assert got.stop_token_ids == want.stop_token_ids
    assert got.special_token_ids == want.special_token_ids
    if kind != "test_model":
        expected = xgr.VocabType.BYTE_LEVEL if kind == "byte_level" else xgr.VocabType.BYTE_FALLBACK
        assert got.vocab_type == expected


# --- the spec checks -----------------------------------------------------------------------
def _nested(depth: int):
    value: list = [1]
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("so,message", [
    (StructuredOutputs(), "exactly one"),
    (StructuredOutputs(regex="a", choice=["a"]), "exactly one"),
    (StructuredOutputs(json="[1, 2]"), "JSON object"),
    (StructuredOutputs(json="{nope"), "not valid JSON"),
    (StructuredOutputs(json=json.dumps({"a": _nested(70)})), "nested too deeply"),
    (StructuredOutputs(structural_tag=json.dumps({"a": _nested(90)})), "nested too deeply"),
    (StructuredOutputs(regex="a" * (MAX_SPEC_CHARS + 1)), "characters"),
    (StructuredOutputs(choice=[]), "1 to 1024"),
    (StructuredOutputs(choice=["x"] * 2000), "1 to 1024"),
    (StructuredOutputs(regex="a\x00"), "NUL"),
    (StructuredOutputs(regex="a", whitespace_pattern=" *"), "whitespace_pattern"),
    (StructuredOutputs(regex="a", reasoning_end=[]), "reasoning_end"),
    (StructuredOutputs(regex="a", reasoning_end=[10_000]), "outside the vocabulary"),
    (StructuredOutputs(structural_tag="[]"), "JSON object"),
    (StructuredOutputs(json=json.dumps({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}})),
     "multipleOf"),
    (StructuredOutputs(json=json.dumps({"type": "array", "uniqueItems": True})), "uniqueItems"),
    (StructuredOutputs(json=json.dumps({"allOf": [{"type": "string"}, {"enum": ["a"]}]})), "allOf"),
    (StructuredOutputs(json=json.dumps({"type": "string", "format": "color"})), "format 'color'"),
])
def test_bad_specs_are_refused_with_the_reason(so, message):
    with pytest.raises(BadRequest, match=message) as e:
        grammar_key(so, 320)
    assert e.value.status == 400 and e.value.param == "structured_outputs"


def test_lark_grammars_are_told_apart():
    from common.structured_outputs_spec import grammar_is_likely_lark

    assert grammar_is_likely_lark('start: "a" | "b"')
    assert not grammar_is_likely_lark('# a comment: x\nroot ::= "a"')


def test_grammar_key_includes_the_options():
    a = grammar_key(StructuredOutputs(json=JSON_AB), 320)
    b = grammar_key(StructuredOutputs(json=JSON_AB, disable_any_whitespace=True), 320)
    c = grammar_key(StructuredOutputs(json=JSON_AB), 320, disable_any_whitespace=True)
    assert a != b and b == c and a.kind == "json"
    assert grammar_key(StructuredOutputs(json_object=True), 320).spec == '{"type": "object"}'


def test_structured_outputs_config():
    assert structured_outputs_config(None).backend == "auto"  # vLLM's default: xgrammar here
    assert structured_outputs_config('{"backend": "auto", "enable_in_reasoning": true}').enable_in_reasoning
    with pytest.raises(ValueError, match="'guidance' is not served"):
        structured_outputs_config('{"backend": "guidance"}')
    with pytest.raises(ValueError, match="unknown field"):
        structured_outputs_config('{"backnd": "xgrammar"}')
    with pytest.raises(ValueError, match="is not JSON"):
        structured_outputs_config("{")


# --- the grammar cache ---------------------------------------------------------------------
def _key(i: int) -> GrammarKey:
    return GrammarKey("regex", f"a{{{i}}}", True)


def test_cache_hits_misses_dedupes_and_stays_bounded():
    calls = []
    gate = threading.Event()

    def compile_fn(key):
        gate.wait(10)
        calls.append(key)
        return key.spec

    cache = GrammarCache(compile_fn, workers=1, max_entries=2, max_pending=2)
    try:
        assert cache.get(_key(1)) is None
        f1, f1_again = cache.submit(_key(1)), cache.submit(_key(1))  # one compile for both
        assert f1 is f1_again
        f2 = cache.submit(_key(2))
        with pytest.raises(Overloaded, match="being compiled"):
            cache.submit(_key(3))  # two pending: the limit
        gate.set()
        f1.result(10)
        f2.result(10)
        assert cache.get(_key(1)) == "a{1}" and cache.hits == 1 and cache.misses == 2
        cache.submit(_key(3)).result(10)
        assert cache.submit(_key(3)).done()  # a done Future from the cache
        assert len(cache) == 2 and cache.get(_key(2)) is None  # LRU: 2 was the oldest (1 was read)
        assert calls == [_key(1), _key(2), _key(3)]
    finally:
        gate.set()
        cache.close()


def test_cache_does_not_keep_failures():
    def compile_fn(key):
        raise ValueError(f"bad {key.spec}")

    cache = GrammarCache(compile_fn)
    try:
        with pytest.raises(ValueError, match="bad a"):
            cache.submit(_key(1)).result(10)
        assert len(cache) == 0 and cache.get(_key(1)) is None
    finally:
        cache.close()


# --- the matcher ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiler(llama_dir):
    tok = Tokenizer.from_file(llama_dir / "tokenizer.json", json.loads((llama_dir / "tokenizer_config.json").read_text()))
    return xgr.GrammarCompiler(build_tokenizer_info(tok, 320, [257]))


def _allowed(bitmask_row: torch.Tensor) -> set[int]:
    logits = torch.zeros(1, 320)
    apply_bitmask_torch_(logits, bitmask_row.unsqueeze(0), torch.tensor([0]))
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def test_draft_rows_advance_and_roll_back(compiler):
    m = SequenceMatcher(xgr.GrammarMatcher(compiler.compile_regex("ab(c|d)")), None, True)
    bitmask = torch.zeros(8, 10, dtype=torch.int32)
    drafts = (ord("a"), ord("b"), ord("x"), ord("c"))  # "x" is rejected: the rows after it copy its row
    filled = m.fill_rows(bitmask, 0, drafts, ())
    assert [j for j, _ in filled] == [0, 1, 2, 3, 4]
    assert _allowed(bitmask[0]) == {ord("a")}
    assert _allowed(bitmask[1]) == {ord("b")}
    assert _allowed(bitmask[2]) == {ord("c"), ord("d")}
    assert _allowed(bitmask[3]) == _allowed(bitmask[4]) == {ord("c"), ord("d")}
    # rolled back: the next token is "a" again, and the sequence's own tokens still drive it
    again = torch.zeros(1, 10, dtype=torch.int32)
    m.fill_rows(again, 0, (), ())
    assert _allowed(again[0]) == {ord("a")}
    prompt = [1, 2]
    m.catch_up(prompt + [ord("a"), ord("b")], len(prompt))
    m.fill_rows(again, 0, (), ())
    assert _allowed(again[0]) == {ord("c"), ord("d")}
    m.catch_up(prompt + [ord("a"), ord("b"), ord("d")], len(prompt))
    m.fill_rows(again, 0, (), ())
    assert _allowed(again[0]) == {257}  # only the stop token is left
    m.catch_up(prompt + [ord("a"), ord("b"), ord("d"), 257], len(prompt))
    assert m.matcher.is_terminated() and not m.constrains


def test_a_draft_that_ends_the_grammar_rolls_back_too(compiler):
    m = SequenceMatcher(xgr.GrammarMatcher(compiler.compile_regex("ab")), None, True)
    bitmask = torch.zeros(4, 10, dtype=torch.int32)
    filled = m.fill_rows(bitmask, 0, (ord("a"), ord("b"), 257), ())  # the stop token ends it: no row after
    assert [j for j, _ in filled] == [0, 1, 2] and _allowed(bitmask[2]) == {257}
    assert not m.matcher.is_terminated()
    m.fill_rows(bitmask, 0, (), ())
    assert _allowed(bitmask[0]) == {ord("a")}


DEAD_END = 'root ::= "a" x | "b"\nx ::= x'  # after "a" no token is allowed, not even a stop


def test_a_dead_end_is_never_sampled_from(compiler):
    """xgrammar compiles a rule that can never complete; its state allows no token."""
    m = SequenceMatcher(xgr.GrammarMatcher(compiler.compile_grammar(DEAD_END)), None, True)
    bitmask = torch.zeros(4, 10, dtype=torch.int32)
    # a draft that leads to the dead end is forbidden at its own row (verification rejects it)
    filled = m.fill_rows(bitmask, 0, (ord("a"),), ())
    assert [j for j, _ in filled] == [0, 1]
    assert _allowed(bitmask[0]) == _allowed(bitmask[1]) == {ord("b")}
    assert not m.matcher.is_terminated()
    # the sequence itself in the dead end: nothing to sample
    m.catch_up([1, ord("a")], 1)
    with pytest.raises(DeadEnd):
        m.fill_rows(bitmask, 0, (), ())


def test_grammars_that_admit_nothing_are_told(compiler):
    assert admits_nothing(compiler.compile_grammar("root ::= root"))
    assert not admits_nothing(compiler.compile_grammar(DEAD_END))  # "b" is a way out
    assert not admits_nothing(compiler.compile_regex("ab"))
    assert not admits_nothing(compiler.compile_grammar('root ::= ""'))  # the empty output: a stop


def test_valid_prefix_of_drafts(compiler):
    m = SequenceMatcher(xgr.GrammarMatcher(compiler.compile_regex("[0-9]{3}")), None, True)
    assert m.valid_prefix([ord("1"), ord("2"), ord("x"), ord("3")]) == 2
    assert m.valid_prefix([ord("1"), ord("2"), ord("3"), 257, ord("4")]) == 4  # up to the end of the grammar
    assert m.valid_prefix([ord("x")]) == 0
    bitmask = torch.zeros(1, 10, dtype=torch.int32)
    m.fill_rows(bitmask, 0, (), ())
    assert _allowed(bitmask[0]) == set(range(ord("0"), ord("9") + 1))  # unchanged


def test_drafts_the_grammar_rejects_are_cut_before_scheduling(llama_dir):
    engine = make_engine(llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                        "prompt_lookup_min": 1, "prompt_lookup_max": 2},
                         spec_max_step_tokens=0)
    engine.add_request(request("d", [1, 2], max_tokens=20, structured_outputs=StructuredOutputs(regex="[0-9]{10}")))
    while not engine.requests["d"].sequences[0].output_ids:
        engine.step()
    seq = engine.requests["d"].sequences[0]
    # the scheduler's drafts: the proposer's, cut by the grammar's filter
    proposed = {seq.seq_id: [ord("1"), ord("x"), ord("2")]}
    engine.scheduler.draft_source = lambda s: proposed.get(s.seq_id, [])
    assert list(engine.scheduler._drafts(seq)) == [ord("1")]
    proposed[seq.seq_id] = [ord("y")]
    assert list(engine.scheduler._drafts(seq)) == []


def test_reasoning_end_starts_the_grammar(compiler):
    end = [ord("<"), ord(">")]
    assert not prompt_ended_reasoning([5, 6], [9], end)
    assert prompt_ended_reasoning([9, 5, 60, 62, 7], [9], end)  # "<>" after the last start
    assert not prompt_ended_reasoning([60, 62, 9, 5], [9], end)  # a new start after it
    assert prompt_ended_reasoning([1], None, None)
    m = SequenceMatcher(xgr.GrammarMatcher(compiler.compile_regex("[0-9]+")), end, False)
    bitmask = torch.zeros(4, 10, dtype=torch.int32)
    # reasoning: no row for the next token; the drafts "x<" then ">" close it: rows after
    filled = m.fill_rows(bitmask, 0, (ord("x"), ord("<"), ord(">"), ord("5")), (ord("z"),))
    assert [j for j, _ in filled] == [3, 4]
    assert _allowed(bitmask[0]) == set(range(ord("0"), ord("9") + 1))
    assert not m.reasoning_ended  # the drafts were only looked at
    prompt = [3]
    m.catch_up(prompt + [ord("a"), ord("<"), ord(">"), ord("7")], 1)
    assert m.reasoning_ended and m.constrains
    m.fill_rows(bitmask, 0, (), ())
    assert _allowed(bitmask[0]) == set(range(ord("0"), ord("9") + 1)) | {257}


# --- in-process engines ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(llama_dir):
    return make_engine(llama_dir, max_model_len=1024, max_num_seqs=32)


def _check_outputs(engine, res, reqs, checks):
    decode = grammar_text_decoder(engine.tokenizer, engine.vocab_size, engine.model_config.eos_token_ids)
    stops = 0
    total = 0
    for req, check in zip(reqs, checks):
        for d in res[req.request_id]:
            total += 1
            text = decode(d.token_ids)
            if d.finish_reason == "stop":
                stops += 1
                assert is_valid(check, text), (req.request_id, text)
            else:
                assert d.finish_reason == "length", (req.request_id, d.finish_reason)
    assert stops >= 0.9 * total, f"only {stops} of {total} choices ended with stop"
    return stops


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_case_generates_valid_outputs(engine, temperature):
    reqs = [request(f"{name}-{temperature}", [1, 2, 3, i], max_tokens=600, temperature=temperature, seed=i,
                    n=1 if temperature == 0 else 3, structured_outputs=so)
            for i, (name, so, _) in enumerate(CASES)]
    reqs.append(request(f"plain-{temperature}", [4, 5], max_tokens=30, ignore_eos=True, temperature=temperature))
    res = engine.generate(reqs)
    assert engine.take_request_errors() == []
    _check_outputs(engine, res, reqs[:-1], [c for _, _, c in CASES])
    assert len(res[reqs[-1].request_id][0].token_ids) == 30  # an unconstrained neighbour is untouched
    assert engine.structured_output.num_matchers == 0 and not engine.structured_output.grammars
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks or engine.config.enable_prefix_caching


def test_compile_failure_fails_only_that_request_with_the_reason(engine):
    bad = request("bad-grammar", [1, 2], max_tokens=5, structured_outputs=StructuredOutputs(grammar="root ::= nope"))
    bad_schema = request("bad-schema", [1, 2], max_tokens=5, structured_outputs=StructuredOutputs(
        json=json.dumps({"type": "object", "properties": {"a": {"$ref": "#/missing"}}})))
    good = request("good", [1, 2], max_tokens=8, ignore_eos=True)
    res = engine.generate([bad, bad_schema, good])
    errors = {rid: (status, msg, param) for rid, status, msg, param in engine.take_request_errors()}
    assert set(errors) == {"bad-grammar", "bad-schema"}
    for status, msg, param in errors.values():
        assert status == 400 and param == "structured_outputs" and "does not compile" in msg
    assert "nope" in errors["bad-grammar"][1]  # the compiler's reason
    assert len(res["good"][0].token_ids) == 8
    assert not engine.structured_output.grammars and not engine.structured_output.pending


def test_a_grammar_that_admits_nothing_or_dies_fails_with_a_400_and_no_output(engine):
    """Never free sampling (issue 39): an empty language is refused at compile time, a dead
    end met while generating ends the request with an error and without the token sampled
    there; the other requests go on."""
    empty = request("empty", [1, 2], max_tokens=5, structured_outputs=StructuredOutputs(grammar="root ::= root"))
    dies = request("dies", [1, 2], max_tokens=20, structured_outputs=StructuredOutputs(
        grammar='root ::= "ab" x\nx ::= x'))
    good = request("good", [1, 2], max_tokens=8, ignore_eos=True)
    res = engine.generate([empty, dies, good])
    errors = {rid: (status, msg, param) for rid, status, msg, param in engine.take_request_errors()}
    assert set(errors) == {"empty", "dies"}
    assert errors["empty"][0] == 400 and "admits no output" in errors["empty"][1]
    assert errors["dies"] == (400, "structured_outputs: the grammar allows no token after the output so far",
                              "structured_outputs")
    # what reached the client of "dies": "ab" at most, never a token from the dead state
    sent = [t for delta in res["dies"] for t in delta.token_ids]
    assert bytes(sent).decode() in ("", "a", "ab") and all(d.finish_reason is None for d in res["dies"])
    assert len(res["good"][0].token_ids) == 8
    assert not engine.structured_output.grammars and not engine.structured_output.matchers


def test_a_slow_compile_does_not_hold_other_requests(llama_dir):
    engine = make_engine(llama_dir)
    so = engine.structured_output
    gate = threading.Event()
    real = so.cache._compile

    def slow(key):
        gate.wait(60)
        return real(key)

    so.cache._compile = slow
    try:
        engine.add_request(request("slow", [1, 2], max_tokens=50, structured_outputs=StructuredOutputs(
            json=JSON_AB, disable_any_whitespace=True)))
        engine.add_request(request("plain", [3, 4], max_tokens=12, ignore_eos=True))
        engine.add_request(request("gone", [1, 2], max_tokens=5, structured_outputs=StructuredOutputs(regex="[0-9]+")))
        got: dict = {}
        for d in engine.step():
            got.setdefault(d.request_id, []).extend(d.token_ids)
        assert {d.finish_reason for d in engine.abort("gone")} == {"abort"}  # aborted while compiling
        assert "gone" not in so.pending and "gone" not in so.grammars
        while "plain" in engine.requests:
            for d in engine.step():
                got.setdefault(d.request_id, []).extend(d.token_ids)
        assert len(got["plain"]) == 12 and "slow" not in got  # decoded while the grammar compiled
        assert "slow" in so.pending
        gate.set()
        while engine.has_unfinished():
            for d in engine.step():
                got.setdefault(d.request_id, []).extend(d.token_ids)
        assert json.loads(engine.tokenizer.decode(got["slow"]))["a"] in ("x", "yy")
    finally:
        gate.set()


def test_a_request_whose_pull_is_done_waits_for_its_grammar(llama_dir):
    """A KV / encoder pull may finish (open its gate) before the request's grammar
    compiled: the request waits at its grammar gate, no step waits for the compile, and
    no token is sampled unconstrained."""
    from worker.engine.component import EngineComponent, Hooks

    engine = make_engine(llama_dir)
    so = engine.structured_output

    class Pull(EngineComponent):  # a pull's gate, opened by the test (as a finished pull does)
        held = None

        def admit(self, request, seq):
            if request.request_id == "held":
                self.held = request
                engine.context.close_gate(request, "pull")

    pull = Pull()
    engine.components.insert(0, pull)
    engine.hooks = Hooks(engine.components)
    gate = threading.Event()
    real = so.cache._compile
    so.cache._compile = lambda key: (gate.wait(60), real(key))[1]
    try:
        engine.add_request(request("held", [1, 2], max_tokens=50, structured_outputs=StructuredOutputs(
            json=JSON_AB, disable_any_whitespace=True)))
        engine.add_request(request("plain", [3, 4], max_tokens=6, ignore_eos=True))
        assert engine.gates.closed("held") == {"pull", "grammar"}
        engine.context.open_gate(pull.held, "pull")  # the pull is done; the grammar still compiles
        got: dict = {}
        while "plain" in engine.requests:
            for d in engine.step():
                got.setdefault(d.request_id, []).extend(d.token_ids)
        assert "held" not in got and "held" in so.pending  # not run, and the steps did not wait
        seq = pull.held.sequences[0]
        assert seq not in engine.scheduler.waiting() and seq not in engine.scheduler.running
        assert engine.gates.closed("held") == {"grammar"}
        gate.set()
        while engine.has_unfinished() or "held" in engine.requests:
            for d in engine.step():
                got.setdefault(d.request_id, []).extend(d.token_ids)
        assert json.loads(engine.tokenizer.decode(got["held"]))["a"] in ("x", "yy")  # constrained from token 1
    finally:
        gate.set()


def test_a_compile_past_the_timeout_is_a_400(llama_dir):
    engine = make_engine(llama_dir)
    so = engine.structured_output
    gate = threading.Event()
    real = so.cache._compile
    so.cache._compile = lambda key: (gate.wait(60), real(key))[1]
    so.compile_timeout_s = 0.2
    try:
        engine.add_request(request("t", [1], max_tokens=5, structured_outputs=StructuredOutputs(regex="[a-z]+")))
        while "t" in engine.requests:
            engine.step()
        [(rid, status, message, param)] = engine.take_request_errors()
        assert (rid, status, param) == ("t", 400, "structured_outputs") and "longer than 0.2 s" in message
    finally:
        gate.set()


def test_a_grammar_error_fails_only_its_request(llama_dir, monkeypatch):
    engine = make_engine(llama_dir)
    real = SequenceMatcher.fill_rows

    def broken(self, bitmask, index, drafts, context):
        if self.matcher.stop_token_ids == [257, 300]:  # only the request with stop_token_ids=[300]
            raise RuntimeError("boom")
        return real(self, bitmask, index, drafts, context)

    monkeypatch.setattr(SequenceMatcher, "fill_rows", broken)
    so = StructuredOutputs(regex="[a-z]{5}")
    res = engine.generate([request("bad", [1], max_tokens=9, stop_token_ids=[300], structured_outputs=so),
                           request("ok", [1], max_tokens=9, structured_outputs=so)])
    assert [(rid, status) for rid, status, _, _ in engine.take_request_errors()] == [("bad", 500)]
    assert is_valid(("regex", "[a-z]{5}"), engine.tokenizer.decode(res["ok"][0].token_ids))
    assert engine.structured_output.num_matchers == 0 and not engine.requests


def test_abort_mid_grammar_frees_matchers_and_blocks(llama_dir):
    engine = make_engine(llama_dir, enable_prefix_caching=False)
    so = engine.structured_output
    free = engine.block_manager.num_free_blocks
    schema = json.dumps({"type": "array", "items": {"type": "integer"}})  # never has to end
    engine.add_request(request("r", [1, 2, 3], max_tokens=200, temperature=1.0, n=3, ignore_eos=True,
                               structured_outputs=StructuredOutputs(json=schema, disable_any_whitespace=True)))
    engine.add_request(request("q", [1, 2, 3], max_tokens=2, structured_outputs=StructuredOutputs(json=schema)))
    while engine.requests["r"].sequences[0].num_output_tokens < 5:
        engine.step()
    assert so.num_matchers == 4 or so.num_matchers == 3  # "q" may have finished already
    deltas = engine.abort("r")
    assert {d.finish_reason for d in deltas} == {"abort"}
    while engine.has_unfinished():
        engine.step()
    assert so.num_matchers == 0 and not so.grammars
    assert engine.block_manager.num_free_blocks == free


def test_grammar_end_finishes_with_stop_and_frees(engine):
    res = engine.generate([request("c", [7], max_tokens=50, temperature=1.0, seed=3, n=4,
                                   structured_outputs=StructuredOutputs(choice=["on", "off"]))])
    for d in res["c"]:
        assert d.finish_reason == "stop" and engine.tokenizer.decode(d.token_ids) in ("on", "off")
        assert d.token_ids[-1] == 257 and d.stop_reason is None  # the grammar's end leaves only EOS
    assert engine.structured_output.num_matchers == 0


def test_preemption_spec_decode_chunked_prefill_and_prefix_cache(llama_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    kw = dict(max_num_batched_tokens=24, num_kv_blocks=12, block_size=16, max_model_len=192, max_num_seqs=8)
    engine = make_engine(llama_dir, speculative_config=spec, spec_max_step_tokens=0, **kw)
    # Prompts that quote the constraint's text, so n-gram drafts follow the grammar often.
    sample = '{"name":"abc","age":7}'
    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                          "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                         "required": ["name", "age"]})
    prompt = engine.tokenizer.encode(sample * 3)
    reqs = [request(f"p{i}", prompt[: 40 + 3 * i], max_tokens=120, temperature=0.0 if i % 2 else 1.0, seed=i,
                    structured_outputs=StructuredOutputs(json=schema, disable_any_whitespace=True)) for i in range(8)]
    reqs += [request(f"long{i}", p, max_tokens=40, ignore_eos=True) for i, p in enumerate(random_prompts(3, 60, 90))]
    res = engine.generate(reqs)
    assert engine.take_request_errors() == []
    assert engine.scheduler.num_preemptions > 0, "the KV cache must be tight enough to preempt"
    check = ("json", json.loads(schema))
    _check_outputs(engine, res, reqs[:8], [check] * 8)
    stats = [res[r.request_id][0].spec_decode for r in reqs[:8]]
    assert sum(sum(s.histogram[1:]) for s in stats) > 0, "no draft was accepted: verification went untested"
    # Greedy choices: the drafts' masks (advance, roll back) change nothing.
    greedy = [r for i, r in enumerate(reqs[:8]) if i % 2]
    base = make_engine(llama_dir, **kw).generate(greedy)
    assert [base[r.request_id][0].token_ids for r in greedy] == [res[r.request_id][0].token_ids for r in greedy]
    assert engine.structured_output.num_matchers == 0


def test_logprobs_and_sampling_mask_see_the_grammar(llama_dir):
    engine = make_engine(llama_dir, return_sampling_mask=True)
    res = engine.generate([request("lp", [9, 9], max_tokens=10, temperature=1.0, seed=1, logprobs=5,
                                   structured_outputs=StructuredOutputs(choice=["yes", "no"]))])
    d = res["lp"][0]
    first = d.logprobs
    # vLLM's raw logprobs are computed after the grammar bitmask: only "y" / "n" are finite
    # (-inf travels as vLLM's -9999.0)
    finite = {t for t, lp in zip(first.top_ids[0], first.top_logprobs[0]) if lp > -9999.0}
    assert finite == {ord("y"), ord("n")}
    assert all(lp <= -9999.0 for lp in first.top_logprobs[1][1:])  # "e" after "y": nothing else
    assert set(d.sampling_mask[0]) <= {ord("y"), ord("n")}
    assert engine.tokenizer.decode(d.token_ids) in ("yes", "no")


def test_lora_request_is_constrained(llama_dir, tmp_path):
    from tests.support.lora_factory import build_adapter

    adapter = build_adapter(llama_dir, tmp_path / "a", ["q_proj", "v_proj", "down_proj"], rank=4)
    engine = make_engine(llama_dir, enable_lora=True, max_loras=1, max_lora_rank=8, lora_modules={"a": str(adapter)})
    so = StructuredOutputs(regex=r"[a-z]{3}-[0-9]{2}")
    reqs = [request("l", [1, 2], max_tokens=20, temperature=1.0, seed=2, n=2, structured_outputs=so),
            request("b", [1, 2], max_tokens=20, temperature=1.0, seed=2, structured_outputs=so)]
    reqs[0].lora_name = "a"
    res = engine.generate(reqs)
    for d in res["l"] + res["b"]:
        assert d.finish_reason == "stop" and is_valid(("regex", so.regex), engine.tokenizer.decode(d.token_ids))


def test_reasoning_then_grammar_in_the_engine(engine):
    # A bias makes the model close its reasoning ("#") at once; the grammar starts after it.
    end = ord("#")
    so = StructuredOutputs(regex="[a-z]{2,4}", reasoning_end=[end])
    res = engine.generate([request("think", [5, 6], max_tokens=30, temperature=0.0, logit_bias={end: 100.0},
                                   structured_outputs=so),
                           request("closed", [5, end, 6], max_tokens=30, temperature=0.0, logit_bias={end: 100.0},
                                   structured_outputs=so)])
    think = engine.tokenizer.decode(res["think"][0].token_ids)
    assert think[0] == "#" and is_valid(("regex", "[a-z]{2,4}"), think[1:]), think
    closed = engine.tokenizer.decode(res["closed"][0].token_ids)  # the prompt ended reasoning: constrained at once
    assert is_valid(("regex", "[a-z]{2,4}"), closed), closed


def test_tokens_only_worker_refuses(llama_dir, tmp_path):
    engine = make_engine(llama_dir, tokens_only=True)
    with pytest.raises(BadRequest, match="tokenizer"):
        engine.add_request(request("t", [1], structured_outputs=StructuredOutputs(regex="a")))
    assert not engine.requests


def test_triton_bitmask_kernel_under_the_interpreter(tmp_path):
    """kernels/triton/bitmask.py against the torch op, on CPU tensors under TRITON_INTERPRET=1
    (set before the kernels are decorated: a fresh interpreter)."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                           str(tmp_path / "t"), str(root / "tests/support/triton_interpreted_kernels.py"),
                           "-k", "apply_bitmask"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "6 passed" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]
