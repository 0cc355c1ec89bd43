"""validate_request: vLLM's messages and ranges for every field."""
from __future__ import annotations

import pytest

from common.errors import BadRequest
from common.protocol import GenerateRequest, ModelInfo, SamplingParams
from common.validation import validate_request

LIMITS = ModelInfo(name="m", vocab_size=100, max_model_len=32, max_num_seqs=8, max_logprobs=5)


def check(prompt=(1, 2, 3), *, tokens_only=False, stream=False, limits=LIMITS, output_text=False,
          cache_salt=None, **params):
    req = GenerateRequest(request_id="r", prompt_token_ids=list(prompt),
                          params=SamplingParams(**params), output_text=output_text,
                          cache_salt=cache_salt)
    validate_request(req, limits, tokens_only=tokens_only, stream=stream)


def rejects(message, param=None, **kw):
    with pytest.raises(BadRequest) as exc:
        check(**kw)
    assert message in exc.value.message, exc.value.message
    assert exc.value.status == 400
    if param is not None:
        assert exc.value.param == param
    return exc.value


def test_defaults_and_edges_accepted():
    check()
    check(temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2.0,
          frequency_penalty=2.0, repetition_penalty=0.01, max_tokens=1, min_tokens=1,
          logprobs=5, prompt_logprobs=0, n=1, seed=-5, logit_bias={99: 5.0},
          allowed_token_ids=[0, 99], stop=["x"], stop_token_ids=[99], bad_words=["w"])
    check(logprobs=-1, limits=ModelInfo(name="m", vocab_size=100, max_model_len=32,
                                        max_num_seqs=8, max_logprobs=-1))
    check(prompt=range(31), max_tokens=None)
    check(n=8, temperature=1e-5)  # the greedy cut-off itself samples, so n > 1 is fine


