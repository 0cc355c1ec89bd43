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

    The engine may keep one row per running choice across steps and pass the live
    ``output_token_ids`` list; the prompt tensor used for repetition penalties is
    then cached on the row and built once.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens this choice generated so far
    generator: Optional[torch.Generator] = None  # make_generator(...) when params.seed is set
    stop_ids_for_min_tokens: list[int] = field(default_factory=list)  # eos + stop_token_ids
    bad_words_ids: Optional[list[list[int]]] = None  # tokenize_bad_words(...) output
    _prompt_tensor: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    def prompt_tensor(self, device: torch.device) -> torch.Tensor:
        t = self._prompt_tensor
        if t is None or t.device != device:
            t = torch.tensor(self.prompt_token_ids, dtype=torch.long, device=device)
            self._prompt_tensor = t
        return t


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
            allowed_mask = torch.zeros((num_rows, vocab_size), dtype=torch.bool)
            for i, p in enumerate(params):
                if p.allowed_token_ids:
                    allowed_mask[i].fill_(True)
                    allowed_mask[i, torch.tensor(p.allowed_token_ids, dtype=torch.long)] = False
            allowed_mask = allowed_mask.to(device, non_blocking=True)

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
    n = len(pen_rows)
    prompt_mask = torch.zeros((n, vocab_size), dtype=torch.bool, device=device)
    output_counts = torch.zeros((n, vocab_size), dtype=torch.float32, device=device)
    for j, i in enumerate(pen_rows):
        r = rows[i]
        if r.params.repetition_penalty != 1.0 and r.prompt_token_ids:
            prompt_mask[j, r.prompt_tensor(device)] = True
        if r.output_token_ids:
            out = torch.tensor(r.output_token_ids, dtype=torch.long, device=device)
            output_counts[j].index_add_(0, out, torch.ones_like(out, dtype=torch.float32))
    ps = [rows[i].params for i in pen_rows]
    return Penalties(
        rows=torch.tensor(pen_rows, dtype=torch.long, device=device),
        prompt_mask=prompt_mask,
        output_counts=output_counts,
        presence=torch.tensor([p.presence_penalty for p in ps], dtype=torch.float32, device=device),
        frequency=torch.tensor([p.frequency_penalty for p in ps], dtype=torch.float32,
                               device=device),
        repetition=torch.tensor([p.repetition_penalty for p in ps], dtype=torch.float32,
                                device=device),
    )
