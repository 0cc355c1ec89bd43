"""Writes a step's K/V rows into the paged cache at their slots
(``block_id * block_size + offset``); a negative slot marks a padding row that
must not be written (CUDA-graph batches)."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache, v_cache, slot_mapping,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SATURATE: tl.constexpr = 0.0,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    if SATURATE > 0:  # an FP8 cache: clamp to the format's range, then round (scale 1.0)
        k = tl.clamp(k.to(tl.float32), -SATURATE, SATURATE).to(k_cache.dtype.element_ty)
        v = tl.clamp(v.to(tl.float32), -SATURATE, SATURATE).to(v_cache.dtype.element_ty)
    tl.store(k_cache + block * stride_cb + offset * stride_cs + h * stride_ch + d, k, mask=mask)
    tl.store(v_cache + block * stride_vcb + offset * stride_vcs + h * stride_vch + d, v, mask=mask)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """k, v ``[T, Hkv, D]`` (last dim contiguous) into ``[num_blocks, block_size, Hkv, D]`` caches."""
    t, hkv, d = k.shape
    if k.stride(2) != 1 or v.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("reshape_and_cache needs the head dimension contiguous")
    if t == 0:
        return
    saturate = 0.0
    if k_cache.dtype != k.dtype and k_cache.element_size() == 1:  # an FP8 cache (--kv-cache-dtype)
        saturate = float(torch.finfo(k_cache.dtype).max)
        if _INTERPRETING:
            # Triton 3.9's interpreter rounds fp32 -> FP8 wrongly near binade edges: round
            # in torch (as the GPU's cvt does, saturated) and let the kernel copy the bytes.
            k = k.float().clamp(-saturate, saturate).to(k_cache.dtype)
            v = v.float().clamp(-saturate, saturate).to(v_cache.dtype)
            saturate = 0.0
    _reshape_and_cache_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=hkv, HEAD_DIM=d, HEADS_PAD=triton.next_power_of_2(hkv), HEAD_PAD=triton.next_power_of_2(d),
        BLOCK_SIZE=k_cache.shape[1], SATURATE=saturate)


def compile_specs() -> list:
    specs = []
    for dtype, heads, head_dim, block_size, kv in (("bf16", 8, 128, 16, "bf16"), ("fp32", 2, 80, 1, "fp32"),
                                                   ("bf16", 8, 128, 16, "fp8e4nv")):
        sig = {"k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "k_cache": f"*{kv}", "v_cache": f"*{kv}",
               "slot_mapping": "*i64"}
        for name in ("stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_cb", "stride_cs", "stride_ch",
                     "stride_vcb", "stride_vcs", "stride_vch"):
            sig[name] = "i64"
        const = dict(NUM_KV_HEADS=heads, HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(heads),
                     HEAD_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
                     SATURATE=448.0 if kv == "fp8e4nv" else 0.0)
        kv_name = "" if kv == dtype else f",kv={kv}"
        specs.append((f"reshape_and_cache[{dtype},Hkv={heads},D={head_dim},bs={block_size}{kv_name}]",
                      _reshape_and_cache_kernel, sig, const))
    return specs
