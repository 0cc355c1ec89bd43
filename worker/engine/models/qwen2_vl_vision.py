"""Vision towers of Qwen2-VL and Qwen2.5-VL in plain torch.

``build_vision_tower(vision_config)`` takes the ``vision_config`` section of a
checkpoint's config.json and returns a :class:`QwenVisionTower`:

* Qwen2-VL: LayerNorm blocks, full attention per image (frame), quick_gelu MLP,
  LayerNorm patch merger.
* Qwen2.5-VL: RMSNorm blocks, window attention except in ``fullatt_block_indexes``
  (tokens are permuted into window order once, merge unit by merge unit, and the
  merged output is permuted back), SwiGLU MLP, RMSNorm patch merger.

``forward(pixel_values [N, C*T*P*P], grid_thw [num_images, 3])`` returns the merged
tokens ``[sum(t*h*w) // merge**2, out_hidden]`` in the order the LM's image
placeholders expect (image after image, row-major over merged cells).

Checkpoint tensors (``visual.*``, or ``model.visual.*`` in newer transformers
layouts) load through :meth:`QwenVisionTower.load_hf_weights` /
:func:`hf_to_local_name`; the patch embedding's Conv3d becomes a linear over the
flattened patch (kernel == stride, so the two are the same map).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

QWEN2_VL = "qwen2_vl"
QWEN2_5_VL = "qwen2_5_vl"

_HF_PREFIXES = ("model.visual.", "visual.", "vision_tower.", "model.vision_tower.")


# ---------------------------------------------------------------------------- config

@dataclass
class VisionTowerConfig:
    variant: str                      # QWEN2_VL | QWEN2_5_VL
    depth: int
    embed_dim: int                    # ViT width
    num_heads: int
    mlp_hidden: int                   # MLP intermediate width
    hidden_act: str
    out_hidden_size: int              # LM hidden size (merger output)
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    rope_theta: float = 10000.0
    window_size: int = 112            # 2.5 only (pixels)
    fullatt_block_indexes: list = field(default_factory=list)  # 2.5 only
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @classmethod
    def from_hf(cls, vc: dict, variant: Optional[str] = None) -> "VisionTowerConfig":
        """From the HF ``vision_config`` dict. ``variant`` is guessed when not given:
        Qwen2.5-VL configs carry ``out_hidden_size`` / ``fullatt_block_indexes`` /
        ``window_size``; Qwen2-VL configs carry ``embed_dim``."""
        if variant is None:
            mt = str(vc.get("model_type", ""))
            if mt.startswith("qwen2_5_vl") or any(k in vc for k in ("out_hidden_size", "fullatt_block_indexes",
                                                                     "window_size")):
                variant = QWEN2_5_VL
            else:
                variant = QWEN2_VL
        if variant not in (QWEN2_VL, QWEN2_5_VL):
            raise ValueError(f"unknown vision tower variant {variant!r}")
        rope = vc.get("rope_parameters") or vc.get("rope_scaling") or {}
        theta = float(rope.get("rope_theta", vc.get("rope_theta", 10000.0)))
        common = dict(
            variant=variant,
            depth=int(vc.get("depth", vc.get("num_hidden_layers", 32))),
            num_heads=int(vc.get("num_heads", vc.get("num_attention_heads", 16))),
            in_channels=int(vc.get("in_channels", vc.get("in_chans", 3))),
            patch_size=int(vc.get("patch_size", vc.get("spatial_patch_size", 14))),
            temporal_patch_size=int(vc.get("temporal_patch_size", 2)),
            spatial_merge_size=int(vc.get("spatial_merge_size", 2)),
            rope_theta=theta,
        )
        if variant == QWEN2_VL:
            embed_dim = int(vc.get("embed_dim", 1280))
            return cls(embed_dim=embed_dim,
                       mlp_hidden=int(embed_dim * vc.get("mlp_ratio", 4)),
                       hidden_act=vc.get("hidden_act", "quick_gelu"),
                       out_hidden_size=int(vc.get("hidden_size", 3584)),
                       **common)
        return cls(embed_dim=int(vc.get("hidden_size", 1280)),
                   mlp_hidden=int(vc.get("intermediate_size", 3420)),
                   hidden_act=vc.get("hidden_act", "silu"),
                   out_hidden_size=int(vc.get("out_hidden_size", 3584)),
                   window_size=int(vc.get("window_size", 112)),
                   fullatt_block_indexes=[int(i) for i in vc.get("fullatt_block_indexes", (7, 15, 23, 31))],
                   **common)


# ---------------------------------------------------------------------------- pieces

def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTS = {
    "quick_gelu": _quick_gelu,
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}


def _act(name: str):
    try:
        return _ACTS[name]
    except KeyError:
        raise ValueError(f"unsupported vision hidden_act {name!r}; supported: {', '.join(_ACTS)}") from None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dt)


def _norm(cfg: VisionTowerConfig, dim: int) -> nn.Module:
    if cfg.variant == QWEN2_VL:
        return nn.LayerNorm(dim, eps=cfg.norm_eps)
    return RMSNorm(dim, eps=cfg.norm_eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
    """Attention within each segment ``[cu_seqlens[i], cu_seqlens[i+1])`` of ``[H, S, D]``
    tensors, without a kernel for it: segments of one length go through SDPA as one
    batch (Qwen2.5-VL's windows are mostly one size: a handful of calls per layer
    instead of one per window)."""
    out = torch.empty_like(q)
    by_len: dict[int, list[int]] = {}
    for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if b > a:
            by_len.setdefault(b - a, []).append(a)
    for length, starts in by_len.items():
        if len(starts) == 1:
            a = starts[0]
            out[:, a:a + length] = F.scaled_dot_product_attention(q[None, :, a:a + length], k[None, :, a:a + length],
                                                                  v[None, :, a:a + length])[0]
            continue
        idx = (torch.tensor(starts, device=q.device)[:, None] + torch.arange(length, device=q.device)).reshape(-1)
        n = len(starts)
        qs, ks, vs = (t[:, idx].view(t.shape[0], n, length, t.shape[2]).transpose(0, 1) for t in (q, k, v))
        out[:, idx] = F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1).reshape(q.shape[0], n * length, -1)
    return out


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionTowerConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.embed_dim, 3 * cfg.embed_dim, bias=True)
        self.proj = nn.Linear(cfg.embed_dim, cfg.embed_dim, bias=True)
        # The attention backend's variable-length kernel (Triton on CUDA): every image /
        # window in one launch; None: SDPA per segment.
        self.varlen_attention = None

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor,
                cu_tensor: Optional[torch.Tensor] = None) -> torch.Tensor:
        s = x.shape[0]
        q, k, v = self.qkv(x).view(s, 3, self.num_heads, self.head_dim).unbind(1)   # each [S, H, D]
        # rotary in fp32 (as the reference), back to the activation dtype
        c, sn = cos[:, None, :], sin[:, None, :]
        qf, kf = q.float(), k.float()
        q = (qf * c + _rotate_half(qf) * sn).to(x.dtype)
        k = (kf * c + _rotate_half(kf) * sn).to(x.dtype)
        if self.varlen_attention is not None and cu_tensor is not None:
            out = self.varlen_attention(q, k, v, cu_tensor, self.head_dim ** -0.5)
            return self.proj(out.reshape(s, -1))
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))                            # [H, S, D]
        return self.proj(_segment_attention(q, k, v, cu_seqlens).transpose(0, 1).reshape(s, -1))


class VisionMLP(nn.Module):
    """quick_gelu fc1/fc2 MLP (Qwen2-VL)."""

    def __init__(self, cfg: VisionTowerConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.embed_dim, cfg.mlp_hidden)
        self.fc2 = nn.Linear(cfg.mlp_hidden, cfg.embed_dim)
        self.act = _act(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionGatedMLP(nn.Module):
    """SwiGLU MLP with biases (Qwen2.5-VL)."""

    def __init__(self, cfg: VisionTowerConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.embed_dim, cfg.mlp_hidden)
        self.up_proj = nn.Linear(cfg.embed_dim, cfg.mlp_hidden)
        self.down_proj = nn.Linear(cfg.mlp_hidden, cfg.embed_dim)
        self.act = _act(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionTowerConfig):
        super().__init__()
        self.norm1 = _norm(cfg, cfg.embed_dim)
        self.norm2 = _norm(cfg, cfg.embed_dim)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg) if cfg.variant == QWEN2_VL else VisionGatedMLP(cfg)

    def forward(self, x, cu_seqlens, cos, sin, cu_tensor=None):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin, cu_tensor)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Norm, then each 2x2 (merge**2) group of consecutive tokens concatenated -> MLP."""

    def __init__(self, cfg: VisionTowerConfig):
        super().__init__()
        self.unit_dim = cfg.embed_dim * cfg.spatial_merge_size ** 2
        self.ln_q = _norm(cfg, cfg.embed_dim)
        self.fc1 = nn.Linear(self.unit_dim, self.unit_dim)
        self.fc2 = nn.Linear(self.unit_dim, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.ln_q(x).reshape(-1, self.unit_dim))))


