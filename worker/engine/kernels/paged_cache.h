// The paged KV cache as the attention kernels read it: checks on its tensors and
// block tables, the storage types it may hold, and where token t of a sequence lives.
// One layer's K (or V) cache is [blocks, block_size, KVH, D]; a sequence's block table
// lists its blocks in order.
#pragma once

#include <torch/extension.h>

#include <cstdint>

#include "fp8_storage.h"
#include "vec_math.h"

namespace tokserve_kernels {

inline bool is_fp8_dtype(c10::ScalarType t) { return t == torch::kFloat8_e4m3fn || t == torch::kFloat8_e5m2; }

// The cache holds q's dtype (float32 or bfloat16), or FP8 (--kv-cache-dtype) under
// either: K and V of one dtype.
inline void check_kv_cache(const torch::Tensor& k_cache, const torch::Tensor& v_cache, c10::ScalarType q_dtype) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type() && v_cache.is_contiguous(),
              "k_cache/v_cache must be contiguous [blocks, block_size, KVH, D] tensors of one dtype");
  TORCH_CHECK(k_cache.scalar_type() == q_dtype || is_fp8_dtype(k_cache.scalar_type()),
              "k_cache/v_cache must hold q's dtype (", q_dtype, ") or FP8 (float8_e4m3fn / float8_e5m2), not ",
              k_cache.scalar_type());
}

// f(Q{}, C{}) with Q the storage type of q (float / bf16) and C the cache's (Q, or an
// FP8 type): one instantiation of a kernel per pair.  Arguments checked first.
template <typename F>
void dispatch_q_and_cache(c10::ScalarType q_dtype, c10::ScalarType cache_dtype, F&& f) {
  auto with_q = [&](auto q_tag) {
    using Q = decltype(q_tag);
    if (cache_dtype == torch::kFloat8_e4m3fn)
      f(Q{}, fp8_e4m3{});
    else if (cache_dtype == torch::kFloat8_e5m2)
      f(Q{}, fp8_e5m2{});
    else
      f(Q{}, Q{});
  };
  if (q_dtype == torch::kBFloat16)
    with_q(bf16{});
  else
    with_q(float{});
}

inline void check_storage_dtype(c10::ScalarType t, const char* what) {
  TORCH_CHECK(t == torch::kFloat32 || t == torch::kBFloat16, what, " must be float32 or bfloat16");
}

// Every block holding the sequence's seq_len tokens is a real block: checked once
// per call, so the kernels can trust every index.
inline void check_block_ids(const int32_t* table, int64_t seq_len, int64_t block_size, int64_t num_blocks) {
  for (int64_t j = 0; j < (seq_len + block_size - 1) / block_size; ++j)
    TORCH_CHECK(table[j] >= 0 && table[j] < num_blocks, "block id out of range");
}

// Element offset of token t's row (all KV heads, row = KVH * D values) in the cache.
inline int64_t token_offset(const int32_t* table, int64_t t, int64_t block_size, int64_t row) {
  return (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * row;
}

}  // namespace tokserve_kernels
