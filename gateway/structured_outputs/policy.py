"""The server's ``--structured-outputs-config`` applied to one request on its way to the workers.

- ``disable_any_whitespace`` (vLLM applies the server's value to every grammar it compiles):
  set on the request's wire struct, so a worker compiles what this gateway was told;
- reasoning: with a reasoning parser, vLLM's engine lets the model reason unconstrained and
  starts the grammar once the parser sees reasoning end (``StructuredOutputManager``:
  ``enable_in_reasoning`` off, ``reasoning_ended`` not true).  The workers are not told the
  parser, so the gateway sends its markers as token ids (``reasoning_start`` / ``reasoning_end``
  on the wire: ``<think>`` / ``</think>`` for deepseek_r1 and qwen3, ``<|start|>assistant`` /
  the final channel's header for openai_gptoss); the engine checks the prompt for an already
  closed block, as vLLM's ``is_reasoning_end(prompt_token_ids)``.
  ``reasoning_ended: true`` (vLLM's render sets it when ``include_reasoning`` is off or the
  prompt closed reasoning) constrains from the first token: no markers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import msgspec

from common.errors import BadRequest
from common.protocol import StructuredOutputs
from common.structured_outputs_config import StructuredOutputsConfig
from gateway.structured_outputs.grammar_check import GrammarChecker
from gateway.structured_outputs.params import parse_structured_outputs

# Reasoning parser -> its (start, end) markers, as text (tokenized with the served tokenizer).
# GPT-OSS (harmony): the grammar shapes the final channel's text, after "<|channel|>final<|message|>";
# an assistant message start opens reasoning again, so a multi-turn prompt (earlier final answers,
# then the generation prompt's "<|start|>assistant") starts inside reasoning.
REASONING_MARKERS = {"deepseek_r1": ("<think>", "</think>"), "qwen3": ("<think>", "</think>"),
                     "openai_gptoss": ("<|start|>assistant", "<|channel|>final<|message|>")}


@dataclass
class StructuredOutputsPolicy:
    config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    reasoning_start: Optional[list[int]] = None
    reasoning_end: Optional[list[int]] = None
    checker: GrammarChecker = field(default_factory=GrammarChecker)

    @classmethod
    def build(cls, config: StructuredOutputsConfig, reasoning_parser: Optional[str], tokenizer) -> \
            "StructuredOutputsPolicy":
        """``tokenizer``: the gateway's (None on a tokens-only gateway, which has no parser)."""
        start = end = None
        markers = REASONING_MARKERS.get(reasoning_parser or "")
        if markers is not None and tokenizer is not None and not config.enable_in_reasoning:
            start, end = (tokenizer.encode(m, add_special_tokens=False) for m in markers)
        return cls(config=config, reasoning_start=start or None, reasoning_end=end or None)

    def wire(self, raw, *, reasoning_ended: Optional[bool], has_tokenizer: bool) -> Optional[StructuredOutputs]:
        """``sampling_params.structured_outputs`` (UNSET/None: none) -> the wire struct."""
        if raw is msgspec.UNSET or raw is None:
            return None
        so = parse_structured_outputs(raw)
        if not has_tokenizer:
            raise BadRequest("Structured outputs requires a tokenizer so it can't be used with "
                             "'skip_tokenizer_init'", "structured_outputs")
        so.disable_any_whitespace = so.disable_any_whitespace or self.config.disable_any_whitespace
        if reasoning_ended is not True and self.reasoning_end is not None:
            so.reasoning_start, so.reasoning_end = self.reasoning_start, self.reasoning_end
        return so

    async def check(self, so: Optional[StructuredOutputs], pool) -> None:
        """Convert the constraint to a grammar (400 if it does not); a cached outcome is read
        on the event loop, a new one is computed on the render pool."""
        if so is None:
            return
        known, refusal = self.checker.cached(so)
        if known:
            if refusal is not None:
                raise BadRequest(refusal, "structured_outputs")
            return
        if pool is None:  # no render pool (in-process tests): convert here
            self.checker.check(so)
            return
        await pool.run(self.checker.check, so)
