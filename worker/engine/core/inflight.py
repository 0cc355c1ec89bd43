"""The device side of an engine step, and where it runs (async scheduling).

A ``DeviceStep`` is one step as the host planned it -- the runner's ``RunPlan``, the
logit rows, the sampling metadata, the choices that sample -- frozen when it is
launched: the device work reads it and fills in its results, the host never changes
it afterwards.  ``StepExecutor`` runs device steps strictly in launch order, either
inline (synchronous scheduling) or on one background thread, so that the host plans
step N+1 and processes step N's outputs while step N+1 runs (vLLM's async scheduling,
SGLang's overlap scheduler).  Torch releases the GIL in its kernels and while it waits
on a GPU, so the two threads really overlap.

A token sampled by a step still in flight is not known when the next step is planned:
the choice counts it as pending (``EngineSequence.num_pending``) and the next step's
input id at that position is a placeholder, filled on the device from the previous
step's sampled ids right before the forward (``placeholder_fill``).
"""
from __future__ import annotations

import concurrent.futures
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from worker.engine.sample.logprobs import LogprobsTensors

SWITCH_INTERVAL_S = 0.00005  # GIL switch interval with a device thread (see StepExecutor)


@dataclass(eq=False)
class DeviceStep:
    run_plan: Any  # the runner's RunPlan (host arrays of the batch, contributed inputs)
    rows: list[int]  # hidden rows whose logits are computed: prompt rows, then sampling rows
    num_prompt_rows: int
    sample_index: Optional[list[int]]  # logit rows of the sampler (None: all rows after the prompt rows)
    prompt_jobs: list  # (request, first position, count): prompt positions scored
    sample_seqs: list  # the choices that sample, in sampler-row order
    specs: list  # drafts each verifies (speculative decoding)
    meta: Any  # SamplingMetadata of the sampling rows (None until built when ``meta_rows`` is set)
    row_of: dict[int, int] = field(default_factory=dict)  # seq_id -> its first sampler row
    future: Any = None
    # Results, set by the device work
    prompt_logits: Optional[torch.Tensor] = None
    result: Any = None  # SamplerOutput
    sampled: Optional[list[int]] = None  # result.sampled copied to the host
    logprob_lists: Any = None
    host_copy: Optional["HostCopy"] = None  # CUDA: the sampled ids (and logprobs) on their way to the host
    # Set once the host processed this step's outputs (tokens appended, on_sampled run): a
    # later step whose logits processors read that state (a grammar matcher advanced by
    # the token this step samples) waits for it before them -- its forward still overlaps.
    outputs_done: threading.Event = field(default_factory=threading.Event)
    wait_before_logits: Optional[threading.Event] = None  # the previous step's outputs_done, when needed
    # Sampling rows whose metadata reads the output history (penalties, min_tokens, bad
    # words): built on the device side after ``wait_before_logits``, when the token the
    # previous step samples is in that history.
    meta_rows: Optional[list] = None

    def set_result(self, result: Any) -> None:
        """The sampler's output (``SamplerOutput``).  On the CPU its ids and logprobs are
        listed at once (there is nothing to overlap); on CUDA their copy to the host
        starts (``HostCopy``) and ``collect`` lists them when the host needs them, so
        the device thread never waits for the device."""
        self.result = result
        lp = result.logprobs
        if result.sampled.device.type == "cuda":
            self.host_copy = HostCopy([result.sampled] + ([lp.token_ids, lp.token_logprobs, lp.ranks, lp.top_ids,
                                                           lp.top_logprobs] if lp is not None else []))
            return
        self.sampled = result.sampled.tolist()
        self.logprob_lists = lp.tolists() if lp is not None else None

    def collect(self) -> None:
        """``sampled`` and ``logprob_lists`` from the host copy, once it arrived (a step
        whose results were listed on the device thread has none)."""
        copy, self.host_copy = self.host_copy, None
        if copy is None:
            return
        host = copy.wait()
        self.sampled = host[0].tolist()
        if len(host) > 1:
            self.logprob_lists = LogprobsTensors(*host[1:]).tolists()


