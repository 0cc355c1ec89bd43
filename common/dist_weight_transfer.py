"""Weight transfer over a torch.distributed group: vLLM's NCCL weight-transfer
protocol, with gloo on CPU so it runs (and is tested) without a GPU.

The trainer is rank 0 and hosts the rendezvous store at ``master_address`` /
``master_port``; worker ``r`` (its data-parallel rank) joins as ``r + rank_offset``
of ``world_size``.  Each ``/update_weights`` names a bucket (``names``,
``dtype_names``, ``shapes``), then rank 0 broadcasts it: tensor by tensor, or with
``packed`` the tensors concatenated as bytes into buffers that close once they
exceed ``packed_buffer_size_bytes`` (vLLM's packed_tensor layout).  Both sides
call ``bucket_plan`` so they cut the stream at the same places.

``TrainerWeightSender`` is the trainer's half; ``WeightReceiver`` the worker's.
torch is imported lazily: the gateway and broker never load it.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Sequence

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30  # vLLM's default
STORE_PREFIX = "tokserve-weight-transfer"


@dataclass
class DistInitInfo:
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    backend: Optional[str] = None  # gloo | nccl; None: nccl on CUDA, gloo on CPU
    timeout_s: float = 300.0

    @classmethod
    def from_dict(cls, d: dict) -> "DistInitInfo":
        """Validated init_info; ValueError naming the problem."""
        if not isinstance(d, dict):
            raise ValueError("init_info must be a JSON object")
        known = {"master_address", "master_port", "world_size", "rank_offset", "packed", "packed_buffer_size_bytes",
                 "packed_num_buffers", "backend", "timeout_s", "nccl_unique_id_b64"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown init_info field(s) {unknown}")
        if d.get("nccl_unique_id_b64"):
            raise ValueError("init_info.nccl_unique_id_b64 (torch-free rendezvous) is not supported: "
                             "pass master_address and master_port")
        for key in ("master_address", "master_port", "world_size"):
            if key not in d:
                raise ValueError(f"init_info lacks {key!r}")
        info = cls(master_address=str(d["master_address"]), master_port=_int(d, "master_port"),
                   world_size=_int(d, "world_size"), rank_offset=_int(d, "rank_offset", 1),
                   packed=bool(d.get("packed", False)),
                   packed_buffer_size_bytes=_int(d, "packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_SIZE_BYTES),
                   backend=d.get("backend"), timeout_s=float(d.get("timeout_s", 300.0)))
        if not 0 < info.master_port < 65536:
            raise ValueError(f"init_info.master_port {info.master_port} is not a port")
        if info.world_size < 2 or info.rank_offset < 1 or info.packed_buffer_size_bytes < 1:
            raise ValueError("init_info needs world_size >= 2, rank_offset >= 1, packed_buffer_size_bytes >= 1")
        if info.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"init_info.backend {info.backend!r}: expected 'gloo' or 'nccl'")
        return info


def _int(d: dict, key: str, default: Any = None) -> int:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"init_info.{key} must be an integer, got {value!r}")
    return value


def make_group(info: DistInitInfo, rank: int, device):
    """A process group of its own (not torch.distributed's default group, which a
    trainer usually uses for itself)."""
    import torch.distributed as dist

    backend = info.backend or ("nccl" if getattr(device, "type", "cpu") == "cuda" else "gloo")
    timeout = datetime.timedelta(seconds=info.timeout_s)
    store = dist.TCPStore(info.master_address, info.master_port, info.world_size, rank == 0, timeout=timeout)
    prefixed = dist.PrefixStore(STORE_PREFIX, store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, info.world_size, timeout)
    else:
        group = dist.ProcessGroupNCCL(prefixed, rank, info.world_size)
    return group, store


def broadcast(group, tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


def bucket_plan(sizes: Sequence[int], packed: bool, buffer_bytes: int) -> list[list[int]]:
    """Indexes of the tensors each broadcast carries (vLLM: a buffer closes once it
    exceeds ``buffer_bytes``, the crossing tensor included)."""
    if not packed:
        return [[i] for i in range(len(sizes))]
    plan, cur, total = [], [], 0
    for i, n in enumerate(sizes):
        cur.append(i)
        total += n
        if total > buffer_bytes:
            plan.append(cur)
            cur, total = [], 0
    if cur:
        plan.append(cur)
    return plan


def _nbytes(dtype, shape) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


class WeightReceiver:
    """A worker's end: joins the trainer's group, receives buckets."""

    def __init__(self, info: DistInitInfo, worker_rank: int, device):
        self.info = info
        self.device = device
        self.rank = worker_rank + info.rank_offset
        if self.rank >= info.world_size:
            raise ValueError(f"worker rank {worker_rank} + rank_offset {info.rank_offset} is outside "
                             f"world_size {info.world_size}")
        self.group, self._store = make_group(info, self.rank, device)

    def receive(self, entries: Sequence[tuple[str, Any, tuple]], packed: Optional[bool] = None,
                packed_buffer_size_bytes: Optional[int] = None) -> Iterator[tuple[str, Any]]:
        """(name, tensor) of a bucket whose checked entries are (name, torch dtype, shape);
        ``packed`` / ``packed_buffer_size_bytes``: the update's own (vLLM < 0.28 and SkyRL send
        them in update_info), else the group's from init_info."""
        import torch

        packed = self.info.packed if packed is None else packed
        buffer_bytes = packed_buffer_size_bytes or self.info.packed_buffer_size_bytes
        sizes = [_nbytes(dtype, shape) for _, dtype, shape in entries]
        for idx in bucket_plan(sizes, packed, buffer_bytes):
            if not packed:
                name, dtype, shape = entries[idx[0]]
                t = torch.empty(shape, dtype=dtype, device=self.device)
                broadcast(self.group, t)
                yield name, t
                continue
            buf = torch.empty(sum(sizes[i] for i in idx), dtype=torch.uint8, device=self.device)
            broadcast(self.group, buf)
            at = 0
            for i in idx:
                name, dtype, shape = entries[i]
                yield name, buf[at:at + sizes[i]].view(dtype).view(shape)
                at += sizes[i]

    def close(self) -> None:
        self.group = None
        self._store = None


