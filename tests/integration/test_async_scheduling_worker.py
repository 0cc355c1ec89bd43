"""Real `tokserve worker` processes with `--async-scheduling` (the CUDA default; asked
for here, as CPU workers default to the synchronous step) and with
`--no-async-scheduling` stream the same tokens, logprobs and finish reasons for a
concurrent mix of requests: greedy, seeded sampling with n > 1 (choices forked when
planning), logprobs, stop ids, a penalty request (its steps run synchronously) beside
the others.  The worker's log says which step it runs."""
from __future__ import annotations

import concurrent.futures

import pytest

from common.client import Client
from common.protocol import GenerateRequest, SamplingParams
from tests.support.engine_helpers import random_prompts
from tests.support.procs import ProcGroup, wait_for_workers

pytestmark = pytest.mark.timeout(240)


def _requests() -> list[GenerateRequest]:
    prompts = random_prompts(8, 5, 40, seed=21)
    params = [dict(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
              dict(temperature=0.9, top_p=0.9, seed=5, n=3, max_tokens=16, ignore_eos=True),
              dict(temperature=0.0, max_tokens=30, stop_token_ids=[prompts[2][0], 7, 11, 13]),
              dict(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.2),
              dict(temperature=1.0, seed=9, max_tokens=40, ignore_eos=True, logprobs=1),
              dict(temperature=0.0, max_tokens=8, ignore_eos=True),
              dict(temperature=0.0, max_tokens=33, ignore_eos=True),
              dict(temperature=0.7, seed=3, max_tokens=17, ignore_eos=True, top_k=5)]
    return [GenerateRequest(request_id=f"r{i}", prompt_token_ids=p, params=SamplingParams(**kw))
            for i, (p, kw) in enumerate(zip(prompts, params))]


def _stream(client: Client, req: GenerateRequest):
    out: dict = {}
    for d in client.generate(req):
        e = out.setdefault(d.index, {"tokens": [], "logprobs": [], "finish": None})
        e["tokens"] += d.token_ids
        if d.logprobs is not None:
            e["logprobs"] += list(zip(d.logprobs.token_ids, d.logprobs.logprobs))
        if d.finish_reason is not None:
            e["finish"] = (d.finish_reason, d.stop_reason)
    return out


def _serve(llama_dir, tmp_path, *flags):
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker()
        worker = procs.worker(broker, 0, "--model", str(llama_dir), "--threads", "1", "--num-kv-blocks", "128",
                              "--log-level", "INFO", *flags)
        try:
            wait_for_workers(broker.frontend, 1, timeout=120)
        except TimeoutError:
            pytest.fail("worker did not register\n" + procs.tails())
        reqs = _requests()
        with Client(broker.frontend) as client, concurrent.futures.ThreadPoolExecutor(len(reqs)) as pool:
            got = dict(zip([r.request_id for r in reqs], pool.map(lambda r: _stream(client, r), reqs)))
    return got, worker.log_path.read_text()


def test_worker_streams_the_same_with_and_without_async_scheduling(llama_dir, tmp_path):
    overlapped, log_on = _serve(llama_dir, tmp_path / "on", "--async-scheduling")
    synchronous, log_off = _serve(llama_dir, tmp_path / "off", "--no-async-scheduling")
    assert "async scheduling on" in log_on, log_on[-2000:]
    assert "async scheduling off" in log_off, log_off[-2000:]
    assert overlapped == synchronous
    assert all(e["finish"] is not None for r in overlapped.values() for e in r.values())
    assert sorted(overlapped["r1"]) == [0, 1, 2]


def test_cpu_worker_defaults_to_the_synchronous_step(llama_dir, tmp_path):
    """No flag on a CPU worker: the synchronous step, as vLLM's CPU platform."""
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker()
        worker = procs.worker(broker, 0, "--model", str(llama_dir), "--threads", "1", "--num-kv-blocks", "64",
                              "--log-level", "INFO")
        try:
            wait_for_workers(broker.frontend, 1, timeout=120)
        except TimeoutError:
            pytest.fail("worker did not register\n" + procs.tails())
    log = worker.log_path.read_text()
    assert "async scheduling off on CPU" in log and "async scheduling off" in log, log[-2000:]
