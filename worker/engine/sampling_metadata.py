"""Per-step sampling inputs: one ``SamplingRow`` per choice that samples this step,
packed by ``SamplingMetadata.build`` into the few tensors the ``Sampler`` needs.

Every optional feature (penalties, logit bias, allowed ids, min_tokens, top-k/p,
min_p, logprobs) is only materialised when at least one row uses it, so the
common all-greedy / plain-temperature batch costs a couple of tiny tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from common.protocol import SamplingParams

SAMPLING_EPS = 1e-5  # temperature below this means greedy (vLLM)
_UINT64_MASK = (1 << 64) - 1


def make_generator(seed: int, choice_index: int, device: torch.device | str) -> torch.Generator:
    """Per-choice RNG for a seeded request.

    Choice ``i`` of a request with ``seed`` uses seed ``seed + i`` (vLLM's parallel
    sampling gives child ``i`` the seed ``seed + index``), so the n choices draw
    distinct streams and every choice is reproducible on its own: the same
    (seed, index) yields the same tokens whatever else is in the batch.
    Folded into the unsigned 64-bit range torch accepts.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed((int(seed) + int(choice_index)) & _UINT64_MASK)
    return gen


def _encode_ids(tokenizer: Any, text: str) -> list[int]:
    out = tokenizer.encode(text, add_special_tokens=False)
    return list(getattr(out, "ids", out))  # raw tokenizers.Encoding or a list


