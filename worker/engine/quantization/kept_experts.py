"""Kept-quantized MoE expert stacks on CUDA (quantization/kept.py's ``pack_stack``): one
expert weight per expert stacked into the fused-MoE kernel's operands (FP8 per channel or
in blocks, int4 with each expert's scales, zero points and act-order), unpacked back for
weight updates, and run by the kernel (kernels/triton/fused_moe.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.engine.quantization.kept_forms import Fp8BlockWeight, Int4Weight, unpack_kept
from worker.engine.quantization.online_fp8 import Fp8Weight


# --- MoE expert stacks (CUDA: the fused-MoE kernel's FP8 and int4 modes) ----------------------
@dataclass
class Int4Experts:
    """An expert stack kept int4 on CUDA (the fused-MoE kernel's ``Int4Stack``)."""

    stack: object  # kernels.triton.fused_moe.Int4Stack
    dtype: torch.dtype

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self.stack).values() if isinstance(t, torch.Tensor))


def stack_experts(per_expert: list):
    """One expert weight per expert (all of one kind and layout) as a kept stack, None where
    their layouts differ (the stack then stays dense)."""
    first = per_expert[0]
    if any(type(w) is not type(first) for w in per_expert):
        return None
    if isinstance(first, Fp8Weight):
        return Fp8Weight(torch.stack([w.q for w in per_expert]), torch.stack([w.scale for w in per_expert]),
                         first.dtype)
    if isinstance(first, Fp8BlockWeight):
        if any(w.block != first.block or w.scale.shape != first.scale.shape for w in per_expert):
            return None
        return Fp8BlockWeight(torch.stack([w.q for w in per_expert]), torch.stack([w.scale for w in per_expert]),
                              first.block, first.dtype)
    from worker.engine.kernels.triton.fused_moe import Int4Stack

    if any(w.group != first.group for w in per_expert):
        return None
    zeros = None
    if any(w.zero is not None for w in per_expert):  # symmetric experts beside asymmetric ones: zero 8
        zeros = torch.stack([w.zero if w.zero is not None else torch.full_like(w.scale, 8, dtype=torch.uint8)
                             for w in per_expert])
    perm = None
    if any(w.perm is not None for w in per_expert):  # experts in place beside act-order ones: identity
        k = first.shape[1]
        perm = torch.stack([w.perm if w.perm is not None else torch.arange(k, dtype=torch.int32, device=w.scale.device)
                            for w in per_expert])
    stack = Int4Stack(torch.stack([w.qweight for w in per_expert]), torch.stack([w.scale for w in per_expert]),
                      zeros, first.group, perm)
    return Int4Experts(stack, first.dtype)


def unpack_experts(w) -> torch.Tensor:
    """The dense stack ``[E, N, K]`` a kept one holds."""
    if isinstance(w, Int4Experts):
        st = w.stack
        return torch.stack([unpack_kept(Int4Weight(st.qweight[e], st.scale[e], st.zero[e] if st.zero is not None else None,
                                                   st.group, w.dtype, st.perm[e] if st.perm is not None else None))
                            for e in range(st.qweight.shape[0])])
    return unpack_kept(w)  # FP8 stacks unpack as FP8 weights do


def run_experts(x, w13, w2, topk_weights, topk_ids, act):
    """The routed experts over stacks kept FP8 (per channel or in blocks), int4, or dense
    (a stack the checkpoint or this path leaves dense), each on its own: the fused-MoE kernel."""
    from worker.engine.kernels.triton.fused_moe import Fp8Stack, fused_experts

    def operand(w):
        if isinstance(w, Fp8Weight):
            return Fp8Stack(w.q, w.scale)
        if isinstance(w, Fp8BlockWeight):
            return Fp8Stack(w.q, w.scale, w.block)
        return w.stack if isinstance(w, Int4Experts) else w

    if isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor) and not x.is_cuda:
        from worker.engine.models.moe import fused_experts_torch  # CPU tensors (tests): no kernel for dense stacks

        return fused_experts_torch(x, w13, w2, topk_weights, topk_ids, act)
    return fused_experts(x, operand(w13), operand(w2), topk_weights, topk_ids, act)
