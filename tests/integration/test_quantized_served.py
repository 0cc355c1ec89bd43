"""Quantized checkpoints served by the real stack (broker, a `tokserve worker`, the
gateway over HTTP): an AutoAWQ, a compressed-tensors int4, an FP8 (128x128-style blocks), an
act-order GPTQ Mixtral (its experts int4 too) and a GPT-OSS MXFP4 checkpoint stream the
greedy tokens HF transformers computes with their dequantized weights, and the worker
says what it loaded and how it runs it (int4 kept int4 in memory on CPU)."""
from __future__ import annotations

import httpx
import pytest
import torch

from tests.support import quantized_factory as qf
from tests.support.engine_helpers import random_prompts
from tests.support.gateway_helpers import GENERATE, start_gateway
from tests.support.procs import ProcGroup, wait_for_workers

pytestmark = pytest.mark.timeout(240)


def _hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("fmt", ["awq", "compressed-tensors", "fp8", "gptq_moe", "mxfp4"])
def test_quantized_checkpoint_served_over_http(tiny_model, tmp_path, fmt):
    src = tiny_model({"mxfp4": "gpt_oss", "gptq_moe": "mixtral"}.get(fmt, "llama"))
    if fmt == "fp8":  # dequantized at load on CPU (no FP8 dot products)
        path = qf.write_fp8_block(src, tmp_path / "fp8")
        ref = qf.load_dequantized_reference(path)
        described = "fp8 (fp8 8-bit, block 32x32)"
    elif fmt == "gptq_moe":
        path, dense = qf.write_gptq(src, tmp_path / "gptq", sym=False, act_order=True)
        ref = qf.reference_with_weights(src, dense)
        described = "gptq (gptq 4-bit, group 32)"
    elif fmt == "mxfp4":  # GPT-OSS's released expert layout, dequantized on load
        path, dense = qf.write_mxfp4(src, tmp_path / "mxfp4")
        ref = qf.reference_with_weights(src, dense)
        described = "mxfp4 (mxfp4 4-bit, group 32)"
    elif fmt == "awq":
        path, dense = qf.write_awq(src, tmp_path / "awq")
        ref = qf.reference_with_weights(src, dense)
        described = "awq (awq 4-bit, group 32)"
    else:
        pytest.importorskip("compressed_tensors", reason="compressed-tensors is in the [test] extra")
        path = qf.write_compressed_tensors(src, tmp_path / "ct", "w4a16")
        ref = qf.load_dequantized_reference(path)
        described = "compressed-tensors (packed 4-bit, group 32)"
    prompts = random_prompts(3, 5, 30, seed=7)
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker()
        # vLLM users pass the method (or its Marlin alias) explicitly: accepted when it is the checkpoint's
        arg = {"awq": ["--quantization", "awq_marlin"], "mxfp4": ["--quantization", "mxfp4"]}.get(fmt, [])
        procs.worker(broker, 0, "--model", str(path), "--log-level", "INFO", *arg)
        wait_for_workers(broker.frontend, 1, timeout=120)
        gw = start_gateway(procs, broker.frontend)
        got = []
        for p in prompts:
            r = httpx.post(gw.url + GENERATE, json={"token_ids": p, "sampling_params": {
                "max_tokens": 10, "temperature": 0, "ignore_eos": True}}, timeout=60)
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["token_ids"])
        log = procs.tails()
    assert got == [_hf_greedy(ref, p, 10) for p in prompts]
    assert f"quantized checkpoint: {described}" in log, log[-3000:]
    if fmt not in ("mxfp4", "fp8"):  # int4 checkpoints stay int4 in memory on CPU by default (kernels built here)
        assert "weight(s) (projections, expert stacks) kept quantized in memory (" in log and \
            "int4 layers kept int4 (CPU W4A16 GEMM)" in log, log[-3000:]


def test_worker_refuses_a_quantization_argument_the_checkpoint_does_not_have(tiny_model, tmp_path):
    path, _ = qf.write_awq(tiny_model("llama"), tmp_path / "awq")
    with ProcGroup(tmp_path) as procs:
        broker = procs.broker()
        worker = procs.worker(broker, 0, "--model", str(path), "--quantization", "fp8")
        from tests.support.procs import wait_for
        wait_for(lambda: not worker.alive(), 120, "the worker to exit")
        assert "Quantization method specified in the model config (awq) does not match" in worker.tail()
