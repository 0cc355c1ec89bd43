"""Choosing the attention backend, and sizing the KV cache from device memory."""
from __future__ import annotations

import pytest
import torch

from worker.engine.attention.backends.torch_sdpa import TorchPlan, TorchSDPABackend
from worker.engine.attention.selector import resolve_attention_backend
from worker.engine.config import EngineConfig
from worker.engine.runner.model_runner import MAX_KV_BLOCKS, kv_blocks_for_memory

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
GIB = 1 << 30


def test_cpu_auto_follows_cpu_attention(monkeypatch):
    assert resolve_attention_backend("auto", "torch", CPU, torch.float32, 16).name == "torch"
    assert resolve_attention_backend("torch", "native", CPU, torch.float32, 16).name == "torch"
    # The compiled kernels serve float32 and bfloat16; float16: auto falls back, explicit refuses.
    from worker.engine.kernels import load_cpu_kernels

    native = "native" if load_cpu_kernels() is not None else "torch"
    assert resolve_attention_backend("auto", "auto", CPU, torch.bfloat16, 16).name == native
    assert resolve_attention_backend("auto", "auto", CPU, torch.float16, 16).name == "torch"
    with pytest.raises(ValueError, match="needs dtype float32 or bfloat16"):
        resolve_attention_backend("native", "auto", CPU, torch.float16, 16)


def test_explicit_choices_that_cannot_serve_are_errors(monkeypatch):
    with pytest.raises(ValueError, match="cannot serve a CUDA device"):
        resolve_attention_backend("native", "auto", CUDA, torch.bfloat16, 16)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs TRITON_INTERPRET=1"):
        resolve_attention_backend("triton", "auto", CPU, torch.float32, 16)
    with pytest.raises(ValueError, match="attention_backend=flash_attn"):
        resolve_attention_backend("flash_attn", "auto", CPU, torch.float32, 16)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(model="x", attention_backend="flashinfer2")


def test_cuda_auto_prefers_triton_then_flash_then_sdpa(monkeypatch):
    import worker.engine.attention.selector as selector

    sentinel = object()
    monkeypatch.setattr(selector, "_triton_kernels", lambda: sentinel)
    backend = resolve_attention_backend("auto", "auto", CUDA, torch.bfloat16, 16)
    assert backend.name == "triton" and backend.kernels is sentinel and backend.supports_cuda_graphs
    monkeypatch.setattr(selector, "_triton_kernels", lambda: None)
    with pytest.raises(ValueError, match="triton package is not installed"):
        resolve_attention_backend("triton", "auto", CUDA, torch.bfloat16, 16)
    # Without Triton or FlashAttention (this machine), auto on CUDA is SDPA and captures no graphs.
    backend = resolve_attention_backend("auto", "auto", CUDA, torch.bfloat16, 16)
    assert backend.name == "torch" and not backend.supports_cuda_graphs


def test_runner_plans_once_per_step(llama_dir):
    from tests.support.engine_helpers import make_engine, request

    engine = make_engine(llama_dir, cpu_attention="torch")
    seen = []
    orig = engine.runner.backend.plan

    def plan(attn, block_size):
        p = orig(attn, block_size)
        seen.append(p)
        return p

    engine.runner.backend.plan = plan
    engine.generate([request("a", [5, 6, 7, 8], max_tokens=3, ignore_eos=True)])
    assert len(seen) == 3 and all(isinstance(p, TorchPlan) for p in seen)  # one prefill + two decodes


