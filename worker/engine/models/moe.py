"""The sparse (mixture-of-experts) MLP of Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5 and DeepSeek-V2/V3.

Experts are stacked at load time into ``w13 [E, 2I, H]`` (gate | up) and
``w2 [E, H, I]``; the loader writes each HF per-expert tensor into its slice.  A
step routes every token (softmax over the router logits, top-k, optional
renormalisation, as transformers does), groups the (token, expert) pairs by expert
and runs one grouped GEMM per projection: ``torch._grouped_mm`` over the contiguous
expert groups on CPU, the Triton fused-MoE kernel on CUDA (kernels/triton/fused_moe),
or, with experts packed for a CPU GEMM scheme that packs them (cpu_gemm's native bf16),
that GEMM once per expert group.
Qwen2-MoE adds a shared expert, always on, scaled by ``sigmoid(shared_expert_gate)``;
GLM-4.5 and DeepSeek-V3 route by sigmoid scores within expert groups
(``select_experts_grouped``), DeepSeek-V2 by softmax scores within the best groups
(``select_experts_group_limited``); all three add ungated shared experts. GPT-OSS routes
by a softmax over the top-k raw logits of a biased router, adds a bias per expert to
both projections and uses the clamped SwiGLU; its checkpoints store each layer's experts
as one fused tensor per projection with gate and up interleaved, and ``w13`` / ``w2``
keep exactly that (interleaved rows, the activation reads them so): the checkpoint
tensors are transposed views of them, so loading and RL weight updates by checkpoint
name copy in place, no re-cut.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from worker.engine.models.config import ModelConfig, MoEConfig
from worker.engine.models.layers import empty_param, projection_param, silu_and_mul
from worker.engine.parallel.sharding import expert_shards
from worker.engine.parallel.state import get_tp

_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 ``[T, k]``, expert ids ``[T, k]``): softmax in fp32, then top-k."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def select_experts_topk_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS: the top-k raw logits, then a softmax over those k only (in the logits' dtype,
    as transformers' GptOssTopKRouter)."""
    values, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=values.dtype), ids


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's SwiGLU on its interleaved projection (gate at even, up at odd columns):
    gate clamped above at ``limit``, up to ``[-limit, limit]``,
    ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))


