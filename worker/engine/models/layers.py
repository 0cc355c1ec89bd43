"""Small building blocks of the Llama-family decoder."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """Uninitialised frozen weight: the loader fills it, so no time is spent on init."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


# Where projection weights and expert stacks are allocated while a model is built, when
# not on its device: a quantized checkpoint kept quantized on a GPU stages their dense
# values in host memory, and each is quantized onto the GPU once loaded
# (quantization/kept.py), so the GPU never holds the dense model.
_STAGING: contextvars.ContextVar[Optional[torch.device]] = contextvars.ContextVar("projection_staging", default=None)


@contextlib.contextmanager
def staged_projections(device: torch.device | str) -> Iterator[None]:
    """Models built inside allocate their projection weights (``projection_param``) on
    ``device`` instead of their own."""
    token = _STAGING.set(torch.device(device))
    try:
        yield
    finally:
        _STAGING.reset(token)


def projection_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """A projection weight (``[out, in]``) or expert stack (``[E, out, in]``): the packing
    schemes' inputs, allocated on the staging device where one is set (``staged_projections``)."""
    return empty_param(*shape, dtype=dtype, device=_STAGING.get() or device)


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