def tokenize_bad_words(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """Token-id sequences to forbid for ``bad_words`` (vLLM ``update_from_tokenizer``).

    Each word is encoded without and with a leading space, so it is blocked both
    at the start of the text and mid-sentence; the spaced form is kept only when it
    yields a different first token and the same length (otherwise it is the same
    word split differently and would over-block).
    """
    result: list[list[int]] = []
    for word in words:
        plain: Optional[list[int]] = None
        for add_prefix_space in (False, True):
            ids = _encode_ids(tokenizer, (" " if add_prefix_space else "") + word.lstrip())
            if not ids:
                if not add_prefix_space:
                    raise ValueError("bad_words entries must tokenize to at least one token.")
                continue
            if not add_prefix_space:
                plain = ids
                result.append(ids)
            elif plain is not None and ids[0] != plain[0] and len(ids) == len(plain):
                result.append(ids)
    return result


@dataclass
class SamplingRow:
    """One choice that samples a token this step.

    The engine should keep one row per running choice across steps, holding the
    live ``output_token_ids`` list: the device tensors for penalties and
    allowed_token_ids are then cached on the row and updated incrementally (only the
    newly generated tokens are counted each step) instead of rebuilt from lists.
    A fresh row per step is also correct, just slower for those features.  The
    output list may only grow (or shrink, which triggers a rebuild); replacing
    tokens in place needs a new row.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens this choice generated so far
    generator: Optional[torch.Generator] = None  # make_generator(...) when params.seed is set
    stop_ids_for_min_tokens: list[int] = field(default_factory=list)  # eos + stop_token_ids
    bad_words_ids: Optional[list[list[int]]] = None  # tokenize_bad_words(...) output
    # Device-side caches, valid while the row object lives (see class docstring).
    _prompt_mask: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    _output_counts: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    _num_counted: int = field(default=0, repr=False, compare=False)
    _allowed_mask: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    def prompt_mask(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[V] bool: token occurs in the prompt (built once)."""
        m = self._prompt_mask
        if m is None or m.device != device or m.shape[0] != vocab_size:
            m = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if self.prompt_token_ids:
                m[torch.tensor(self.prompt_token_ids, dtype=torch.long, device=device)] = True
            self._prompt_mask = m
        return m

    def output_counts(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[V] float32 occurrences in the output, updated with only the new tokens."""
        c = self._output_counts
        out = self.output_token_ids
        if (c is None or c.device != device or c.shape[0] != vocab_size
                or self._num_counted > len(out)):
            c = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            self._num_counted = 0
            self._output_counts = c
        if self._num_counted < len(out):
            new = torch.tensor(out[self._num_counted:], dtype=torch.long, device=device)
            c.index_add_(0, new, torch.ones_like(new, dtype=torch.float32))
            self._num_counted = len(out)
        return c

    def allowed_mask(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[V] bool, True = not in allowed_token_ids (built once)."""
        m = self._allowed_mask
        if m is None or m.device != device or m.shape[0] != vocab_size:
            m = torch.ones(vocab_size, dtype=torch.bool)
            m[torch.tensor(self.params.allowed_token_ids, dtype=torch.long)] = False
            m = m.to(device)
            self._allowed_mask = m
        return m


def _row_needs_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


@dataclass
class Penalties:
    """Penalty inputs for the subset of rows that use any penalty."""

    rows: torch.Tensor  # [Rp] long: batch rows these apply to
    prompt_mask: torch.Tensor  # [Rp, V] bool: token occurs in the prompt
    output_counts: torch.Tensor  # [Rp, V] float: occurrences in the output so far
    presence: torch.Tensor  # [Rp] float
    frequency: torch.Tensor  # [Rp] float
    repetition: torch.Tensor  # [Rp] float


@dataclass
class SamplingMetadata:
    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    temperature: Optional[torch.Tensor]  # [R] float32; None when all greedy
    top_k: Optional[torch.Tensor]  # [R] long, V for rows without top-k; None if unused
    top_k_max: int  # host-side max of top_k (no device sync when masking)
    top_p: Optional[torch.Tensor]  # [R] float32, 1.0 for rows without top-p; None if unused
    min_p: Optional[torch.Tensor]  # [R] float32; None if unused
    generators: dict[int, torch.Generator]  # row -> per-choice RNG (seeded rows)
    max_num_logprobs: Optional[int]  # max over rows; -1 = whole vocab; None = no row asks
    num_logprobs: list[Optional[int]]  # per-row request (None / k / -1)
    allowed_token_ids_mask: Optional[torch.Tensor]  # [R, V] bool, True = banned
    logit_bias: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # rows, ids, biases
    min_tokens_mask: Optional[tuple[torch.Tensor, torch.Tensor]]  # rows, stop ids to ban
    bad_words: dict[int, list[list[int]]]  # row -> forbidden sequences
    output_token_ids: list[list[int]]
    penalties: Optional[Penalties]

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], vocab_size: int,
              device: torch.device | str) -> "SamplingMetadata":
        device = torch.device(device)
        num_rows = len(rows)
        params = [r.params for r in rows]

        greedy = [p.temperature < SAMPLING_EPS for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)
        temperature = None
        if not all_greedy:
            temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32,
                                       device=device)

        top_k = None
        top_k_max = 0
        top_p = None
        min_p = None
        generators: dict[int, torch.Generator] = {}
        if not all_greedy:
            ks = [p.top_k if 0 < p.top_k < vocab_size and not g else vocab_size
                  for p, g in zip(params, greedy)]
            if any(k < vocab_size for k in ks):
                top_k = torch.tensor(ks, dtype=torch.long, device=device)
                top_k_max = max(k for k in ks if k < vocab_size)
            ps = [p.top_p if not g else 1.0 for p, g in zip(params, greedy)]
            if any(x < 1.0 for x in ps):
                top_p = torch.tensor(ps, dtype=torch.float32, device=device)
            mps = [p.min_p if not g else 0.0 for p, g in zip(params, greedy)]
            if any(x > SAMPLING_EPS for x in mps):
                min_p = torch.tensor(mps, dtype=torch.float32, device=device)
            generators = {i: r.generator for i, (r, g) in enumerate(zip(rows, greedy))
                          if r.generator is not None and not g}

        num_logprobs = [p.logprobs for p in params]
        requested = [k for k in num_logprobs if k is not None]
        max_num_logprobs: Optional[int] = None
        if requested:
            max_num_logprobs = -1 if -1 in requested else max(requested)

        allowed_mask = None
        if any(p.allowed_token_ids for p in params):
            no_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            allowed_mask = torch.stack([
                r.allowed_mask(vocab_size, device) if r.params.allowed_token_ids else no_mask
                for r in rows])

        logit_bias = None
        if any(p.logit_bias for p in params):
            b_rows: list[int] = []
            b_ids: list[int] = []
            b_vals: list[float] = []
            for i, p in enumerate(params):
                for tok, bias in (p.logit_bias or {}).items():
                    b_rows.append(i)
                    b_ids.append(int(tok))
                    b_vals.append(min(100.0, max(-100.0, float(bias))))
            logit_bias = (torch.tensor(b_rows, dtype=torch.long, device=device),
                          torch.tensor(b_ids, dtype=torch.long, device=device),
                          torch.tensor(b_vals, dtype=torch.float32, device=device))

        min_tokens_mask = None
        m_rows: list[int] = []
        m_ids: list[int] = []
        for i, r in enumerate(rows):
            if r.stop_ids_for_min_tokens and len(r.output_token_ids) < r.params.min_tokens:
                m_rows.extend([i] * len(r.stop_ids_for_min_tokens))
                m_ids.extend(r.stop_ids_for_min_tokens)
        if m_rows:
            min_tokens_mask = (torch.tensor(m_rows, dtype=torch.long, device=device),
                               torch.tensor(m_ids, dtype=torch.long, device=device))

        bad_words = {i: r.bad_words_ids for i, r in enumerate(rows) if r.bad_words_ids}

        penalties = None
        pen_rows = [i for i, p in enumerate(params) if _row_needs_penalties(p)]
        if pen_rows:
            penalties = _build_penalties(rows, pen_rows, vocab_size, device)

        return cls(
            num_rows=num_rows, vocab_size=vocab_size, all_greedy=all_greedy,
            all_random=all_random, temperature=temperature, top_k=top_k,
            top_k_max=top_k_max, top_p=top_p, min_p=min_p, generators=generators,
            max_num_logprobs=max_num_logprobs, num_logprobs=num_logprobs,
            allowed_token_ids_mask=allowed_mask, logit_bias=logit_bias,
            min_tokens_mask=min_tokens_mask, bad_words=bad_words,
            output_token_ids=[r.output_token_ids for r in rows], penalties=penalties)


def _build_penalties(rows: Sequence[SamplingRow], pen_rows: list[int], vocab_size: int,
                     device: torch.device) -> Penalties:
    no_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    prompt_masks = []
    counts = []
    for i in pen_rows:
        r = rows[i]
        # Only the repetition penalty looks at the prompt.
        prompt_masks.append(r.prompt_mask(vocab_size, device)
                            if r.params.repetition_penalty != 1.0 else no_prompt)
        counts.append(r.output_counts(vocab_size, device))
    ps = [rows[i].params for i in pen_rows]
    return Penalties(
        rows=torch.tensor(pen_rows, dtype=torch.long, device=device),
        prompt_mask=torch.stack(prompt_masks),
        output_counts=torch.stack(counts),
        presence=torch.tensor([p.presence_penalty for p in ps], dtype=torch.float32, device=device),
        frequency=torch.tensor([p.frequency_penalty for p in ps], dtype=torch.float32,
                               device=device),
        repetition=torch.tensor([p.repetition_penalty for p in ps], dtype=torch.float32,
                                device=device),
    )
