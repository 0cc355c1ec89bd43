"""A real `tokserve worker` on a bf16 checkpoint with no --dtype flag serves it in
bfloat16 (the broker's INFO reports the worker's dtype) on the linears ``auto`` picks
for bf16 on this CPU (the native bf16 GEMM unless the CPU has AMX: its log says so), and
streams the same tokens as the engine run in-process in bf16."""
from __future__ import annotations

import pytest

from common.client import Client
from common.protocol import GenerateRequest, SamplingParams
from tests.support.engine_helpers import random_prompts
from tests.support.procs import ProcGroup, Proc, wait_for_workers

pytestmark = pytest.mark.timeout(180)


def test_worker_serves_bf16_checkpoint_in_bf16_with_no_flag(llama_bf16_dir, tmp_path):
    reqs = [GenerateRequest(request_id=str(i), prompt_token_ids=p,
                            params=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(random_prompts(6, 5, 50, seed=11))]
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker()
        # Not procs.worker(): it pins --dtype float32 for the fp32 parity tests.
        worker = Proc("worker0", ["-m", "common.cli", "worker", "--broker", broker.backend, "--rank", "0",
                                  "--model", str(llama_bf16_dir), "--threads", "1", "--num-kv-blocks", "64", "--log-level", "INFO"],
                      tmp_path / "worker0.log")
        procs.procs.append(worker)
        try:
            info = wait_for_workers(broker.frontend, 1, timeout=120)
        except TimeoutError:
            pytest.fail("worker did not register\n" + procs.tails())
        assert info.model is not None and info.model.dtype == "torch.bfloat16"
        with Client(broker.frontend) as client:
            streamed = {r.request_id: [t for d in client.generate(r) for t in d.token_ids] for r in reqs}
    log = (tmp_path / "worker0.log").read_text()
    assert "as torch.bfloat16 (checkpoint's torch_dtype bfloat16" in log
    import torch

    from worker.engine.models.cpu_gemm import resolve_cpu_linear

    linears = resolve_cpu_linear("auto", torch.device("cpu"), torch.bfloat16)
    assert f"torch.bfloat16, {linears} linears" in log, log[-2000:]
    # The "bf16 is emulated, use float32" advice only where no bf16 GEMM was found.
    assert ("emulated path" in log) == (linears == "torch"), log[-2000:]

    from worker.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=str(llama_bf16_dir), num_threads=1, num_kv_blocks=64))
    expected = engine.generate(reqs)
    assert engine.model_info.dtype == "torch.bfloat16"
    assert streamed == {rid: list(ds[0].token_ids) for rid, ds in expected.items()}
