"""Request validation with vLLM's messages and ranges (vllm/sampling_params.py
``_verify_args`` / ``verify``, the token-in/token-out serving checks, the input
processor's prompt checks).

Pure functions, no I/O: the gateway calls ``validate_request`` before dispatch and
the engine calls it again for direct ZeroMQ clients.  Every failure raises
``common.errors.BadRequest(message, param)``.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

from common.errors import BadRequest
from common.protocol import GREEDY_TEMPERATURE, GenerateRequest, ModelInfo, SamplingParams

MAX_CACHE_SALT_LENGTH = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")
_INT64_MIN = -(2 ** 63)
_INT64_MAX = 2 ** 63 - 1
_UINT64_MAX = 2 ** 64 - 1


def _fail(message: str, param: Optional[str]) -> None:
    raise BadRequest(message, param)


def summarize(values: Iterable, limit: int = 5, item_chars: int = 64) -> str:
    """A list for an error message: its first ``limit`` items (each cut to ``item_chars``)
    and how many more.  Echoing every bad id made a million stop_token_ids a 7.9 MB 400."""
    values = list(values)
    shown = []
    for v in values[:limit]:
        text = repr(v)
        shown.append(text if len(text) <= item_chars else text[:item_chars] + f"... ({len(text) - item_chars} more "
                                                                            f"characters)")
    more = len(values) - len(shown)
    return "[" + ", ".join(shown) + (f", ... ({more} more)" if more > 0 else "") + "]"


def _out_of_vocab(ids: Iterable[int], vocab_size: int) -> list[int]:
    return [t for t in ids if t < 0 or t >= vocab_size]


def validate_request(req: GenerateRequest, limits: ModelInfo, *, tokens_only: bool,
                     stream: bool = False) -> None:
    """Validate a whole request against the served model's limits.

    ``tokens_only``: the server runs without a tokenizer (``--tokens-only``), so
    detokenization is off and text mode, stop strings and bad words are refused.
    ``stream``: the HTTP request streams (prompt_logprob_token_ids has no place in
    the stream schema).
    """
    validate_prompt(req.prompt_token_ids, limits)
    validate_cache_salt(req.cache_salt)
    if not _INT64_MIN <= req.priority <= _INT64_MAX:
        _fail(f"priority must be a 64-bit signed integer, got {req.priority}.", "priority")
    p = req.params
    has_tokenizer = limits.has_tokenizer and not tokens_only
    if not has_tokenizer and p.stop:
        # Before the detokenize check: a tokens-only server may already have forced
        # detokenize off, and this is the message that explains why stop fails.
        _fail("stop strings are not supported on a --tokens-only server because "
              "detokenization is disabled. Check stop strings on the coordinator, "
              "or use stop_token_ids.", "stop")
    validate_sampling_params(p)

    if not 0 <= p.routed_experts_prompt_start <= len(req.prompt_token_ids):
        _fail(f"routed_experts_prompt_start must be between 0 and the prompt length "
              f"({len(req.prompt_token_ids)}), inclusive.", "routed_experts_prompt_start")
    if req.output_text and not p.detokenize:
        _fail("output_mode='text' requires sampling_params.detokenize to be true", "output_mode")
    if p.n > limits.max_num_seqs:
        _fail(f"sampling_params.n must be at most the server's max_num_seqs "
              f"({limits.max_num_seqs}), got {p.n}.", "n")
    if stream and p.prompt_logprob_token_ids is not None:
        _fail("prompt_logprob_token_ids are not available when stream=true.",
              "prompt_logprob_token_ids")
    if req.output_text and not has_tokenizer:
        _fail("output_mode='text' requires a tokenizer, but this server does not load one "
              "(--tokens-only or --skip-tokenizer-init). Send the request to a server that "
              "loads a tokenizer, or use output_mode='tokens'.", "output_mode")
    if not has_tokenizer and p.bad_words:
        _fail("bad_words requires a tokenizer, but this server does not load one "
              "(--tokens-only or --skip-tokenizer-init).", "bad_words")

    validate_against_model(p, limits, len(req.prompt_token_ids))


def validate_prompt(token_ids: list[int], limits: ModelInfo) -> None:
    if not token_ids:
        _fail("token_ids must contain at least 1 token id.", "token_ids")
    lo = min(token_ids)
    if lo < 0:
        _fail("token_ids must not contain negative values", "token_ids")
    hi = max(token_ids)
    if hi >= limits.vocab_size:
        _fail(f"Token id {hi} is out of vocabulary", "token_ids")
    n, max_len = len(token_ids), limits.max_model_len
    if n > max_len:
        _fail(f"The decoder prompt (length {n}) is longer than the maximum model length "
              f"of {max_len}. Make sure that `max_model_len` is no smaller than the "
              f"number of text tokens.", "token_ids")
    if n == max_len:
        _fail(f"The decoder prompt (length {n}) plus the number of requested output "
              f"tokens (at least 1) is longer than the maximum model length of {max_len}. "
              f"Make sure that `max_model_len` is no smaller than the number of text "
              f"tokens (prompt + requested output tokens).", "token_ids")


def validate_cache_salt(cache_salt: Optional[str]) -> None:
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str) or not cache_salt:
        _fail("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    if len(cache_salt) > MAX_CACHE_SALT_LENGTH or any(c in _CACHE_SALT_FORBIDDEN
                                                      for c in cache_salt):
        _fail("Parameter 'cache_salt' must be at most 128 characters and must not "
              "contain '@', '/', '\\\\', or NUL.", "cache_salt")


def _finite(value: float, name: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        _fail(f"{name} must be a finite number, got {value}.", name)


def validate_sampling_params(p: SamplingParams) -> None:
    """Model-independent checks (vLLM ``SamplingParams._verify_args``)."""
    if not isinstance(p.n, int) or isinstance(p.n, bool):
        _fail(f"n must be an int, but is of type {type(p.n)}", "n")
    if p.n < 1:
        _fail(f"n must be at least 1, got {p.n}.", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        _finite(value, name)
        if not -2.0 <= value <= 2.0:
            _fail(f"{name} must be in [-2, 2], got {value}.", name)
    _finite(p.repetition_penalty, "repetition_penalty")
    if p.repetition_penalty <= 0.0:
        _fail(f"repetition_penalty must be greater than zero, got {p.repetition_penalty}.",
              "repetition_penalty")
    if p.temperature is None:
        _fail("temperature must be a number, got None.", "temperature")
    _finite(p.temperature, "temperature")
    if p.temperature < 0.0:
        _fail(f"temperature must be non-negative, got {p.temperature}.", "temperature")
    if p.temperature > 2.0:
        _fail(f"temperature must be in [0, 2], got {p.temperature}.", "temperature")
    if p.temperature < GREEDY_TEMPERATURE and p.n > 1:  # n identical greedy choices: vLLM refuses
        _fail(f"n must be 1 when using greedy sampling, got {p.n}.", "n")
    if not 0.0 < p.top_p <= 1.0:
        _fail(f"top_p must be in (0, 1], got {p.top_p}.", "top_p")
    if not isinstance(p.top_k, int) or isinstance(p.top_k, bool):
        _fail(f"top_k must be an integer, got {type(p.top_k).__name__}", "top_k")
    if p.top_k < -1:
        _fail(f"top_k must be 0 (disable), or at least 1, got {p.top_k}.", "top_k")
    if not 0.0 <= p.min_p <= 1.0:
        _fail(f"min_p must be in [0, 1], got {p.min_p}.", "min_p")
    if p.seed is not None and not _INT64_MIN <= p.seed <= _UINT64_MAX:
        _fail(f"seed must be between -2**63 and 2**64 - 1, got {p.seed}.", "seed")
    if p.max_tokens is not None and p.max_tokens < 1:
        _fail(f"max_tokens must be at least 1, got {p.max_tokens}.", "max_tokens")
    if p.min_tokens < 0:
        _fail(f"min_tokens must be greater than or equal to 0, got {p.min_tokens}.",
              "min_tokens")
    if p.max_tokens is not None and p.min_tokens > p.max_tokens:
        _fail(f"min_tokens must be less than or equal to max_tokens={p.max_tokens}, "
              f"got {p.min_tokens}.", "min_tokens")
    if p.logprobs is not None and p.logprobs != -1 and p.logprobs < 0:
        _fail(f"logprobs must be non-negative or -1, got {p.logprobs}.", "logprobs")
    if p.prompt_logprobs is not None and p.prompt_logprobs != -1 and p.prompt_logprobs < 0:
        _fail(f"prompt_logprobs must be non-negative or -1, got {p.prompt_logprobs}.",
              "prompt_logprobs")
    if p.stop is not None and any(not s for s in p.stop):
        _fail("stop cannot contain an empty string.", "stop")
    if p.stop and not p.detokenize:
        _fail("stop strings are only supported when detokenize is True. "
              "Set detokenize=True to use stop.", "stop")
    if p.bad_words is not None and any(not w for w in p.bad_words):
        _fail(f"bad_words cannot contain an empty string. Got bad_words={summarize(p.bad_words)}",
              "bad_words")


def validate_against_model(p: SamplingParams, limits: ModelInfo, prompt_len: int) -> None:
    """Checks needing the model's vocab / limits and the prompt length (vLLM
    ``SamplingParams.verify`` and the input processor)."""
    vocab = limits.vocab_size
    max_logprobs = vocab if limits.max_logprobs == -1 else limits.max_logprobs

    if p.logprobs:
        k = vocab if p.logprobs == -1 else p.logprobs
        if k > max_logprobs:
            _fail(f"Requested sample logprobs of {k}, which is greater than max allowed: "
                  f"{max_logprobs}", "logprobs")
    if p.prompt_logprobs:
        k = vocab if p.prompt_logprobs == -1 else p.prompt_logprobs
        if k > max_logprobs:
            _fail(f"Requested prompt logprobs of {k}, which is greater than max allowed: "
                  f"{max_logprobs}", "prompt_logprobs")
    if p.prompt_logprob_token_ids is not None:
        _validate_prompt_logprob_token_ids(p.prompt_logprob_token_ids, limits, max_logprobs,
                                           prompt_len)
    if p.logit_bias:
        bad = _out_of_vocab(p.logit_bias, vocab)
        if bad:
            _fail(f"token_id(s) {summarize(bad)} in logit_bias contain out-of-vocab token ids. "
                  f"Vocabulary size: {vocab}", "logit_bias")
        for tok, bias in p.logit_bias.items():
            if not isinstance(bias, (int, float)) or math.isnan(bias):
                _fail(f"logit_bias value for token {tok} must be a number, got {bias}.",
                      "logit_bias")
    if p.stop_token_ids:
        bad = _out_of_vocab(p.stop_token_ids, vocab)
        if bad:
            _fail(f"token_id(s) {summarize(bad)} in stop_token_ids contain out-of-vocab token ids. "
                  f"Vocabulary size: {vocab}", "stop_token_ids")
    if p.allowed_token_ids is not None:
        if len(p.allowed_token_ids) == 0:
            _fail("allowed_token_ids is not None and empty!", "allowed_token_ids")
        if _out_of_vocab(p.allowed_token_ids, vocab):
            _fail("allowed_token_ids contains out-of-vocab token id!", "allowed_token_ids")
    # With max_tokens unset the engine generates up to max_model_len - prompt_len;
    # min_tokens is checked against that (vLLM input processor).
    if p.max_tokens is None:
        budget = limits.max_model_len - prompt_len
        if p.min_tokens > budget:
            _fail(f"min_tokens must be less than or equal to max_tokens={budget}, "
                  f"got {p.min_tokens}.", "min_tokens")


def _validate_prompt_logprob_token_ids(rows: list[list[int]], limits: ModelInfo,
                                       max_logprobs: int, prompt_len: int) -> None:
    param = "prompt_logprob_token_ids"
    width = max((len(r) for r in rows), default=0)
    if not rows or width == 0:
        _fail("prompt_logprob_token_ids must be a non-empty integer array of shape "
              "[num_rows, num_ids].", param)
    max_rows = limits.max_model_len - 1
    if len(rows) > max_rows:
        _fail(f"prompt_logprob_token_ids has {len(rows)} rows, but a prompt has at most "
              f"{max_rows} scored rows (max_model_len - 1).", param)
    if width > max_logprobs:
        _fail(f"Requested {width} token ids per row in prompt_logprob_token_ids, which is "
              f"greater than max allowed: {max_logprobs}. Set max_logprobs (--max-logprobs) "
              f"to at least {width}.", param)
    lo = min(min(r) for r in rows if r)
    hi = max(max(r) for r in rows if r)
    if lo < -1 or hi >= limits.vocab_size:
        _fail(f"prompt_logprob_token_ids contain out-of-vocab token ids (-1 pads a row). "
              f"Vocabulary size: {limits.vocab_size}", param)
    scored = max(prompt_len - 1, 0)
    if len(rows) != scored:
        _fail(f"prompt_logprob_token_ids has {len(rows)} rows, but the prompt has {scored} "
              f"scored rows (prompt_len - 1 - prompt_logprob_start).", param)