def test_kv_blocks_for_memory_counts_everything_on_the_device():
    per_block = 1 << 20
    # 80 GiB device at 0.9: 72 GiB budget; 20 GiB in use (weights, context, another process),
    # 4 GiB activations, 1 GiB graphs, 1 GiB sampler -> 46 GiB of blocks.
    n = kv_blocks_for_memory(total=80 * GIB, free=60 * GIB, activations=4 * GIB, graph_pool=GIB, sampler=GIB,
                             utilization=0.9, per_block=per_block)
    assert n == 46 * GIB // per_block
    # Another process taking 30 GiB more leaves 30 GiB fewer blocks.
    m = kv_blocks_for_memory(total=80 * GIB, free=30 * GIB, activations=4 * GIB, graph_pool=GIB, sampler=GIB,
                             utilization=0.9, per_block=per_block)
    assert n - m == 30 * GIB // per_block
    with pytest.raises(RuntimeError, match="no memory left for the KV cache at gpu_memory_utilization=0.5"):
        kv_blocks_for_memory(total=80 * GIB, free=30 * GIB, activations=4 * GIB, graph_pool=GIB, sampler=GIB,
                             utilization=0.5, per_block=per_block)
    # A tiny model on a big device: the count is capped so block bookkeeping stays small.
    assert kv_blocks_for_memory(total=141 * GIB, free=140 * GIB, activations=0, graph_pool=0, sampler=0,
                                utilization=0.9, per_block=1024) == MAX_KV_BLOCKS


def test_kv_cache_memory_bytes_sizes_the_cache(llama_dir):
    from tests.support.engine_helpers import make_engine
    from worker.engine.models import kv_bytes_per_block

    engine = make_engine(llama_dir, kv_cache_memory_bytes=300 * 1024)
    per_block = kv_bytes_per_block(engine.model_config, engine.config.block_size, torch.float32)
    assert engine.block_manager.num_blocks == 300 * 1024 // per_block
    with pytest.raises(ValueError, match="kv_cache_memory_bytes must be >= 1"):
        EngineConfig(model=str(llama_dir), kv_cache_memory_bytes=0)


def test_torch_backend_is_never_graph_captured():
    assert not TorchSDPABackend.supports_cuda_graphs


def test_kv_blocks_for_memory_reserves_vision_peak_and_encoder_cache():
    per_block = 1 << 20
    kw = dict(total=80 * GIB, free=60 * GIB, graph_pool=GIB, sampler=GIB, utilization=0.9, per_block=per_block)
    base = kv_blocks_for_memory(activations=4 * GIB, **kw)
    assert base == 46 * GIB // per_block
    # The encoder cache (16384 rows x 3584 hidden x bf16 = 112 MiB) is reserved outright.
    cache = 16384 * 3584 * 2
    assert kv_blocks_for_memory(activations=4 * GIB, encoder_cache=cache, **kw) == (46 * GIB - cache) // per_block
    # The vision tower's peak replaces the step's when larger (images are encoded before the LM forward) ...
    assert kv_blocks_for_memory(activations=4 * GIB, vision=6 * GIB, **kw) == 44 * GIB // per_block
    # ... and changes nothing when smaller.
    assert kv_blocks_for_memory(activations=4 * GIB, vision=3 * GIB, **kw) == base
    assert kv_blocks_for_memory(activations=4 * GIB, vision=6 * GIB, encoder_cache=cache, **kw) == \
        (44 * GIB - cache) // per_block
    with pytest.raises(RuntimeError, match="vision tower 50.00 GiB .* encoder cache 0.11 GiB"):
        kv_blocks_for_memory(activations=4 * GIB, vision=50 * GIB, encoder_cache=cache, **kw)


def test_flash_attn_refuses_attention_sinks_by_name(monkeypatch):
    """GPT-OSS's sinks: an explicit flash_attn is an error naming them; auto on CUDA takes
    Triton (which has them) or SDPA, never FlashAttention."""
    import worker.engine.attention.backends.flash_attn as flash
    import worker.engine.attention.selector as selector
    from worker.engine.attention.backends.base import AttentionSpec

    monkeypatch.setattr(flash, "load_flash_varlen", lambda: (object(), 16, True))
    assert resolve_attention_backend("flash_attn", "auto", CUDA, torch.bfloat16, 16).name == "flash_attn"
    with pytest.raises(ValueError, match="no attention sinks"):
        resolve_attention_backend("flash_attn", "auto", CUDA, torch.bfloat16, 16, sinks=True)
    monkeypatch.setattr(selector, "_triton_kernels", lambda: None)
    assert resolve_attention_backend("auto", "auto", CUDA, torch.bfloat16, 16, sinks=True).name == "torch"
    backend = flash.FlashAttnBackend((object(), 16, True))
    with pytest.raises(ValueError, match="attention sinks"):
        backend.make_impl(AttentionSpec(4, 2, 16, sinks=True))
