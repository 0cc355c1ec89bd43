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

from common.protocol import GREEDY_TEMPERATURE, SamplingParams

SAMPLING_EPS = GREEDY_TEMPERATURE  # temperature below this means greedy (vLLM)
# Rows with 0 < top_k <= this sample among their top-k logits only (a partial topk
# instead of a full-vocab sort and full-vocab noise); larger k use the full path.
MAX_CANDIDATE_TOP_K = 256
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
    live ``output_token_ids`` list: the penalty bookkeeping and the allowed_token_ids
    mask are then cached on the row and updated incrementally (only the newly
    generated tokens are counted each step) instead of rebuilt from lists.
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
    _pen_ids: Optional[list[int]] = field(default=None, repr=False, compare=False)
    _pen_pos: dict[int, int] = field(default_factory=dict, repr=False, compare=False)
    _pen_counts: list[int] = field(default_factory=list, repr=False, compare=False)
    _pen_counted: int = field(default=0, repr=False, compare=False)
    _pen_ids_t: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    _pen_counts_t: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    _allowed_mask: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    def penalty_entries(self) -> tuple[list[int], list[int]]:
        """The distinct tokens penalties touch and their counts in the output.

        Tokens of the prompt (only when the repetition penalty is on, the one penalty
        that looks at it) and of the output, each once, in first-seen order; counts
        are output occurrences (0 for prompt-only tokens).  Updated with only the
        tokens generated since the previous call.
        """
        out = self.output_token_ids
        if self._pen_ids is None or self._pen_counted > len(out):
            ids: list[int] = []
            self._pen_pos = {}
            self._pen_counts = []
            if self.params.repetition_penalty != 1.0:
                ids = list(dict.fromkeys(self.prompt_token_ids))
                self._pen_pos = {t: j for j, t in enumerate(ids)}
                self._pen_counts = [0] * len(ids)
            self._pen_ids = ids
            self._pen_counted = 0
        ids, pos, counts = self._pen_ids, self._pen_pos, self._pen_counts
        for t in out[self._pen_counted:]:
            j = pos.get(t)
            if j is None:
                pos[t] = len(ids)
                ids.append(t)
                counts.append(1)
            else:
                counts[j] += 1
        self._pen_counted = len(out)
        return ids, counts

    def penalty_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``penalty_entries`` as device tensors (long ids, float32 counts), grown by
        appending the new tokens rather than rebuilt from the lists each step."""
        out = self.output_token_ids
        ids_t = self._pen_ids_t
        if (ids_t is None or ids_t.device != device or self._pen_ids is None
                or self._pen_counted > len(out)):
            self._pen_ids = None
            ids, counts = self.penalty_entries()
            self._pen_ids_t = torch.tensor(ids, dtype=torch.long, device=device)
            self._pen_counts_t = torch.tensor(counts, dtype=torch.float32, device=device)
            return self._pen_ids_t, self._pen_counts_t
        start, num_old = self._pen_counted, len(self._pen_ids)
        ids, _ = self.penalty_entries()
        new_tokens = out[start:]
        if len(ids) > num_old:
            self._pen_ids_t = torch.cat([ids_t, torch.tensor(ids[num_old:], dtype=torch.long,
                                                             device=device)])
            self._pen_counts_t = torch.cat([self._pen_counts_t, torch.zeros(
                len(ids) - num_old, dtype=torch.float32, device=device)])
        if new_tokens:
            pos = torch.tensor([self._pen_pos[t] for t in new_tokens], dtype=torch.long,
                               device=device)
            self._pen_counts_t.index_add_(0, pos, torch.ones(len(new_tokens), device=device))
        return self._pen_ids_t, self._pen_counts_t

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
    """Penalty inputs as flat (row, token) entries: only tokens a row has seen are
    touched, so the cost follows prompt + output length, not batch x vocab."""

    flat_index: torch.Tensor  # [S] long: row * vocab + token, a (row, seen token) pair
    output_counts: torch.Tensor  # [S] float32: occurrences in the output so far
    presence: torch.Tensor  # [S] float32: the row's presence_penalty
    frequency: torch.Tensor  # [S] float32
    repetition: torch.Tensor  # [S] float32


@dataclass
class RandomGroup:
    """Random-sampling rows sharing one code path, with their filter parameters."""

    rows: Optional[torch.Tensor]  # [G] long batch rows; None = every row of the batch
    row_ids: list[int]  # host copy of the batch rows
    top_k: Optional[torch.Tensor]  # [G] long, vocab size for rows without top-k; None if unused
    top_k_max: int  # host-side max of top_k: no device sync to size the topk
    top_p: Optional[torch.Tensor]  # [G] float32, 1.0 for rows without; None if unused
    min_p: Optional[torch.Tensor]  # [G] float32; None if unused
    generators: dict[int, torch.Generator]  # group-relative row -> per-choice RNG
    top_k_list: list[int]  # host copy of top_k (rows' own k, vocab size when off)

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], ids: list[int], num_rows: int, vocab_size: int,
              device: torch.device) -> "RandomGroup":
        params = [rows[i].params for i in ids]
        ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_k = None
        top_k_max = 0
        if any(k < vocab_size for k in ks):
            top_k = torch.tensor(ks, dtype=torch.long, device=device)
            top_k_max = max(k for k in ks if k < vocab_size)
        ps = [p.top_p for p in params]
        top_p = torch.tensor(ps, dtype=torch.float32, device=device) if any(
            x < 1.0 for x in ps) else None
        mps = [p.min_p for p in params]
        min_p = torch.tensor(mps, dtype=torch.float32, device=device) if any(
            x > SAMPLING_EPS for x in mps) else None
        generators = {j: rows[i].generator for j, i in enumerate(ids)
                      if rows[i].generator is not None}
        all_rows = len(ids) == num_rows
        return cls(rows=None if all_rows else torch.tensor(ids, dtype=torch.long, device=device),
                   row_ids=ids, top_k=top_k, top_k_max=top_k_max, top_p=top_p, min_p=min_p,
                   generators=generators, top_k_list=ks)


@dataclass
class SamplingMetadata:
    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    temperature: Optional[torch.Tensor]  # [R] float32; None when all greedy
    # Random rows split by how they are sampled (each row's path depends only on its
    # own params, so a seeded row's draws never depend on the rest of the batch):
    full_vocab: Optional[RandomGroup]  # rows sampled over the whole vocabulary
    top_k_candidates: Optional[RandomGroup]  # rows with a small top_k: only k candidates
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

        full_vocab = None
        candidates = None
        if not all_greedy:
            random_rows = [i for i, g in enumerate(greedy) if not g]
            small_k = [i for i in random_rows if 0 < params[i].top_k <= MAX_CANDIDATE_TOP_K
                       and params[i].top_k < vocab_size]
            small = set(small_k)
            others = [i for i in random_rows if i not in small]
            if others:
                full_vocab = RandomGroup.build(rows, others, num_rows, vocab_size, device)
            if small_k:
                candidates = RandomGroup.build(rows, small_k, num_rows, vocab_size, device)

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
            all_random=all_random, temperature=temperature, full_vocab=full_vocab,
            top_k_candidates=candidates,
            max_num_logprobs=max_num_logprobs, num_logprobs=num_logprobs,
            allowed_token_ids_mask=allowed_mask, logit_bias=logit_bias,
            min_tokens_mask=min_tokens_mask, bad_words=bad_words,
            output_token_ids=[r.output_token_ids for r in rows], penalties=penalties)


def _build_penalties(rows: Sequence[SamplingRow], pen_rows: list[int], vocab_size: int,
                     device: torch.device) -> Optional[Penalties]:
    ids: list[torch.Tensor] = []
    counts: list[torch.Tensor] = []
    per_entry: list[list[torch.Tensor]] = [[], [], [], []]  # row, presence, frequency, rep.
    for i in pen_rows:
        ids_t, counts_t = rows[i].penalty_tensors(device)
        n = ids_t.numel()
        if not n:
            continue
        p = rows[i].params
        ids.append(ids_t)
        counts.append(counts_t)
        # torch.full per row: cheaper than one gather/repeat_interleave, which spawn
        # intra-op threads for a few thousand elements.
        per_entry[0].append(torch.full((n,), i, dtype=torch.long, device=device))
        for dst, value in zip(per_entry[1:], (p.presence_penalty, p.frequency_penalty,
                                              p.repetition_penalty)):
            dst.append(torch.full((n,), value, dtype=torch.float32, device=device))
    if not ids:
        return None
    row_t, presence, frequency, repetition = (torch.cat(x) for x in per_entry)
    return Penalties(flat_index=row_t * vocab_size + torch.cat(ids), output_counts=torch.cat(counts),
                     presence=presence, frequency=frequency, repetition=repetition)


def reads_output_history(row: SamplingRow) -> bool:
    """Whether sampling a choice reads the tokens it generated so far (penalty counts,
    min_tokens' count where it masks stop ids, bad words' prefixes).  Async scheduling
    plans a step before the previous step's token is known, so such a choice's steps
    run synchronously."""
    p = row.params
    return (_row_needs_penalties(p) or (p.min_tokens > 0 and bool(row.stop_ids_for_min_tokens))
            or bool(row.bad_words_ids))


def draft_sampling_rows(seq: Any, spec: tuple) -> list[SamplingRow]:
    """The choice's sampling row (``seq``: an EngineSequence), then one per draft whose history ends with the drafts
    before it (fresh rows: their penalty caches must not touch the live one)."""
    row = seq.sampling_row
    if not spec:
        return [row]
    out = [row]
    for j in range(1, len(spec) + 1):
        out.append(SamplingRow(params=row.params, prompt_token_ids=row.prompt_token_ids,
                               output_token_ids=seq.output_ids + list(spec[:j]), generator=row.generator,
                               stop_ids_for_min_tokens=row.stop_ids_for_min_tokens, bad_words_ids=row.bad_words_ids))
    return out