class HostCopy:
    """Device tensors copied to the host without blocking the thread that starts the copy
    (vLLM's async model runner output).  CUDA: each is copied into pinned host memory
    with ``non_blocking=True`` on the current stream and one event is recorded after
    the copies; ``wait()`` blocks on that event only -- not on what the device thread
    queued after it (the next step's forward) -- and returns the host tensors.  Host
    tensors (CPU) are taken as they are: there is nothing to wait for."""

    def __init__(self, tensors: list[torch.Tensor]):
        self._event = None
        if not tensors or tensors[0].device.type != "cuda":
            self.host = list(tensors)
            return
        self.host = []
        for t in tensors:
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            self.host.append(h)
        self._event = torch.cuda.Event()
        self._event.record()

    @property
    def pending(self) -> bool:
        """Whether the copy may still be on its way (CUDA, not waited for, event not reached)."""
        return self._event is not None and not self._event.query()

    def wait(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self.host


def placeholder_fill(holes: list[int], hole_seqs: list, prev: Optional[DeviceStep]) -> Optional["PlaceholderFill"]:
    """What writes the tokens in flight into a step's input ids: input ``holes[i]`` is
    the token ``prev`` sampled for ``hole_seqs[i]``.  Runs on the device side, after
    ``prev`` (the executor's order), before the forward."""
    if not holes:
        return None
    assert prev is not None, "a placeholder needs the step in flight that samples it"
    row_of = prev.row_of
    return PlaceholderFill(prev, holes, [row_of[seq.seq_id] for seq in hole_seqs])


class PlaceholderFill:
    """Writes the tokens a step in flight samples into the next step's input ids:
    called with the device input ids (no host sync: the host copy may still be on its
    way), or ``host_ids`` for a host copy of them (tensor parallelism broadcasts the
    step's host arrays to the follower ranks: they need the real tokens)."""

    __slots__ = ("prev", "holes", "rows", "_steady", "_index_host", "_rows_host")

    def __init__(self, prev: DeviceStep, holes: list[int], rows: list[int]):
        self.prev, self.holes, self.rows = prev, holes, rows
        # The index tensors are made here, on the host thread: every torch call of the device
        # thread gives up the GIL and waits to get it back while the host runs Python.
        iota = list(range(len(holes)))
        self._steady = holes == iota and rows == iota  # decode: input i is what row i sampled
        self._index_host = None if self._steady else torch.tensor(holes, dtype=torch.long)
        self._rows_host = None if self._steady else torch.tensor(rows, dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor) -> None:
        sampled = self.prev.result.sampled  # on the device: the host copy may still be on its way
        if self._steady:
            n = len(self.holes)
            input_ids[:n].copy_(sampled[:n])
            return
        index = self._index_host.to(input_ids.device, non_blocking=True)
        rows = self._rows_host.to(sampled.device, non_blocking=True)
        input_ids.index_copy_(0, index, sampled.index_select(0, rows).to(input_ids.dtype))

    def host_ids(self, input_ids: np.ndarray) -> np.ndarray:
        """A copy of the host ``input_ids`` with the placeholders filled (on CUDA this
        waits for the previous step's sampling: its tokens must reach the host)."""
        filled = input_ids.copy()
        sampled = self.prev.result.sampled.cpu().numpy()
        filled[self.holes] = sampled[self.rows]
        return filled


class _Done:
    """A finished (or failed) inline run, with a Future's ``result()``."""

    __slots__ = ("_value", "_error")

    def __init__(self, fn: Callable[..., Any], args: tuple):
        self._value = self._error = None
        try:
            self._value = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised by result(), as a Future does
            self._error = e

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


class StepExecutor:
    """Runs device steps in launch order: inline, or on one background thread."""

    def __init__(self, threaded: bool, device: torch.device):
        self.threaded = threaded
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        if threaded:
            # The device thread must get the GIL back as soon as its wait (a GPU sync, a
            # kernel) returns, or every step's tail waits up to a whole switch interval
            # (5 ms by default) behind the host's Python: 1.14x -> 1.57x decode tok/s at
            # batch 256 in benchmarks/async_overlap.py; 50 us rather than 200: every torch call
            # of the device thread hands the GIL over and waits to get it back, and on a loaded
            # 2-core box that cut the exposed host time at batch 64 from 0.63 to 0.48 ms and at
            # 256 from 3-4 ms to 0.4-0.65 ms (benchmarks/README.md).  Process-wide, hence only lowered.
            sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
            # One thread: steps run one at a time, in order (the next step's placeholders
            # read the previous one's samples; the KV cache is written in step order).
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="engine-device", initializer=_device_thread_init, initargs=(device,))

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._pool is None:
            return _Done(fn, args)
        return self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _device_thread_init(device: torch.device) -> None:
    threading.current_thread().name = "engine-device"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # per thread: the step's kernels and events land on it
