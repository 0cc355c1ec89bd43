"""Rotary position embedding (NeoX / HF ``rotate_half`` layout) with the HF
``rope_scaling`` variants: default, linear, dynamic (NTK), llama3, yarn and longrope
(Phi-3's LongRoPE / SuRoPE).

cos/sin are precomputed once for every position into a ``[max_positions, head_dim]``
table (cos half | sin half), kept by the model as a ``rotation_table``; a step expands
its rows once (``rotary_factors``) and all layers share them.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def _base_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor = s["factor"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(dim: int, base: float, s: dict, max_position: int) -> tuple[torch.Tensor, float]:
    factor = s.get("factor") or max_position / s["original_max_position_embeddings"]
    orig = s.get("original_max_position_embeddings", max_position)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of the unscaled (extrapolated) frequency per dimension
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _longrope_table(dim: int, base: float, s: dict, max_position: int) -> torch.Tensor:
    """LongRoPE: per-frequency rescaling by ``short_factor`` within the pretraining
    context and ``long_factor`` beyond it, both scaled by the attention factor.

    transformers picks one factor list for the whole sequence (long once it passes
    ``original_max_position_embeddings``, re-rotating the earlier positions too) and
    vLLM one for the whole step (long when any of its positions is past it); we pick
    per position, so a token's rotation never depends on its neighbours or on what else
    is batched, and cached K/V stay valid as a sequence grows.  Equal to both for every
    sequence within the pretraining context."""
    orig = int(s["original_max_position_embeddings"])
    factor = s.get("factor") or max_position / orig
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    pos = torch.arange(max_position, dtype=torch.float32)[:, None]
    short = pos * (1.0 / (torch.tensor(s["short_factor"], dtype=torch.float32) * base ** exponents))[None, :]
    long = pos * (1.0 / (torch.tensor(s["long_factor"], dtype=torch.float32) * base ** exponents))[None, :]
    freqs = torch.where(pos < orig, short, long)
    return torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1)


def rope_table_len(max_position: int, scaling: Optional[dict]) -> int:
    """Positions the table must cover: dynamic NTK extends the context by ``factor``."""
    if scaling and scaling["rope_type"] == "dynamic":
        return int(max_position * scaling["factor"])
    return max_position


def build_cos_sin_table(head_dim: int, base: float, max_position: int, scaling: Optional[dict]) -> torch.Tensor:
    """float32 ``[rope_table_len, head_dim]``: cos over the first half, sin over the second.

    Values match transformers' ``ROPE_INIT_FUNCTIONS`` except for ``dynamic``, where
    HF re-derives the base from the longest sequence of the current batch (so a
    token's embedding depends on its neighbours); like vLLM we fix the base for
    the whole extended range, which keeps KV reusable across steps.
    """
    rope_type = scaling["rope_type"] if scaling else "default"
    attention_factor = 1.0
    if rope_type == "default":
        inv_freq = _base_inv_freq(head_dim, base)
    elif rope_type == "linear":
        inv_freq = _base_inv_freq(head_dim, base) / scaling["factor"]
    elif rope_type == "dynamic":
        factor = scaling["factor"]
        dyn_base = base * (factor * factor - (factor - 1)) ** (head_dim / (head_dim - 2))
        inv_freq = _base_inv_freq(head_dim, dyn_base)
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(_base_inv_freq(head_dim, base), scaling)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(head_dim, base, scaling, max_position)
    elif rope_type == "longrope":
        return _longrope_table(head_dim, base, scaling, max_position)
    else:
        raise ValueError(f"Unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    n = rope_table_len(max_position, scaling)
    freqs = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1)


def rotation_table(cos_sin: torch.Tensor) -> torch.Tensor:
    """``[N, 2 * head_dim]`` rows ``cos | cos | -sin | sin`` of a ``build_cos_sin_table``
    table: rotating becomes ``x * cos + swap_halves(x) * signed_sin``, bit-identical
    to ``(x1 cos - x2 sin, x2 cos + x1 sin)`` (negation and ``a + -b`` are exact)."""
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[:, :half], cos_sin[:, half:]
    return torch.cat((cos, cos, -sin, sin), dim=-1)


_EXPAND_LIMIT = 1 << 18  # elements (1 MiB of fp32) per factor: stays cache-resident


def rotary_factors(table: torch.Tensor, positions: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step ``(cos, signed_sin)``, each ``[T, heads, head_dim]`` and contiguous.

    Built once per step and shared by every layer: same-shape element-wise ops run
    ~2x faster than broadcasting ``[T, 1, D]`` rows over the strided q/k view."""
    rows = table.index_select(0, positions)
    t, d = rows.shape[0], rows.shape[1] // 2
    if t * heads * d > _EXPAND_LIMIT:
        # Prefill-sized steps: expanded factors would outgrow the caches and every layer
        # would stream them from memory; broadcasting the [T, 1, D] rows is cheaper there.
        return rows[:, None, :d], rows[:, None, d:]
    return (rows[:, None, :d].expand(t, heads, d).contiguous(),
            rows[:, None, d:].expand(t, heads, d).contiguous())


def apply_rotary(x: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` by ``rotary_factors`` for the same tokens and heads."""
    cos, signed_sin = factors
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return (x * cos).add_(swapped.mul_(signed_sin))
