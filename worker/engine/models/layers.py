"""Small building blocks of the Llama-family decoder."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """Uninitialised frozen weight: the loader fills it, so no time is spent on init."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = empty_param(size, dtype=dtype, device=device)
        self.eps = eps
        # Fused kernels of the attention backend (LlamaForCausalLM.use_attention_backend:
        # compiled CPU or Triton): add + norm in one pass.
        self.ops: Optional[Any] = None

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Plain norm, or (with ``residual``) the pre-norm block's ``x + residual``
        followed by the norm; returns ``(normed, new_residual)`` in that case."""
        if self.ops is not None and x.dim() == 2 and x.is_contiguous() and (
                residual is None or residual.is_contiguous()):
            out = self.ops.rms_norm(x, self.weight, self.eps, residual)  # residual += x in place
            return out if residual is None else (out, residual)
        if residual is None:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x = residual.add_(x)  # in place: the old residual is dead (a + b == b + a exactly)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps), x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on the fused ``[gate | up]`` projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # in place on silu's fresh output: one allocation less
