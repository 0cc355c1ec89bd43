"""``--dtype auto`` as vLLM resolves it (worker/engine/dtype_policy.py), and the KV
cache following the served dtype."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from worker.engine import EngineConfig
from common.dtype_policy import checkpoint_dtype, cpu_has_native_bf16, cpu_runs_bf16_fast, resolve_auto_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("stored,native,want", [
    (torch.float32, True, torch.bfloat16),   # vLLM downcasts fp32 checkpoints
    (torch.float32, False, torch.float32),   # ... but where bf16 would be emulated (slower than fp32): keep fp32
    (torch.bfloat16, True, torch.bfloat16),
    (torch.bfloat16, False, torch.bfloat16),  # the checkpoint's dtype is honoured
    (torch.float16, True, torch.bfloat16),    # no fp16 CPU kernels
    (torch.float16, False, torch.bfloat16),
    (None, True, torch.bfloat16),             # no torch_dtype: float32
])
def test_auto_on_cpu(stored, native, want):
    dtype, why = resolve_auto_dtype(stored, CPU, native_bf16=native)
    assert dtype == want and why


@pytest.mark.parametrize("stored,want", [(torch.float32, torch.bfloat16), (torch.float16, torch.float16),
                                         (torch.bfloat16, torch.bfloat16)])
def test_auto_on_cuda(stored, want):
    assert resolve_auto_dtype(stored, CUDA)[0] == want


def test_native_bf16_flags(monkeypatch):
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    assert cpu_has_native_bf16(frozenset({"avx512f", "avx512_bf16"}))
    assert cpu_has_native_bf16(frozenset({"amx_bf16", "amx_tile"}))
    assert not cpu_has_native_bf16(frozenset({"avx2", "fma", "avx512f"}))
    # AVX2 + FMA runs bf16 fast through the native GEMM's widening path; without them bf16 is emulated
    assert cpu_runs_bf16_fast(frozenset({"avx2", "fma"}))
    assert not cpu_runs_bf16_fast(frozenset({"avx", "sse4_2"}))
    assert cpu_runs_bf16_fast(frozenset({"avx512_bf16"}))


def test_fp32_checkpoint_served_in_bf16_where_bf16_is_fast(llama_dir, caplog):
    """As vLLM: ``auto`` downcasts a float32 checkpoint on a CPU that runs bf16 fast (this
    one, if it has AVX2+FMA or bf16 instructions), and says why in the log."""
    from tests.support.engine_helpers import make_engine

    if not cpu_runs_bf16_fast():
        pytest.skip("this CPU would emulate bf16: auto keeps float32 (covered by test_auto_on_cpu)")
    caplog.set_level(logging.INFO)
    engine = make_engine(llama_dir, dtype="auto")
    assert engine.model_info.dtype == "torch.bfloat16" and engine.runner.kv_cache.dtype == torch.bfloat16
    assert any("float32 checkpoint downcast to bfloat16 as vLLM" in r.getMessage() for r in caplog.records)


def test_checkpoint_dtype_reads_config(tmp_path):
    assert checkpoint_dtype(tmp_path) is None  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert checkpoint_dtype(tmp_path) == torch.bfloat16
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert checkpoint_dtype(tmp_path) == torch.float32


def test_explicit_dtype_wins_and_bad_dtype_refused(llama_bf16_dir):
    assert EngineConfig(model=str(llama_bf16_dir), dtype="float32").torch_dtype == torch.float32
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        EngineConfig(model=str(llama_bf16_dir), dtype="int7")


def test_bf16_checkpoint_served_in_bf16_with_no_flag(llama_bf16_dir, caplog):
    from tests.support.engine_helpers import make_engine

    caplog.set_level(logging.INFO)
    engine = make_engine(llama_bf16_dir, dtype="auto")
    assert engine.model_info.dtype == "torch.bfloat16"
    assert engine.runner.kv_cache.dtype == torch.bfloat16
    assert any("as torch.bfloat16 (checkpoint's torch_dtype bfloat16" in r.getMessage() for r in caplog.records)


def test_kv_blocks_follow_dtype(llama_dir):
    """The same --kv-cache-memory-bytes holds twice the tokens in bf16."""
    from tests.support.engine_helpers import make_engine

    budget = 1 << 20
    blocks = {d: make_engine(llama_dir, dtype=d, kv_cache_memory_bytes=budget).block_manager.num_blocks
              for d in ("float32", "bfloat16")}
    assert blocks["bfloat16"] == 2 * blocks["float32"], blocks