def select_experts_grouped(router_logits: torch.Tensor, bias: torch.Tensor, moe: MoEConfig
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-4.5 / DeepSeek-V3 routing (``noaux_tc``) as transformers computes it: sigmoid
    scores; the correction bias added for the choice only; experts chosen within the
    ``topk_group`` groups whose two best biased scores sum highest; the chosen unbiased
    scores renormalised (``norm_topk_prob``) and times ``routed_scaling_factor``."""
    scores = router_logits.float().sigmoid()
    choice = scores + bias.float()
    t, e = choice.shape
    if moe.n_group > 1:
        group_scores = choice.view(t, moe.n_group, e // moe.n_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        keep = group_mask.unsqueeze(-1).expand(t, moe.n_group, e // moe.n_group).reshape(t, e).bool()
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


def select_experts_group_limited(router_logits: torch.Tensor, moe: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2 routing as transformers computes it: softmax scores (float32); with
    ``group_limited_greedy`` (``n_group`` > 1) only the experts of the ``topk_group``
    groups with the best single score stay candidates; top-k of the scores, times
    ``routed_scaling_factor`` (no renormalisation)."""
    scores = router_logits.float().softmax(dim=-1)
    t, e = scores.shape
    if moe.n_group > 1:
        group_scores = scores.view(t, moe.n_group, e // moe.n_group).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=moe.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        keep = group_mask.unsqueeze(-1).expand(t, moe.n_group, e // moe.n_group).reshape(t, e).bool()
        scores = scores.masked_fill(~keep, 0.0)
    weights, ids = torch.topk(scores, k=moe.top_k, dim=-1, sorted=False)
    return weights * moe.routed_scaling_factor, ids


def _grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` grouped by expert (``counts[e]`` consecutive rows each) times
    ``w[e].T`` per group."""
    if _HAS_GROUPED_MM and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)
    out = x.new_empty((x.shape[0], w.shape[1]))
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            torch.mm(x[start:start + c], w[e].t(), out=out[start:start + c])
            start += c
    return out


def _by_expert(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int):
    """The (token, expert) pairs sorted by expert: (sort order, pairs per expert, each
    pair's token, the pairs' input rows)."""
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    token_of = order // topk_ids.shape[1]
    return order, counts, token_of, x.index_select(0, token_of)


def _weighted_sum(x: torch.Tensor, y: torch.Tensor, topk_weights: torch.Tensor, order: torch.Tensor,
                  token_of: torch.Tensor) -> torch.Tensor:
    """Each pair's output ``y`` times its routing weight, added back to its token."""
    y.mul_(topk_weights.reshape(-1)[order].unsqueeze(1).to(y.dtype))
    return x.new_zeros(x.shape).index_add_(0, token_of, y)


def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, act=silu_and_mul, b13: Optional[torch.Tensor] = None,
                        b2: Optional[torch.Tensor] = None, round_input=None) -> torch.Tensor:
    """The routed experts' weighted sum ``[T, H]``: pairs sorted by expert, one
    grouped GEMM per projection, one scatter-add back to the tokens.  ``b13`` ``[E, 2I]``
    / ``b2`` ``[E, H]``: per-expert biases (GPT-OSS), added to each pair's rows.
    ``round_input``: applied to each GEMM's input rows (online FP8's per-row rounding)."""
    order, counts, token_of, xs = _by_expert(x, topk_ids, w13.shape[0])
    offsets = counts.cumsum(0).to(torch.int32)
    expert_of = topk_ids.reshape(-1)[order] if b13 is not None or b2 is not None else None
    keep = round_input if round_input is not None else (lambda rows: rows)
    h = _grouped_linear(keep(xs), w13, counts, offsets)
    if b13 is not None:
        h += b13.index_select(0, expert_of)
    y = _grouped_linear(keep(act(h)), w2, counts, offsets)
    if b2 is not None:
        y += b2.index_select(0, expert_of)
    return _weighted_sum(x, y, topk_weights, order, token_of)


def fused_experts_packed(x: torch.Tensor, w13: list[torch.Tensor], w2: list[torch.Tensor], topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor, linear, act=silu_and_mul) -> torch.Tensor:
    """``fused_experts_torch`` over per-expert packed weights: the same sort by expert,
    then ``linear`` (the scheme's GEMM) on each expert's contiguous rows.  A token's
    contributions are summed in expert order whatever else is in the batch."""
    order, counts, token_of, xs = _by_expert(x, topk_ids, len(w13))
    y = torch.empty_like(xs)
    start = 0
    for e, c in enumerate(counts.tolist()):
        if c:
            y[start:start + c] = linear(act(linear(xs[start:start + c], w13[e], None)), w2[e], None)
            start += c
    return _weighted_sum(x, y, topk_weights, order, token_of)


class SparseMoeBlock(nn.Module):
    """Router + stacked experts (+ Qwen2-MoE's gated shared expert).

    Tensor parallelism (vLLM's default for MoE without expert parallelism): every rank
    holds every expert, each with its slice of the intermediate dimension (the gate/up
    rows and the down columns of ``[start, start + local)``), and the shared experts
    likewise; the router is replicated, so every rank routes each token the same way;
    the ranks' partial outputs are all-reduced once per block.  Per-expert down
    biases are added on rank 0 only, so the reduced sum counts them once."""

    def __init__(self, c: ModelConfig, dtype: torch.dtype, device):
        super().__init__()
        moe: MoEConfig = c.moe
        self.moe = moe
        self.tp = tp = get_tp()
        (self.inter_start, i), (self.shared_start, s), (self.shared_experts_start, n) = expert_shards(
            moe, tp.rank, tp.world)
        self.local_intermediate, self.local_shared, self.local_shared_experts = i, s, n
        e, h = moe.num_experts, c.hidden_size
        self.top_k = moe.top_k
        self.gate_weight = empty_param(e, h, dtype=dtype, device=device)
        self.gate_bias = empty_param(e, dtype=dtype, device=device) if moe.router_bias else None
        # experts with biases (GPT-OSS) are never packed: allocated where they run
        stack = empty_param if moe.expert_bias else projection_param
        self.w13 = stack(e, 2 * i, h, dtype=dtype, device=device)
        self.w2 = stack(e, h, i, dtype=dtype, device=device)
        # GPT-OSS: a bias per expert on both projections.
        self.w13_bias = empty_param(e, 2 * i, dtype=dtype, device=device) if moe.expert_bias else None
        self.w2_bias = empty_param(e, h, dtype=dtype, device=device) if moe.expert_bias else None
        self.shared_gate_up = empty_param(2 * s, h, dtype=dtype, device=device) if s else None
        self.shared_down = empty_param(h, s, dtype=dtype, device=device) if s else None
        self.shared_expert_gate = empty_param(1, h, dtype=dtype, device=device) if s else None
        # GLM-4.5: the router's correction bias (float32, as its checkpoints store it) and
        # ungated shared experts.
        self.score_bias = (empty_param(e, dtype=torch.float32, device=device) if moe.scoring == "sigmoid"
                           else None)
        self.shared_experts_gate_up = empty_param(2 * n, h, dtype=dtype, device=device) if n else None
        self.shared_experts_down = empty_param(h, n, dtype=dtype, device=device) if n else None
        self.ops: Optional[Any] = None  # the attention backend's fused kernels (fused_experts on CUDA)
        self.packing: Optional[Any] = None  # cpu_gemm.PackedLinears while the experts are packed (lists per expert)

    _PACKED_DENSE = ("gate_weight", "shared_gate_up", "shared_down", "shared_experts_gate_up", "shared_experts_down")  # 2-D weights packed as they are

    def pack_experts(self, scheme) -> None:
        """The router, each expert and the shared expert as packed weights (``scheme``: a
        cpu_gemm.PackedLinears; experts become one packed weight each); the dense
        tensors are dropped, so weight_targets() needs ``unpack_experts`` first."""
        if self.packing is not None or self.w13_bias is not None:
            return  # experts with biases (GPT-OSS) stay dense: the packed path adds no bias
        if scheme.experts is not None:  # stacks packed whole; the router stays dense
            for name in ("w13", "w2"):
                setattr(self, name, scheme.experts.pack(self._parameters.pop(name).data))
            for name in self._PACKED_DENSE:
                if name != "gate_weight" and self._parameters.get(name) is not None:
                    setattr(self, name, scheme.pack(self._parameters.pop(name).data))
            self.packing = scheme
            return
        for name in ("w13", "w2"):
            stacked = self._parameters.pop(name)
            setattr(self, name, [scheme.pack(stacked.data[e]) for e in range(stacked.shape[0])])
        for name in self._PACKED_DENSE:
            if name == "gate_weight" and self.moe.router_fp32:
                continue  # GLM's and DeepSeek's routers run in float32 from the dense weight
            if self._parameters.get(name) is not None:
                setattr(self, name, scheme.pack(self._parameters.pop(name).data))
        self.packing = scheme

    def unpack_experts(self) -> None:
        """The dense tensors again (exact)."""
        if self.packing is None:
            return
        for name in ("w13", "w2"):
            packed = self.__dict__.pop(name)
            dense = (self.packing.experts.unpack(packed) if self.packing.experts is not None
                     else torch.stack([self.packing.unpack(w) for w in packed]))
            setattr(self, name, nn.Parameter(dense, requires_grad=False))
        for name in self._PACKED_DENSE:
            if self.__dict__.get(name) is not None:  # packed: a plain attribute now (a tensor or the scheme's object)
                setattr(self, name, nn.Parameter(self.packing.unpack(self.__dict__.pop(name)), requires_grad=False))
        self.packing = None

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """HF names (``{prefix}{block}.experts.{e}.{proj}.weight`` ...) -> their slices."""
        moe = self.moe
        b = f"{prefix}{moe.block_name}."
        gate, up, down = moe.expert_names
        i = self.local_intermediate
        if moe.family == "gpt_oss":
            # transformers' layout ``[E, in, out]``, gate/up interleaved: views of w13 / w2.
            x = f"{b}experts."
            return {b + "router.weight": self.gate_weight.data, b + "router.bias": self.gate_bias.data,
                    x + "gate_up_proj": self.w13.data.transpose(1, 2), x + "gate_up_proj_bias": self.w13_bias.data,
                    x + "down_proj": self.w2.data.transpose(1, 2), x + "down_proj_bias": self.w2_bias.data}
        t = {b + "gate.weight": self.gate_weight.data}
        for e in range(moe.num_experts):
            x = f"{b}experts.{e}."
            t[x + f"{gate}.weight"] = self.w13.data[e, :i]
            t[x + f"{up}.weight"] = self.w13.data[e, i:]
            t[x + f"{down}.weight"] = self.w2.data[e]
        if self.shared_gate_up is not None:
            s = self.local_shared
            t[b + "shared_expert.gate_proj.weight"] = self.shared_gate_up.data[:s]
            t[b + "shared_expert.up_proj.weight"] = self.shared_gate_up.data[s:]
            t[b + "shared_expert.down_proj.weight"] = self.shared_down.data
            t[b + "shared_expert_gate.weight"] = self.shared_expert_gate.data
        if self.score_bias is not None:
            t[b + "gate.e_score_correction_bias"] = self.score_bias.data
        if self.shared_experts_gate_up is not None:
            n = self.local_shared_experts
            t[b + "shared_experts.gate_proj.weight"] = self.shared_experts_gate_up.data[:n]
            t[b + "shared_experts.up_proj.weight"] = self.shared_experts_gate_up.data[n:]
            t[b + "shared_experts.down_proj.weight"] = self.shared_experts_down.data
        return t

    def weight_slices(self, prefix: str) -> dict[str, tuple[int, int, int]]:
        """HF name -> (dim, start, length) of this rank's slice of the sharded expert
        tensors (tensor parallelism; see the class docstring)."""
        if not self.tp.active:
            return {}
        moe = self.moe
        b = f"{prefix}{moe.block_name}."
        gate, up, down = moe.expert_names
        start, i = self.inter_start, self.local_intermediate
        if moe.family == "gpt_oss":
            # Checkpoint layout ``[E, H, 2I]`` with gate/up interleaved per intermediate
            # index: this rank's indices are one contiguous run of 2 * local columns.
            x = f"{b}experts."
            return {x + "gate_up_proj": (2, 2 * start, 2 * i), x + "gate_up_proj_bias": (1, 2 * start, 2 * i),
                    x + "down_proj": (1, start, i)}
        rows, cols = (0, start, i), (1, start, i)
        t = {}
        for e in range(moe.num_experts):
            x = f"{b}experts.{e}."
            t.update({x + f"{gate}.weight": rows, x + f"{up}.weight": rows, x + f"{down}.weight": cols})
        for name, begin, local in (("shared_expert", self.shared_start, self.local_shared),
                                   ("shared_experts", self.shared_experts_start, self.local_shared_experts)):
            if local:
                x = f"{b}{name}."
                t.update({x + "gate_proj.weight": (0, begin, local), x + "up_proj.weight": (0, begin, local),
                          x + "down_proj.weight": (1, begin, local)})
        return t

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output ``[T, H]``, routed expert ids ``[T, top_k]``)."""
        linear = F.linear if self.packing is None else self.packing.linear
        # the router: packed with the rest, or left dense (schemes packing the experts whole)
        router = linear if self.__dict__.get("gate_weight") is not None else F.linear
        if self.score_bias is not None:
            # transformers scores GLM's router in float32 (weights and hidden cast up).
            weights, ids = select_experts_grouped(F.linear(h.float(), self.gate_weight.float()), self.score_bias,
                                                  self.moe)
        elif self.moe.scoring == "softmax_grouped":
            weights, ids = select_experts_group_limited(F.linear(h.float(), self.gate_weight.float()), self.moe)
        elif self.moe.scoring == "topk_softmax":
            weights, ids = select_experts_topk_softmax(router(h, self.gate_weight, self.gate_bias), self.top_k)
        else:
            weights, ids = select_experts(router(h, self.gate_weight, None), self.top_k, self.moe.norm_topk_prob)
        # transformers rounds the routing weights to the model dtype (Mixtral, GLM and DeepSeek keep fp32).
        if self.moe.family not in ("mixtral", "glm4_moe", "deepseek_v2", "deepseek_v3"):
            weights = weights.to(h.dtype)
        ops = self.ops
        act = silu_and_mul if ops is None else ops.silu_and_mul
        if self.moe.swiglu_clamp is not None:
            alpha, limit = self.moe.swiglu_clamp
            act = lambda gate_up: clamped_swiglu(gate_up, alpha, limit)  # noqa: E731
        if self.w13_bias is not None:
            # The fused Triton kernel has no expert biases: GPT-OSS's experts run the grouped
            # torch path on every device.
            w2_bias = self.w2_bias if self.tp.rank == 0 else None  # counted once in the all-reduced sum
            out = fused_experts_torch(h, self.w13, self.w2, weights, ids, act, self.w13_bias, w2_bias)
            return self._reduced(out), ids
        if self.packing is not None and self.packing.experts is not None:
            # the scheme keeps the stacks whole (online FP8) and runs them its own way
            out = self.packing.experts.run(h, self.w13, self.w2, weights, ids, act)
            return self._reduced(self._with_shared(h, out, linear, act)), ids
        # The Triton kernel: on CUDA whatever the attention backend, on CPU tensors only
        # when the Triton backend is chosen (under its interpreter, in tests).
        fused = getattr(ops, "fused_experts", None)
        if fused is None and h.is_cuda:
            from worker.engine.kernels.triton import ops as triton_ops

            fused = triton_ops().fused_experts
        if fused is not None:
            out = fused(h, self.w13, self.w2, weights, ids, act)
        elif self.packing is not None:
            out = fused_experts_packed(h, self.w13, self.w2, weights, ids, self.packing.linear, act)
        else:
            out = fused_experts_torch(h, self.w13, self.w2, weights, ids, act)
        return self._reduced(self._with_shared(h, out, linear, act)), ids

    def _with_shared(self, h: torch.Tensor, out: torch.Tensor, linear, act) -> torch.Tensor:
        """The routed experts' ``out`` plus the shared expert(s), if the family has them."""
        if self.shared_gate_up is not None:
            shared = linear(act(linear(h, self.shared_gate_up, None)), self.shared_down, None)
            out = out + torch.sigmoid(F.linear(h, self.shared_expert_gate)) * shared
        if self.shared_experts_gate_up is not None:
            out = out + linear(act(linear(h, self.shared_experts_gate_up, None)), self.shared_experts_down, None)
        return out

    def _reduced(self, out: torch.Tensor) -> torch.Tensor:
        """The block's output: this rank's partial sum, all-reduced under tensor parallelism."""
        return self.tp.all_reduce(out) if self.tp.active else out
