"""xgrammar, vLLM's default structured-output backend: our tokenizer's vocabulary as an
``xgr.TokenizerInfo``, the compilers, and per-sequence matchers.

``TokenizerInfo.from_huggingface`` wants a transformers tokenizer object; ours is the
``tokenizers`` library's (common/tokenizer.py), so the info is built from what that
holds: the encoded vocabulary, the vocabulary type (byte-level BPE "Ġ", byte-fallback
"<0x..>", raw) and add_prefix_space, detected the way from_huggingface detects them --
from tokenizer.json's model/decoder, cross-checked against the vocabulary itself.
(xgrammar's package imports transformers on its own; we only avoid needing a
transformers tokenizer.)

As vLLM does (backend_xgrammar.py), the grammars compile against a vocabulary with the
special tokens blanked out (a JSON value must not contain ``<|im_end|>``), except a
structural tag, whose tags may be special tokens: it gets a full-vocabulary compiler,
built on first use.  The mask width is the model's logits width (its padded vocab).
"""
from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Optional, Sequence

import xgrammar as xgr

from common.structured_outputs_spec import choice_as_grammar, grammar_is_likely_lark
from worker.engine.structured_output.spec import GrammarKey

if TYPE_CHECKING:  # pragma: no cover
    from common.tokenizer import Tokenizer


def _vocab_type(tokenizer: "Tokenizer") -> tuple[xgr.VocabType, bool]:
    """(vocab type, add_prefix_space) as TokenizerInfo.from_huggingface finds them for a
    fast tokenizer: tokenizer.json first, the vocabulary's own spelling when they disagree."""
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend_json())
    vocab_type, add_prefix_space = metadata["vocab_type"], metadata["add_prefix_space"]
    detect = getattr(xgr.TokenizerInfo, "_detect_vocab_type_from_vocab", None)  # xgrammar >= 0.2.9
    from_vocab = detect(tokenizer.get_vocab()) if detect is not None else None
    if from_vocab is not None and from_vocab != vocab_type:
        vocab_type = from_vocab
        ids = tokenizer.encode("a")
        first = tokenizer.convert_ids_to_tokens(ids[:1])[0] if ids else None
        prefix = "▁" if vocab_type == xgr.VocabType.BYTE_FALLBACK else "Ġ"
        add_prefix_space = bool(first) and first.startswith(prefix)
    return vocab_type, add_prefix_space


def build_tokenizer_info(tokenizer: "Tokenizer", vocab_size: int, stop_token_ids: Sequence[int],
                         special_token_ids: Sequence[int] = ()) -> xgr.TokenizerInfo:
    """``vocab_size``: the model's logits width; ids past the tokenizer's (padding) and
    ``special_token_ids`` get an empty string, which xgrammar never allows."""
    encoded = [""] * vocab_size
    blank = set(special_token_ids)
    for token, tid in tokenizer.get_vocab().items():
        if tid < vocab_size and tid not in blank:
            encoded[tid] = token
    vocab_type, add_prefix_space = _vocab_type(tokenizer)
    return xgr.TokenizerInfo(encoded, vocab_type=vocab_type, vocab_size=vocab_size,
                             stop_token_ids=list(stop_token_ids) or None, add_prefix_space=add_prefix_space)


class XgrammarBackend:
    """Compiles specs (thread-safe: the compile pool calls it) and makes matchers."""

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int, stop_token_ids: Sequence[int],
                 compile_threads: int = 1):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.compile_threads = compile_threads
        self._lock = threading.Lock()
        self._compiler: Optional[xgr.GrammarCompiler] = None  # special tokens blanked
        self._full_compiler: Optional[xgr.GrammarCompiler] = None  # structural tags

    def _new_compiler(self, special_token_ids: Sequence[int]) -> xgr.GrammarCompiler:
        info = build_tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids, special_token_ids)
        # Our GrammarCache is the one bounded cache (the compiler's own is off).
        return xgr.GrammarCompiler(info, max_threads=self.compile_threads, cache_enabled=False)

    def compiler(self, full_vocab: bool = False) -> xgr.GrammarCompiler:
        with self._lock:  # built once, on the first structured request (not at engine start)
            if full_vocab:
                if self._full_compiler is None:
                    self._full_compiler = self._new_compiler(())
                return self._full_compiler
            if self._compiler is None:
                specials = [t for t in self.tokenizer.all_special_ids if t not in self.stop_token_ids]
                self._compiler = self._new_compiler(specials)
            return self._compiler

    def compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        """The compiled grammar; raises (ValueError / RuntimeError, xgrammar's message)
        when the spec is not a valid grammar of its kind, or when it admits no output."""
        compiled = self._compile(key)
        if admits_nothing(compiled):
            # e.g. ``root ::= root``: xgrammar compiles it, but its mask allows no token, not
            # even a stop.  vLLM samples from the all -inf row, the grammar rejects the token
            # and the request ends with finish_reason "error" (a 500); refused here instead.
            raise ValueError("the grammar admits no output: no token can start it (its language is empty)")
        return compiled

    def _compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        separators = None if key.any_whitespace else (",", ":")
        if key.kind in ("json", "json_object"):
            # strict_mode (xgrammar's default, as vLLM leaves it): no properties beyond the
            # schema's unless it allows them, so disable_additional_properties changes nothing.
            return self.compiler().compile_json_schema(key.spec, any_whitespace=key.any_whitespace,
                                                       separators=separators)
        if key.kind == "regex":
            return self.compiler().compile_regex(key.spec)
        if key.kind == "grammar":
            if grammar_is_likely_lark(key.spec):  # as vLLM: Lark on the full vocabulary
                return self.compiler(full_vocab=True).compile_lark(key.spec)
            return self.compiler().compile_grammar(key.spec)
        if key.kind == "choice":
            return self.compiler().compile_grammar(choice_as_grammar(json.loads(key.spec)))
        if key.kind == "structural_tag":
            tag = json.loads(key.spec)
            if "structures" in tag:  # vLLM's older shape: begin / schema / end + triggers
                items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                         for s in tag["structures"]]
                return self.compiler(full_vocab=True).compile_structural_tag(items, tag["triggers"])
            return self.compiler(full_vocab=True).compile_structural_tag(key.spec)
        raise ValueError(f"unknown structured output kind {key.kind!r}")

    @staticmethod
    def matcher(compiled: xgr.CompiledGrammar, stop_token_ids: Optional[Sequence[int]]) -> xgr.GrammarMatcher:
        """A fresh matcher; ``stop_token_ids``: the request's stop ids (vLLM's
        all_stop_token_ids), None: the model's eos ids."""
        return xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) if stop_token_ids else None)


def admits_nothing(compiled: xgr.CompiledGrammar) -> bool:
    """No token, stop tokens included, can start the grammar's output."""
    matcher = xgr.GrammarMatcher(compiled)
    if matcher.is_terminated():
        return False
    mask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    return not bool(mask.any())