class TrainerWeightSender:
    """The trainer's end (rank 0): ``sender.send(named_tensors)`` broadcasts one bucket
    while the server's ``/update_weights`` (with ``update_info(named_tensors)``)
    receives it.  ``init_info()`` is the body of ``/init_weight_transfer_engine``;
    the server must be asked to join (that call blocks until everyone has) while
    this object is constructed, e.g. from another thread."""

    def __init__(self, master_address: str, master_port: int, world_size: int, *, packed: bool = False,
                 packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES, backend: Optional[str] = None,
                 device: Any = "cpu", timeout_s: float = 300.0):
        import torch

        self.info = DistInitInfo(master_address, master_port, world_size, 1, packed, packed_buffer_size_bytes,
                                 backend, timeout_s)
        self.device = torch.device(device)
        self.group = None
        self._store = None

    def init_info(self) -> dict:
        d = {"master_address": self.info.master_address, "master_port": self.info.master_port,
             "world_size": self.info.world_size, "rank_offset": 1, "packed": self.info.packed,
             "packed_buffer_size_bytes": self.info.packed_buffer_size_bytes}
        if self.info.backend:
            d["backend"] = self.info.backend
        return d

    def connect(self) -> None:
        """Join as rank 0 (hosts the store); returns once every worker joined."""
        self.group, self._store = make_group(self.info, 0, self.device)

    @staticmethod
    def update_info(named_tensors: Iterable) -> dict:
        names, dtypes, shapes = [], [], []
        for name, t in named_tensors:
            names.append(name)
            dtypes.append(str(t.dtype).removeprefix("torch."))
            shapes.append(list(t.shape))
        return {"names": names, "dtype_names": dtypes, "shapes": shapes}

    def send(self, named_tensors: Sequence) -> None:
        import torch

        tensors = [t.detach().to(self.device).contiguous() for _, t in named_tensors]
        sizes = [t.numel() * t.element_size() for t in tensors]
        for idx in bucket_plan(sizes, self.info.packed, self.info.packed_buffer_size_bytes):
            if not self.info.packed:
                broadcast(self.group, tensors[idx[0]])
                continue
            buf = torch.cat([tensors[i].view(-1).view(torch.uint8) for i in idx])
            broadcast(self.group, buf)

    def close(self) -> None:
        self.group = None
        self._store = None


def weight_checksums(named_tensors: Iterable, prefix: str = "") -> dict[str, str]:
    """sha256 per tensor (vLLM's compute_tensor_digests), as ``/weight_checker``
    computes them on the server: pass the served dtype's tensors, the digest is over
    their bytes."""
    import hashlib

    import torch

    out = {}
    for name, t in named_tensors:
        data = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
        out[prefix + name] = hashlib.sha256(data).hexdigest()
    return out