# ---------------------------------------------------------------------------- index helpers

def _check_grid(grid_thw: torch.Tensor | Iterable, merge: int) -> list[tuple[int, int, int]]:
    grids = [tuple(int(v) for v in g) for g in (grid_thw.tolist() if isinstance(grid_thw, torch.Tensor)
                                                 else grid_thw)]
    for t, h, w in grids:
        if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
            raise ValueError(f"grid_thw {(t, h, w)}: h and w must be positive multiples of {merge}")
    return grids


def vision_rotary_positions(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """``[S, 2]`` (row, col) patch coordinates in the tower's token order: per frame,
    merge block after merge block (row-major over blocks), row-major inside a block."""
    out = []
    for t, h, w in grids:
        hh = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
        ww = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
        hh = hh.permute(0, 2, 1, 3).reshape(-1)
        ww = ww.permute(0, 2, 1, 3).reshape(-1)
        out.append(torch.stack((hh, ww), dim=-1).repeat(t, 1))
    return torch.cat(out, dim=0)


def frame_cu_seqlens(grids: list[tuple[int, int, int]]) -> list[int]:
    """Boundaries of the full-attention segments: one per frame (h*w tokens each)."""
    cu = [0]
    for t, h, w in grids:
        for _ in range(t):
            cu.append(cu[-1] + h * w)
    return cu


def window_index(grids: list[tuple[int, int, int]], merge: int, window_size: int,
                 patch_size: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL window partition.

    Returns ``(index, cu_window_seqlens)``: ``index[j]`` is the merge unit (group of
    merge**2 consecutive tokens) placed at position ``j`` of the windowed order —
    per frame, windows of ``window_size // merge // patch_size`` merged cells side,
    in row-major window order, row-major inside a window (edge windows are
    clipped) — and the token boundaries of the windows in that order (empty
    windows never appear).
    """
    win = window_size // merge // patch_size
    if win < 1:
        raise ValueError(f"window_size {window_size} is smaller than one merged cell ({merge * patch_size} px)")
    unit = merge * merge
    index: list[torch.Tensor] = []
    cu = [0]
    base = 0
    for t, h, w in grids:
        lh, lw = h // merge, w // merge
        cells = torch.arange(t * lh * lw).view(t, lh, lw)
        for f in range(t):
            for r0 in range(0, lh, win):
                for c0 in range(0, lw, win):
                    blk = cells[f, r0:r0 + win, c0:c0 + win].reshape(-1)
                    index.append(blk + base)
                    cu.append(cu[-1] + blk.numel() * unit)
        base += t * lh * lw
    return torch.cat(index), cu


# ---------------------------------------------------------------------------- the tower

class QwenVisionTower(nn.Module):
    """Qwen2-VL / Qwen2.5-VL vision encoder + patch merger."""

    def __init__(self, cfg: VisionTowerConfig):
        super().__init__()
        self.cfg = cfg
        # Conv3d(kernel == stride == (T, P, P), no bias) over one patch == a linear over
        # the flattened (C, T, P, P) patch.
        self.patch_embed = nn.Linear(cfg.patch_dim, cfg.embed_dim, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)
        rot_dim = cfg.head_dim // 2   # half of the head rotates with the row, half with the column
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def use_varlen_attention(self, fn) -> None:
        """Attention of every block through ``fn`` (``varlen_attention``'s signature), or SDPA
        per image / window when None."""
        for blk in self.blocks:
            blk.attn.varlen_attention = fn

    @classmethod
    def from_hf_config(cls, vision_config: dict, variant: Optional[str] = None) -> "QwenVisionTower":
        return cls(VisionTowerConfig.from_hf(vision_config, variant))

    # -- weights

    def load_hf_weights(self, state_dict_items: Iterable[tuple[str, torch.Tensor]], *, strict: bool = True) -> list[str]:
        """Copy HF tensors (``visual.*`` / ``model.visual.*`` names; others are skipped)
        into this module. Returns the skipped names. ``strict``: every parameter of
        this module must be provided."""
        own = self.state_dict()
        seen: set[str] = set()
        skipped: list[str] = []
        for name, tensor in state_dict_items:
            local = hf_to_local_name(name)
            if local is None or local not in own:
                skipped.append(name)
                continue
            dst = own[local]
            src = tensor.reshape(dst.shape) if local == "patch_embed.weight" else tensor
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not fit {local} {tuple(dst.shape)}")
            with torch.no_grad():
                dst.copy_(src)
            seen.add(local)
        if strict:
            missing = sorted(set(own) - seen)
            if missing:
                raise ValueError(f"vision tower weights missing from the checkpoint: {missing[:8]}"
                                 f"{' ...' if len(missing) > 8 else ''}")
        return skipped

    # -- forward

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        merge = cfg.spatial_merge_size
        unit = merge * merge
        grids = _check_grid(grid_thw, merge)
        n = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape[0] != n or pixel_values.reshape(n, -1).shape[1] != cfg.patch_dim:
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} does not match grid_thw "
                             f"({n} patches of {cfg.patch_dim} values)")
        dtype = self.patch_embed.weight.dtype
        device = self.patch_embed.weight.device
        x = self.patch_embed(pixel_values.reshape(n, -1).to(device=device, dtype=dtype))

        pos = vision_rotary_positions(grids, merge).to(device)
        freqs = pos[..., None].float() * self.inv_freq[None, None, :]            # [S, 2, rot_dim/2]
        freqs = freqs.reshape(n, -1)
        emb = torch.cat((freqs, freqs), dim=-1)                                   # [S, head_dim]
        cos, sin = emb.cos(), emb.sin()

        full_cu = frame_cu_seqlens(grids)
        windowed = cfg.variant == QWEN2_5_VL
        if windowed:
            widx, win_cu = window_index(grids, merge, cfg.window_size, cfg.patch_size)
            widx = widx.to(device)

            def permute(t: torch.Tensor) -> torch.Tensor:
                return t.reshape(n // unit, unit, -1)[widx].reshape(n, -1)

            x, cos, sin = permute(x), permute(cos), permute(sin)
            full = set(cfg.fullatt_block_indexes)
        tensors = {}
        if self.blocks[0].attn.varlen_attention is not None:  # boundaries on the device, once per call
            tensors = {id(cu): torch.tensor(cu, dtype=torch.int32, device=device)
                       for cu in ((full_cu, win_cu) if windowed else (full_cu,))}
        for i, blk in enumerate(self.blocks):
            cu = full_cu if (not windowed or i in full) else win_cu
            x = blk(x, cu, cos, sin, tensors.get(id(cu)))
        out = self.merger(x)
        if windowed:
            out = out[torch.argsort(widx)]
        return out


def hf_to_local_name(name: str) -> Optional[str]:
    """Map an HF checkpoint tensor name to this module's ``state_dict`` name, or
    ``None`` when the tensor is not part of the vision tower."""
    for p in _HF_PREFIXES:
        if name.startswith(p):
            name = name[len(p):]
            break
    else:
        return None
    if name == "patch_embed.proj.weight":
        return "patch_embed.weight"
    if name.startswith("merger.mlp.0."):
        return "merger.fc1." + name[len("merger.mlp.0."):]
    if name.startswith("merger.mlp.2."):
        return "merger.fc2." + name[len("merger.mlp.2."):]
    return name


def build_vision_tower(vision_config: dict, variant: Optional[str] = None) -> QwenVisionTower:
    """The tower for an HF ``vision_config`` dict (``variant``: "qwen2_vl" |
    "qwen2_5_vl"; guessed from the keys when omitted — pass it from the top-level
    ``architectures`` / ``model_type`` when in doubt)."""
    return QwenVisionTower.from_hf_config(vision_config, variant)


__all__ = ["QWEN2_VL", "QWEN2_5_VL", "VisionTowerConfig", "QwenVisionTower", "build_vision_tower",
           "hf_to_local_name", "window_index", "vision_rotary_positions", "frame_cu_seqlens"]
