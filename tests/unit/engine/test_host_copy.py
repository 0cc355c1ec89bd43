"""The sampled ids' way to the host (core/inflight.py): listed at once on the CPU; on
CUDA copied into pinned memory behind an event, so the device thread never waits for
the device (vLLM's async model runner output)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.engine.core.inflight import DeviceStep, HostCopy, placeholder_fill
from worker.engine.sample.logprobs import LogprobsTensors
from worker.engine.sample.sampler import SamplerOutput


def _step() -> DeviceStep:
    return DeviceStep(None, [], 0, None, [], [], [], None)


def _output(device: str, with_logprobs: bool) -> SamplerOutput:
    sampled = torch.tensor([7, 3, 11], device=device)
    lp = None
    if with_logprobs:
        lp = LogprobsTensors(token_ids=sampled.clone(), token_logprobs=torch.tensor([-0.5, -1.25, -2.0], device=device),
                             ranks=torch.tensor([1, 2, 1], dtype=torch.int32, device=device),
                             top_ids=torch.tensor([[7, 1], [4, 3], [11, 0]], device=device),
                             top_logprobs=torch.tensor([[-0.5, -1.0], [-1.0, -1.25], [-2.0, -3.0]], device=device))
    return SamplerOutput(sampled=sampled, logprobs=lp)


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_cpu_results_are_listed_at_once(with_logprobs):
    step = _step()
    out = _output("cpu", with_logprobs)
    step.set_result(out)
    assert step.host_copy is None and step.sampled == [7, 3, 11]  # the CPU path: nothing left to wait for
    assert (step.logprob_lists is not None) == with_logprobs
    if with_logprobs:
        assert step.logprob_lists == out.logprobs.tolists()
    step.collect()  # a no-op
    assert step.sampled == [7, 3, 11]


def test_collect_lists_what_the_copy_brought():
    """``collect`` reads a HostCopy's tensors (host tensors here: taken as they are)."""
    out = _output("cpu", True)
    step = _step()
    step.result = out
    lp = out.logprobs
    step.host_copy = HostCopy([out.sampled, lp.token_ids, lp.token_logprobs, lp.ranks, lp.top_ids, lp.top_logprobs])
    assert not step.host_copy.pending
    step.collect()
    assert step.host_copy is None and step.sampled == [7, 3, 11]
    assert step.logprob_lists == lp.tolists()


def test_steady_decode_batch_fills_its_placeholders_row_for_row():
    """The previous step sampled rows 0..n-1 for exactly the sequences now in inputs
    0..n-1: one copy; any other arrangement goes through the index tensors."""
    class Seq:
        def __init__(self, seq_id):
            self.seq_id = seq_id

    prev = _step()
    prev.result = SamplerOutput(sampled=torch.tensor([40, 41, 42]), logprobs=None)
    prev.row_of = {0: 0, 1: 1, 2: 2}
    seqs = [Seq(0), Seq(1), Seq(2)]
    ids = torch.zeros(3, dtype=torch.long)
    placeholder_fill([0, 1, 2], seqs, prev)(ids)
    assert ids.tolist() == [40, 41, 42]
    ids = torch.full((5,), -1, dtype=torch.long)
    placeholder_fill([4, 1], [seqs[0], seqs[2]], prev)(ids)  # a mixed step: other positions, other order
    assert ids.tolist() == [-1, 42, -1, -1, 40]
    # The host variant (tensor parallelism broadcasts host arrays): a filled copy, the
    # frozen layout's array untouched.
    host = np.full(5, -1, dtype=np.int64)
    for holes, hole_seqs in (([4, 1], [seqs[0], seqs[2]]), ([0, 1, 2], seqs)):
        filled = placeholder_fill(holes, hole_seqs, prev).host_ids(host)
        assert filled.tolist() == ([-1, 42, -1, -1, 40] if holes == [4, 1] else [40, 41, 42, -1, -1])
        assert host.tolist() == [-1] * 5


@pytest.mark.cuda
@pytest.mark.parametrize("with_logprobs", [False, True])
def test_cuda_copy_is_asynchronous_and_arrives_whole(with_logprobs):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    out = _output("cuda", with_logprobs)
    want = out.sampled.tolist()
    want_lp = out.logprobs.tolists() if with_logprobs else None
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the device is busy (~0.1 s): the copy queues behind it
    step = _step()
    step.set_result(out)  # returns without waiting for the device
    assert step.host_copy is not None and step.sampled is None
    assert step.host_copy.pending, "set_result waited for the device"
    assert all(t.is_pinned() for t in step.host_copy.host)
    step.collect()
    assert step.sampled == want and step.logprob_lists == want_lp
