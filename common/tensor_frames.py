"""Named tensors as raw ZeroMQ frames: the weight-bucket payload of a CONTROL message.

A bucket is described by vLLM's update_info columns (``names``, ``dtype_names``,
``shapes``) in the ControlRequest body, followed by each tensor's bytes in C order,
cut into frames of at most FRAME_BYTES (the broker bounds inbound frame sizes; a
tensor of n bytes takes max(1, ceil(n / FRAME_BYTES)) frames).  Sender and receiver share the buffers with ZeroMQ instead of
copying them (``copy=False`` on send, ``torch.frombuffer`` on receive); no pickle.

torch is imported lazily: the gateway and broker never touch tensors.
"""
from __future__ import annotations

import warnings
from typing import Iterable, Iterator, Sequence

DEFAULT_BUCKET_BYTES = 64 << 20
FRAME_BYTES = 16 << 20  # well below the broker's client frame limit (common.config.MAX_CLIENT_FRAME_BYTES)


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_frames(tensor) -> list[memoryview]:
    """The tensor's bytes without a copy (a contiguous CPU copy first when needed)."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    data = memoryview(t.view(-1).view(torch.uint8).numpy())
    return [data[i:i + FRAME_BYTES] for i in range(0, len(data), FRAME_BYTES)] or [data]


def frame_count(nbytes: int) -> int:
    return max(1, -(-nbytes // FRAME_BYTES))


def buckets(named_tensors: Iterable, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[tuple[dict, list]]:
    """Split (name, tensor) pairs into (update_info, frames) buckets of about
    ``bucket_bytes`` each (a larger tensor travels alone)."""
    info = {"names": [], "dtype_names": [], "shapes": []}
    frames: list = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if frames and size + nbytes > bucket_bytes:
            yield info, frames
            info, frames, size = {"names": [], "dtype_names": [], "shapes": []}, [], 0
        info["names"].append(name)
        info["dtype_names"].append(dtype_name(tensor.dtype))
        info["shapes"].append(list(tensor.shape))
        frames.extend(tensor_frames(tensor))
        size += nbytes
    if frames:
        yield info, frames


def decode_frames(entries: Sequence[tuple[str, object, tuple]], frames: Sequence) -> list[tuple[str, object]]:
    """(name, tensor) over received frames; ``entries`` are checked (name, torch dtype,
    shape) triples.  A one-frame tensor is a view of its frame, a longer one is joined
    into fresh memory.  Raises ValueError when the frames do not add up."""
    import torch

    sizes = []
    for name, dtype, shape in entries:
        n = dtype.itemsize
        for d in shape:
            n *= d
        sizes.append(n)
    if len(frames) != sum(frame_count(n) for n in sizes):
        raise ValueError(f"the bucket names {len(entries)} tensor(s) of {sum(sizes)} bytes but carries "
                         f"{len(frames)} frame(s)")
    out = []
    pos = 0
    for (name, dtype, shape), nbytes in zip(entries, sizes):
        count = frame_count(nbytes)
        parts = [f.buffer if hasattr(f, "buffer") else memoryview(f) for f in frames[pos:pos + count]]
        pos += count
        got = sum(len(p) for p in parts)
        if got != nbytes:
            raise ValueError(f"tensor {name!r}: {got} bytes received, {list(shape)} {dtype_name(dtype)} needs {nbytes}")
        with warnings.catch_warnings():  # read-only buffers: the tensor is only read (copied into the model)
            warnings.simplefilter("ignore", UserWarning)
            if nbytes == 0:
                flat = torch.empty(0, dtype=torch.uint8)
            elif count == 1:
                flat = torch.frombuffer(parts[0], dtype=torch.uint8)
            else:
                flat = torch.empty(nbytes, dtype=torch.uint8)
                at = 0
                for p in parts:
                    flat[at:at + len(p)] = torch.frombuffer(p, dtype=torch.uint8)
                    at += len(p)
        out.append((name, flat.view(dtype).view(shape)))
    return out
