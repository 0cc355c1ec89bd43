"""M-RoPE (multimodal rotary position embedding) of Qwen2-VL / Qwen2.5-VL language models.

* :func:`mrope_positions` — the 3-row (temporal, height, width) position ids of a
  prompt with images, and the decode delta (a token at sequence index ``i >= len(prompt)``
  has position ``i + delta`` on all three rows).  Matches HF ``get_rope_index``.
* :func:`mrope_cos_sin` / :func:`apply_mrope` — the rotation: the rotary frequency
  pairs are split by ``rope_scaling["mrope_section"]`` (summing to ``head_dim // 2``);
  section ``k`` rotates with position row ``k % 3``.  Matches HF's Qwen2-VL
  rotary embedding + ``apply_rotary_pos_emb`` (the older ``apply_multimodal_rotary_pos_emb``).

Text-only prompts get ``positions[r] == arange(len)`` and ``delta == 0``, so M-RoPE
reduces to plain RoPE there.  Videos are not supported yet.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def mrope_positions(input_ids: Sequence[int], image_grid_thw: Sequence[Sequence[int]] | None, *,
                    image_token_id: int, vision_start_token_id: Optional[int] = None,
                    spatial_merge_size: int = 2, video_grid_thw=None,
                    video_token_id: Optional[int] = None) -> tuple[torch.Tensor, int]:
    """``(positions LongTensor[3, len(input_ids)], delta)`` for one sequence.

    Each image is a run of ``t*h*w // spatial_merge_size**2`` consecutive
    ``image_token_id`` placeholders (``image_grid_thw`` in placeholder order, in patch
    units as the processor gives them); runs of several images back to back are split
    by those counts.  An image starting at text position ``p`` gets
    ``(p + ti, p + hi, p + wi)`` over its merged grid; the text after it resumes at
    ``p + max(t, h, w merged)``.  ``delta = max(positions) + 1 - len(input_ids)``.

    ``vision_start_token_id``, when given, is checked to precede every image run.
    """
    if video_grid_thw is not None and len(video_grid_thw) > 0:
        raise NotImplementedError("M-RoPE positions for video input are not implemented")
    if video_token_id is not None and video_token_id in input_ids:
        raise NotImplementedError("M-RoPE positions for video input are not implemented")
    ids = list(input_ids)
    grids = [tuple(int(v) for v in g) for g in (image_grid_thw if image_grid_thw is not None else [])]
    m = spatial_merge_size
    rows: list[torch.Tensor] = []
    cur = 0          # next text position
    i = 0
    gi = 0
    text_start = 0
    n = len(ids)
    while i < n:
        if ids[i] != image_token_id:
            i += 1
            continue
        # flush the text before this image
        if i > text_start:
            rows.append(torch.arange(cur, cur + i - text_start).expand(3, -1))
            cur += i - text_start
        if gi >= len(grids):
            raise ValueError(f"more image placeholder runs than image_grid_thw entries ({len(grids)})")
        t, h, w = grids[gi]
        if h % m or w % m:
            raise ValueError(f"image_grid_thw {grids[gi]}: h and w must be multiples of {m}")
        lt, lh, lw = t, h // m, w // m
        count = lt * lh * lw
        if i + count > n or any(tok != image_token_id for tok in ids[i:i + count]):
            raise ValueError(f"image {gi} {grids[gi]} needs {count} consecutive image tokens at index {i}")
        if vision_start_token_id is not None and (i == 0 or ids[i - 1] not in (vision_start_token_id,
                                                                              image_token_id)):
            raise ValueError(f"image {gi} at index {i} is not preceded by the vision start token")
        tt = torch.arange(lt).view(-1, 1, 1).expand(lt, lh, lw).reshape(-1)
        hh = torch.arange(lh).view(1, -1, 1).expand(lt, lh, lw).reshape(-1)
        ww = torch.arange(lw).view(1, 1, -1).expand(lt, lh, lw).reshape(-1)
        rows.append(torch.stack((tt, hh, ww)) + cur)
        cur += max(lt, lh, lw)
        i += count
        text_start = i
        gi += 1
    if gi != len(grids):
        raise ValueError(f"{len(grids)} image_grid_thw entries but {gi} images in input_ids")
    if n > text_start:
        rows.append(torch.arange(cur, cur + n - text_start).expand(3, -1))
        cur += n - text_start
    if not rows:
        return torch.zeros(3, 0, dtype=torch.long), 0
    positions = torch.cat(rows, dim=1).to(torch.long).contiguous()
    delta = int(positions.max()) + 1 - n
    return positions, delta


def decode_positions(start: int, count: int, delta: int) -> torch.Tensor:
    """``[3, count]`` positions of tokens at sequence indices ``start .. start+count-1``
    after the prompt (all three rows equal ``index + delta``)."""
    return (torch.arange(start, start + count, dtype=torch.long) + delta).expand(3, -1).contiguous()


def rope_inv_freq(head_dim: int, rope_theta: float) -> torch.Tensor:
    return 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def _check_section(mrope_section: Sequence[int], half: int) -> list[int]:
    sec = [int(s) for s in mrope_section]
    if sum(sec) != half:
        raise ValueError(f"mrope_section {sec} must sum to head_dim // 2 = {half}")
    return sec


def mrope_cos_sin(positions: torch.Tensor, mrope_section: Sequence[int], *,
                  inv_freq: Optional[torch.Tensor] = None, head_dim: Optional[int] = None,
                  rope_theta: float = 1000000.0, cos_sin_table: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 ``[T, head_dim]`` rows ``cos | sin`` (each ``head_dim // 2`` wide, the
    layout of ``rotary.build_cos_sin_table``) for ``positions [3, T]`` (a ``[T]``
    tensor is taken as text positions on all three rows).

    Frequencies come from ``cos_sin_table`` (an engine table indexed by position,
    which carries any rope scaling), else ``inv_freq``, else ``head_dim`` + ``rope_theta``.
    """
    if positions.dim() == 1:
        positions = positions.expand(3, -1)
    if cos_sin_table is not None:
        half = cos_sin_table.shape[-1] // 2
        sec = _check_section(mrope_section, half)
        rows = [cos_sin_table.index_select(0, positions[r].to(cos_sin_table.device).long()) for r in range(3)]
        cos_parts, sin_parts = [], []
        off = 0
        for k, s in enumerate(sec):
            r = rows[k % 3]
            cos_parts.append(r[:, off:off + s])
            sin_parts.append(r[:, half + off:half + off + s])
            off += s
        return torch.cat(cos_parts + sin_parts, dim=-1).float()
    if inv_freq is None:
        if head_dim is None:
            raise ValueError("mrope_cos_sin needs cos_sin_table, inv_freq or head_dim")
        inv_freq = rope_inv_freq(head_dim, rope_theta)
    inv_freq = inv_freq.float().to(positions.device)
    half = inv_freq.shape[0]
    sec = _check_section(mrope_section, half)
    freqs = positions.float()[..., None] * inv_freq                    # [3, T, half]
    parts = [chunk[k % 3] for k, chunk in enumerate(freqs.split(sec, dim=-1))]
    f = torch.cat(parts, dim=-1)                                        # [T, half]
    return torch.cat((f.cos(), f.sin()), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def apply_mrope(q: torch.Tensor, k: torch.Tensor, positions_or_cos_sin: torch.Tensor,
                mrope_section: Optional[Sequence[int]] = None, *, rope_theta: float = 1000000.0,
                inv_freq: Optional[torch.Tensor] = None,
                cos_sin_table: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hk, D]`` (neox half-split layout).

    ``positions_or_cos_sin``: either LongTensor positions ``[3, T]`` (then
    ``mrope_section`` is required; frequencies as in :func:`mrope_cos_sin`) or a
    float ``[T, D]`` ``cos | sin`` table from :func:`mrope_cos_sin`.  Computed in the
    dtype of ``q`` (as HF, which casts cos/sin to the activation dtype).
    """
    x = positions_or_cos_sin
    if not torch.is_floating_point(x):
        if mrope_section is None:
            raise ValueError("apply_mrope with positions needs mrope_section")
        x = mrope_cos_sin(x, mrope_section, inv_freq=inv_freq, head_dim=q.shape[-1], rope_theta=rope_theta,
                          cos_sin_table=cos_sin_table)
    half = x.shape[-1] // 2
    if half * 2 != q.shape[-1]:
        raise ValueError(f"cos/sin width {x.shape[-1]} does not match head_dim {q.shape[-1]}")
    c = x[:, :half].to(q.dtype)
    s = x[:, half:].to(q.dtype)
    cos = torch.cat((c, c), dim=-1)[:, None, :]
    sin = torch.cat((s, s), dim=-1)[:, None, :]
    return _rotate(q, cos, sin), _rotate(k, cos.to(k.dtype), sin.to(k.dtype))


__all__ = ["mrope_positions", "decode_positions", "mrope_cos_sin", "apply_mrope", "rope_inv_freq"]
