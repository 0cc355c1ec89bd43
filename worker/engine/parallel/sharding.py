"""Which part of each weight a tensor-parallel rank holds (Megatron-style, as vLLM).

q/k/v and gate/up are split by output rows (column-parallel), o_proj and down_proj
by input columns (row-parallel, all-reduced after), the embedding and LM head by
vocabulary rows (padded to equal shards).  KV heads are split across ranks; with
fewer KV heads than ranks each is replicated, rank r keeping head
``r * kv_heads // world``: exactly the one its query heads use.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadShard:
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    head_start: int  # first query head
    kv_head_start: int  # first KV head


def head_shard(num_heads: int, num_kv_heads: int, rank: int, world: int) -> HeadShard:
    if num_heads % world:
        raise ValueError(f"tensor_parallel_size {world} must divide num_attention_heads {num_heads}")
    if num_kv_heads >= world:
        if num_kv_heads % world:
            raise ValueError(f"tensor_parallel_size {world} must divide num_key_value_heads {num_kv_heads}")
        kv_local, kv_start = num_kv_heads // world, rank * (num_kv_heads // world)
    else:
        if world % num_kv_heads:
            raise ValueError(f"num_key_value_heads {num_kv_heads} must divide tensor_parallel_size {world}")
        kv_local, kv_start = 1, rank * num_kv_heads // world
    local = num_heads // world
    return HeadShard(local, kv_local, rank * local, kv_start)


def split(n: int, rank: int, world: int, what: str) -> tuple[int, int]:
    """(start, length) of an even split of ``n``."""
    if n % world:
        raise ValueError(f"tensor_parallel_size {world} must divide {what} {n}")
    size = n // world
    return rank * size, size


def expert_shards(moe, rank: int, world: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """(start, length) of this rank's slice of a mixture-of-experts block (``moe``: its
    MoEConfig) along each intermediate dimension it splits: the routed experts', the
    gated shared expert's (Qwen2-MoE) and the ungated shared experts' (GLM, DeepSeek);
    a size the ranks cannot split evenly is refused."""
    return (split(moe.intermediate_size, rank, world, "moe_intermediate_size"),
            split(moe.shared_expert_intermediate_size, rank, world, "shared_expert_intermediate_size"),
            split(moe.shared_experts_intermediate_size, rank, world, "shared_experts intermediate size"))


def vocab_shard(vocab: int, rank: int, world: int) -> tuple[int, int, int]:
    """(start, rows held from the checkpoint, padded shard size)."""
    size = -(-vocab // world)
    start = rank * size
    return start, max(0, min(size, vocab - start)), size
