"""A real worker with ``--kv-cache-dtype fp8`` (vLLM's flag): its engine stores the KV
cache in FP8 (the start-up line says so, with four times the blocks float32 gets from
the same --kv-cache-memory-bytes), attends over it with the native CPU kernels where they
build, and streams complete outputs through the broker."""
from __future__ import annotations

import re

import pytest

from common.client import Client
from common.protocol import GenerateRequest, SamplingParams
from tests.support.engine_helpers import random_prompts
from tests.support.procs import ProcGroup, wait_for_workers
from worker.engine.kernels import load_cpu_kernels

pytestmark = pytest.mark.timeout(180)


def _blocks(log: str) -> int:
    return int(re.search(r"engine ready: .*?, (\d+) KV blocks x", log).group(1))


def test_worker_serves_with_an_fp8_kv_cache(tiny_model, tmp_path):
    path = tiny_model("llama")
    reqs = [GenerateRequest(request_id=str(i), prompt_token_ids=p,
                            params=SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(random_prompts(4, 5, 40, seed=5))]
    logs = {}
    for kv in ("auto", "fp8"):
        with ProcGroup(tmp_path / kv) as procs:
            broker = procs.broker()
            worker = procs.worker(broker, 0, "--model", str(path), "--log-level", "INFO", "--kv-cache-dtype", kv,
                                  "--kv-cache-memory-bytes", str(1 << 20))
            wait_for_workers(broker.frontend, 1, timeout=120)
            with Client(broker.frontend) as client:
                streamed = {r.request_id: [t for d in client.generate(r) for t in d.token_ids] for r in reqs}
            assert all(len(toks) == 10 for toks in streamed.values()), streamed
            logs[kv] = worker.tail(400)
    assert "KV blocks x 16 tokens in torch.float8_e4m3fn" in logs["fp8"], logs["fp8"][-2000:]
    # the kernels read the FP8 cache themselves (without them the worker serves torch SDPA)
    attends = "native (kernels read the FP8 KV cache) attention" if load_cpu_kernels() else "torch attention"
    assert attends in logs["fp8"], logs["fp8"][-2000:]
    assert _blocks(logs["fp8"]) == 4 * _blocks(logs["auto"])  # a byte per value instead of float32's four
