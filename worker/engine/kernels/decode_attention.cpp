// paged_decode_attention: single-token ("decode") attention reading the paged KV
// cache in place, float32.
//
// torch's SDPA needs each sequence's keys gathered into one tensor first; this reads
// them straight from their blocks.  One task per sequence: all query heads are
// scored against each token's K row (every KV head, contiguous in the block) as it
// streams by, so each K and V row is loaded once per step, in token order.  Two
// passes over the keys (scores, then softmax-weighted values) with the scores in a
// per-thread buffer.
//
// Decode attention is bound by reading K and V from memory.  Measured on the
// engine's layout (2-core AVX2 EPYC): this plain token-order walk beat a version
// with 8-key register-blocked dot products, value accumulators held in registers
// across 32-key chunks and software prefetch (1.3 vs 2.2 ms per layer at 32 x 580):
// the blocked loops touched each row in column strips and lost the hardware
// prefetcher's sequential stream.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "paged_cache.h"
#include "vec_math.h"

torch::Tensor paged_decode_attention(const torch::Tensor& q,        // [B, H, D] float32
                                     const torch::Tensor& k_cache,  // [blocks, block_size, KVH, D]
                                     const torch::Tensor& v_cache,  // [blocks, block_size, KVH, D]
                                     const torch::Tensor& block_tables,  // [B, W] int32
                                     const torch::Tensor& seq_lens,      // [B] int32
                                     double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(),
              "q must be a contiguous float32 [B, H, D] tensor");
  tokserve_kernels::check_kv_cache(k_cache, v_cache);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == torch::kInt32 &&
                  seq_lens.dim() == 1 && seq_lens.scalar_type() == torch::kInt32,
              "block_tables must be int32 [B, W] and seq_lens int32 [B]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && KVH > 0 && H % KVH == 0, "head shapes of q and the cache disagree");
  TORCH_CHECK(block_tables.size(0) == B && seq_lens.size(0) == B, "one block table and length per row");
  const torch::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  const int64_t G = H / KVH, W = tables.size(1);
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {  // bounds once, so the kernel can trust every index
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= W * bs, "seq_len out of range of its block table");
    tokserve_kernels::check_block_ids(tp + b * W, lp[b], bs, num_blocks);
  }
  torch::Tensor out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t row = KVH * D;  // floats between consecutive tokens of one block

  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(H * D), inv(H);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t S = lp[b];
      const int32_t* table = tp + b * W;
      const float* qb = qp + b * H * D;  // query head j reads KV head j / G
      scores.resize(H * S);
      for (int64_t t = 0; t < S; ++t) {
        const float* krow = kp + tokserve_kernels::token_offset(table, t, bs, row);
        for (int64_t j = 0; j < H; ++j) {
          const float* qj = qb + j * D;
          const float* k = krow + (j / G) * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qj[d] * k[d];
          scores[j * S + t] = s * sc;
        }
      }
      for (int64_t j = 0; j < H; ++j) inv[j] = tokserve_kernels::softmax_unnormalized(scores.data() + j * S, S);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < S; ++t) {
        const float* vrow = vp + tokserve_kernels::token_offset(table, t, bs, row);
        for (int64_t j = 0; j < H; ++j) {
          const float p = scores[j * S + t];
          const float* v = vrow + (j / G) * D;
          float* a = acc.data() + j * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
        }
      }
      float* ob = op + b * H * D;
      for (int64_t j = 0; j < H; ++j)
        for (int64_t d = 0; d < D; ++d) ob[j * D + d] = acc[j * D + d] * inv[j];
    }
  });
  return out;
}
