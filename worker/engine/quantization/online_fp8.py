"""Online FP8 (``--quantization fp8`` on an unquantized checkpoint, as vLLM): every
decoder projection's weight is quantized to FP8 e4m3 with one scale per output channel
when the model is packed (after loading, and again after every RL weight update: the
update unpacks, writes the trainer's weights, packs, so they are re-quantized before the
next step), and activations are quantized per token, dynamically, at each call (W8A8,
llm-compressor's FP8_DYNAMIC scheme).  The LM head, embeddings and norms stay in the
model dtype, as in vLLM.

It is a packing scheme (models/cpu_gemm.PackedLinears), so the model runs it through the
seam every CPU GEMM uses:
* CUDA: weights kept in FP8 (half of bf16's memory) in an ``Fp8Weight``, the Triton W8A8
  GEMM (kernels/triton/quant_gemm.fp8_linear) per call.
* CPU (no FP8 GEMM here): the same arithmetic emulated -- the weight rounded to its FP8
  values times its scale and packed for the CPU GEMM the engine picked, the activations
  rounded to their per-token FP8 values -- so rollouts sample from what an FP8 model
  computes, at bf16's speed and memory.

Mixture-of-experts layers: the expert stacks are quantized the same way (one scale per
expert and output row; cpu_gemm.PackedExperts) and run W8A8 -- the fused-MoE Triton
kernel over FP8 stacks on CUDA (kernels/triton/fused_moe.fused_experts_fp8), the grouped
torch GEMMs over rounded weights and rounded input rows on CPU; shared experts are
quantized like any projection; the router stays in the model dtype, as in vLLM.  Experts
with biases (GPT-OSS) have no FP8 path: refused at load.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from worker.engine.models.cpu_gemm import DENSE, PackedExperts, PackedLinears

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> (FP8 ``[N, K]``, fp32 scale ``[N]``): amax of each row maps to 448."""
    scale = (w.detach().float().abs().amax(-1) / FP8_MAX).clamp_min(1e-12)
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def round_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` replaced by its per-row FP8 values times their scale, in x's dtype (what a
    W8A8 GEMM multiplies, emulated)."""
    q, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    return (q.float() * scale[:, None]).to(x.dtype).reshape(x.shape)


@dataclass
class Fp8Weight:
    """A projection weight kept in FP8 with its per-channel scale (the CUDA path)."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype  # the model dtype it came from (unpack returns to it)
    # A checkpoint's static activation scale (one for the whole input; None: per token, dynamically)
    input_scale: Optional[torch.Tensor] = None

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def quantize_stack(w: torch.Tensor) -> Fp8Weight:
    """An expert stack ``[E, N, K]`` in FP8 with one scale per expert and output row ``[E, N]``."""
    q, scale = quantize_rows(w.reshape(-1, w.shape[-1]))
    return Fp8Weight(q.reshape(w.shape), scale.reshape(w.shape[:-1]), w.dtype)


def _dequantize(w: Fp8Weight) -> torch.Tensor:
    return (w.q.float() * w.scale[..., None]).to(w.dtype)


def triton_fp8_experts() -> PackedExperts:
    """FP8 expert stacks on the fused-MoE Triton kernel (W8A8, per-row input scales)."""
    from worker.engine.kernels.triton.fused_moe import fused_experts_fp8

    def run(x, w13: Fp8Weight, w2: Fp8Weight, topk_weights, topk_ids, act):
        return fused_experts_fp8(x, w13.q, w13.scale, w2.q, w2.scale, topk_weights, topk_ids, act)

    return PackedExperts(quantize_stack, run, _dequantize)


def emulated_fp8_experts(inner: Optional[PackedLinears] = None) -> PackedExperts:
    """The same W8A8 arithmetic on CPU: weights rounded to their FP8 values, each GEMM's
    input rows rounded per row -- over ``inner``'s per-expert packed GEMMs where it packs
    experts (the native bf16 GEMM: torch's bf16 grouped GEMM is several times slower on
    CPUs without bf16 dot products, cpu_gemm's measurements), else the grouped torch GEMMs."""
    from worker.engine.models.moe import fused_experts_packed, fused_experts_torch

    if inner is not None and inner.packs_experts:
        def linear(x, packed, bias):
            return inner.linear(round_rows(x), packed, bias)

        def run_packed(x, w13, w2, topk_weights, topk_ids, act):
            return fused_experts_packed(x, w13, w2, topk_weights, topk_ids, linear, act)

        return PackedExperts(lambda w: [inner.pack(round_rows(w[e])) for e in range(w.shape[0])], run_packed,
                             lambda ws: torch.stack([inner.unpack(w) for w in ws]))

    def run(x, w13, w2, topk_weights, topk_ids, act):
        return fused_experts_torch(x, w13, w2, topk_weights, topk_ids, act, round_input=round_rows)

    return PackedExperts(lambda w: round_rows(w.reshape(-1, w.shape[-1])).reshape(w.shape), run, lambda w: w)


def triton_fp8_scheme() -> PackedLinears:
    """Weights in FP8, the Triton W8A8 GEMM (CUDA; CPU tensors under TRITON_INTERPRET=1)."""
    from worker.engine.kernels.triton.quant_gemm import fp8_linear

    def pack(w: torch.Tensor) -> Fp8Weight:
        q, scale = quantize_rows(w)
        return Fp8Weight(q, scale, w.dtype)

    def linear(x: torch.Tensor, w: Fp8Weight, bias: Optional[torch.Tensor]) -> torch.Tensor:
        shape = x.shape
        out = fp8_linear(x.reshape(-1, shape[-1]).contiguous(), w.q, w.scale, bias=bias)
        return out.reshape(*shape[:-1], w.q.shape[0])

    return PackedLinears("fp8 (Triton W8A8)", pack, linear, _dequantize, head=DENSE, packs_experts=True,
                         experts=triton_fp8_experts())


def emulated_fp8_scheme(inner: Optional[PackedLinears]) -> PackedLinears:
    """W8A8 FP8 numerics over a CPU GEMM: weights rounded to their FP8 values before
    ``inner`` packs them (F.linear when None), activations rounded per token per call."""
    inner_pack = inner.pack if inner is not None else (lambda w: w)
    inner_linear = inner.linear if inner is not None else F.linear
    inner_unpack = inner.unpack if inner is not None else (lambda w: w)

    def pack(w: torch.Tensor) -> torch.Tensor:
        return inner_pack(round_rows(w))

    def linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return inner_linear(round_rows(x), packed, bias)

    name = f"fp8 (W8A8 emulated over {inner.name if inner is not None else 'torch'} linears)"
    accepts = inner.accepts if inner is not None else (lambda w: True)
    return PackedLinears(name, pack, linear, inner_unpack, packs_experts=True, accepts=accepts,
                         head=inner if inner is not None else DENSE, experts=emulated_fp8_experts(inner))


def online_fp8_scheme(device: torch.device, cpu_scheme: Optional[PackedLinears]) -> PackedLinears:
    return triton_fp8_scheme() if device.type == "cuda" else emulated_fp8_scheme(cpu_scheme)
