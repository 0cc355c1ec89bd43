"""``--speculative-config``: vLLM's JSON, the ngram method's keys and defaults."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

# Keys of vLLM's SpeculativeConfig each method takes here.
_KEYS = {"ngram": {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                   "disable_by_batch_size"},
         "draft_model": {"method", "model", "num_speculative_tokens", "draft_tensor_parallel_size",
                         "disable_by_batch_size"}}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    disable_by_batch_size: Optional[int] = None  # vLLM: no drafts once this many requests run
    model: Optional[str] = None  # draft_model: the draft checkpoint's folder

    @classmethod
    def parse(cls, value: Union[str, dict, None]) -> Optional["SpeculativeConfig"]:
        """None when speculation is off; ValueError naming what is wrong."""
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("--speculative-config must be a JSON object")
        cfg: dict[str, Any] = dict(value)
        method = cfg.get("method")
        if method is None and cfg.get("model") in ("ngram", "[ngram]"):  # vLLM's older spelling
            method = cfg.pop("model")
        if method == "[ngram]":
            method = "ngram"
        if method is None and cfg.get("model"):
            method = "draft_model"
        if method not in _KEYS:
            raise ValueError(f"--speculative-config: method {method!r} is not supported; supported: "
                             f"'ngram', 'draft_model'")
        unknown = sorted(set(cfg) - _KEYS[method])
        if unknown:
            raise ValueError(f"--speculative-config: {', '.join(unknown)} not supported with method {method!r}")
        k = cfg.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"--speculative-config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        disable = cfg.get("disable_by_batch_size")
        if disable is not None and (not isinstance(disable, int) or disable < 2):
            raise ValueError(f"--speculative-config: disable_by_batch_size must be an integer >= 2, got {disable!r}")
        if method == "draft_model":
            model = cfg.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError("--speculative-config: method 'draft_model' needs 'model' (the draft checkpoint)")
            if cfg.get("draft_tensor_parallel_size", 1) != 1:
                raise ValueError("--speculative-config: draft_tensor_parallel_size must be 1")
            return cls("draft_model", k, disable_by_batch_size=disable, model=model)
        lo, hi = cfg.get("prompt_lookup_min"), cfg.get("prompt_lookup_max")
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"--speculative-config: {name} must be an integer >= 1, got {v!r}")
        if lo is None and hi is None:
            lo = hi = 5  # vLLM's defaults
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if lo > hi:
            raise ValueError(f"prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
        return cls("ngram", k, lo, hi, disable)