@pytest.mark.parametrize("kw,message,param", [
    (dict(n=0), "n must be at least 1, got 0.", "n"),
    (dict(n=9), "sampling_params.n must be at most the server's max_num_seqs (8), got 9.", "n"),
    (dict(temperature=2.5), "temperature must be in [0, 2], got 2.5.", "temperature"),
    (dict(temperature=-0.1), "temperature must be non-negative, got -0.1.", "temperature"),
    (dict(temperature=float("nan")), "temperature must be a finite number", "temperature"),
    (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0.", "top_p"),
    (dict(top_p=1.5), "top_p must be in (0, 1], got 1.5.", "top_p"),
    (dict(top_k=-2), "top_k must be 0 (disable), or at least 1, got -2.", "top_k"),
    (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5.", "min_p"),
    (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5.", None),
    (dict(frequency_penalty=-3.0), "frequency_penalty must be in [-2, 2], got -3.0.", None),
    (dict(repetition_penalty=0.0), "repetition_penalty must be greater than zero, got 0.0.", None),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number", None),
    (dict(max_tokens=0), "max_tokens must be at least 1, got 0.", "max_tokens"),
    (dict(min_tokens=-1), "min_tokens must be greater than or equal to 0, got -1.", None),
    (dict(max_tokens=3, min_tokens=4), "min_tokens must be less than or equal to max_tokens=3, got 4.",
     "min_tokens"),
    (dict(max_tokens=None, min_tokens=30), "min_tokens must be less than or equal to max_tokens=29",
     "min_tokens"),
    (dict(logprobs=-2), "logprobs must be non-negative or -1, got -2.", "logprobs"),
    (dict(logprobs=6), "Requested sample logprobs of 6, which is greater than max allowed: 5",
     "logprobs"),
    (dict(logprobs=-1), "Requested sample logprobs of 100, which is greater than max allowed: 5",
     "logprobs"),
    (dict(prompt_logprobs=-3), "prompt_logprobs must be non-negative or -1, got -3.", None),
    (dict(prompt_logprobs=7), "Requested prompt logprobs of 7, which is greater than max allowed: 5",
     "prompt_logprobs"),
    (dict(stop=[""]), "stop cannot contain an empty string.", "stop"),
    (dict(stop=["x"], detokenize=False), "stop strings are only supported when detokenize is True",
     "stop"),
    (dict(stop=["x"], tokens_only=True), "stop strings are not supported on a --tokens-only server",
     "stop"),
    (dict(bad_words=[""]), "bad_words cannot contain an empty string.", "bad_words"),
    (dict(bad_words=["w"], tokens_only=True), "bad_words requires a tokenizer", "bad_words"),
    (dict(logit_bias={100: 1.0}), "token_id(s) [100] in logit_bias contain out-of-vocab token ids. "
     "Vocabulary size: 100", "logit_bias"),
    (dict(stop_token_ids=[5, 120]), "token_id(s) [120] in stop_token_ids contain out-of-vocab",
     "stop_token_ids"),
    (dict(allowed_token_ids=[]), "allowed_token_ids is not None and empty!", "allowed_token_ids"),
    (dict(allowed_token_ids=[1, 100]), "allowed_token_ids contains out-of-vocab token id!",
     "allowed_token_ids"),
    (dict(seed=2 ** 64), "seed must be between", "seed"),
    (dict(n=2, temperature=0.0), "n must be 1 when using greedy sampling, got 2.", "n"),
    (dict(n=3, temperature=9e-6), "n must be 1 when using greedy sampling, got 3.", "n"),
])
def test_sampling_param_errors(kw, message, param):
    rejects(message, param, **kw)


def test_prompt_errors():
    rejects("token_ids must contain at least 1 token id.", "token_ids", prompt=[])
    rejects("token_ids must not contain negative values", "token_ids", prompt=[1, -1])
    rejects("Token id 100 is out of vocabulary", "token_ids", prompt=[1, 100, 5])
    rejects("The decoder prompt (length 33) is longer than the maximum model length of 32.",
            prompt=[1] * 33)
    rejects("The decoder prompt (length 32) plus the number of requested output tokens "
            "(at least 1) is longer than the maximum model length of 32.", prompt=[1] * 32)


def test_output_mode_errors():
    check(output_text=True)
    rejects("output_mode='text' requires sampling_params.detokenize to be true", "output_mode",
            output_text=True, detokenize=False)
    e = rejects("requires a tokenizer", "output_mode", output_text=True, tokens_only=True)
    assert "output_mode='tokens'" in e.message
    no_tok = ModelInfo(name="m", vocab_size=100, max_model_len=32, max_num_seqs=8,
                       has_tokenizer=False)
    rejects("requires a tokenizer", output_text=True, limits=no_tok)
    rejects("stop strings", stop=["x"], limits=no_tok)
    # the gateway forces detokenize off on a tokens-only server: still the tokens-only message
    rejects("not supported on a --tokens-only server", stop=["x"], detokenize=False,
            tokens_only=True)


def test_cache_salt():
    check(cache_salt="a" * 128)
    rejects("must be at most 128 characters", "cache_salt", cache_salt="a" * 129)
    for bad in ("a@b", "a/b", "a\\b", "a\x00b"):
        rejects("must not contain '@', '/', '\\\\', or NUL.", "cache_salt", cache_salt=bad)
    rejects("must be a non-empty string", "cache_salt", cache_salt="")


def test_prompt_logprob_token_ids():
    check(prompt=[1, 2, 3], prompt_logprob_token_ids=[[4, 5], [6, -1]])
    check(prompt=[1, 2, 3], prompt_logprob_token_ids=[[4, 5], [6]])  # ragged rows are padded
    rejects("prompt_logprob_token_ids has 3 rows, but the prompt has 2 scored rows",
            "prompt_logprob_token_ids", prompt=[1, 2, 3], prompt_logprob_token_ids=[[1]] * 3)
    rejects("prompt_logprob_token_ids has 1 rows, but the prompt has 0 scored rows",
            prompt=[1], prompt_logprob_token_ids=[[1]])
    rejects("out-of-vocab token ids (-1 pads a row). Vocabulary size: 100",
            prompt=[1, 2], prompt_logprob_token_ids=[[100]])
    rejects("out-of-vocab token ids", prompt=[1, 2], prompt_logprob_token_ids=[[-2]])
    rejects("must be a non-empty integer array", prompt=[1, 2], prompt_logprob_token_ids=[[]])
    rejects("Requested 6 token ids per row in prompt_logprob_token_ids, which is greater than "
            "max allowed: 5.", prompt=[1, 2], prompt_logprob_token_ids=[[1] * 6])
    rejects("at most 31 scored rows (max_model_len - 1)", prompt=[1] * 31,
            prompt_logprob_token_ids=[[1]] * 32)
    rejects("prompt_logprob_token_ids are not available when stream=true.",
            prompt=[1, 2], prompt_logprob_token_ids=[[1]], stream=True)
