// The paged KV cache as the attention kernels read it: checks on its tensors and
// block tables, and where token t of a sequence lives.  One layer's K (or V) cache is
// [blocks, block_size, KVH, D]; a sequence's block table lists its blocks in order.
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace tokserve_kernels {

// The cache holds q's dtype (float32 or bfloat16).
inline void check_kv_cache(const torch::Tensor& k_cache, const torch::Tensor& v_cache, c10::ScalarType dtype) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == dtype && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == dtype && v_cache.is_contiguous(),
              "k_cache/v_cache must be contiguous [blocks, block_size, KVH, D] tensors of q's dtype");
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

// Float offset of token t's row (all KV heads, row = KVH * D floats) in the cache.
inline int64_t token_offset(const int32_t* table, int64_t t, int64_t block_size, int64_t row) {
  return (static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size) * row;
}

}  // namespace tokserve_kernels
