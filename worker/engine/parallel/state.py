"""This process's tensor-parallel rank and the collectives the sharded model needs.

Two groups: the device group (NCCL on CUDA, gloo on CPU) carries activations; a gloo
group carries the small host-side step messages (vLLM's CPU group), so metadata never
round-trips through a GPU.  At world size 1 every collective is a no-op.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass
class TensorParallel:
    rank: int = 0
    world: int = 1
    cpu_group: Optional[Any] = None

    @property
    def active(self) -> bool:
        return self.world > 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def all_gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t)
        return torch.cat(parts, dim=-1)


_TP = TensorParallel()
STEP_TIMEOUT_S = float(os.environ.get("TOKSERVE_TP_STEP_TIMEOUT_S", "600"))


def get_tp() -> TensorParallel:
    return _TP


def init_tensor_parallel(rank: int, world: int, init_method: str, device: torch.device) -> TensorParallel:
    """Join the worker's process group (every rank calls this with the same
    ``init_method``)."""
    global _TP
    if world == 1:
        _TP = TensorParallel()
        return _TP
    backend = "nccl" if device.type == "cuda" else "gloo"
    # The device group only carries a step's collectives, which every rank is inside at
    # once; it also bounds the rendezvous, so a rank that never came up is an error.
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=STEP_TIMEOUT_S))
    # Followers wait on the control group between steps for as long as the server is
    # idle; a rank 0 that dies closes the connections, which ends the wait at once.
    cpu_group = dist.new_group(backend="gloo", timeout=timedelta(days=365))
    _TP = TensorParallel(rank=rank, world=world, cpu_group=cpu_group)
    return _TP


def destroy_tensor_parallel() -> None:
    global _TP
    if _TP.world > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _TP = TensorParallel()
