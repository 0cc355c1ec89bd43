// paged_decode_attention: single-token ("decode") attention reading the paged KV
// cache in place: float32, or bfloat16 storage with float32 math (AVX512-BF16 dot
// products where the CPU has them), or an FP8 cache (--kv-cache-dtype) under either q
// dtype, each K / V row widened to float32 once as it streams by (fp8_storage.h).
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
#include <type_traits>
#include <vector>

#include "fp8_storage.h"
#include "paged_cache.h"
#include "vec_math.h"

namespace {

using tokserve_kernels::bf16;
using tokserve_kernels::from_f;
using tokserve_kernels::to_f;

// q . k over D values, float32 accumulation.
inline float dot(const float* a, const float* b, int64_t D) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

inline float dot(const bf16* a, const bf16* b, int64_t D) {
#if defined(__AVX512BF16__)
  // 32 bf16 pairs per instruction, exact products, float32 sums.
  if (D % 32 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a + d), (__m512bh)_mm512_loadu_si512(b + d));
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < D; ++d) s += to_f(a[d]) * to_f(b[d]);
  return s;
}

// acc[0:D] += p * v[0:D], float32 accumulators.
inline void axpy(float p, const float* v, float* acc, int64_t D) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) acc[d] += p * v[d];
}

inline void axpy(float p, const bf16* v, float* acc, int64_t D) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    const __m512 pv = _mm512_set1_ps(p);
    for (int64_t d = 0; d < D; d += 16) {
      // bf16 -> float32: the 16 bits become the high half of the float.
      const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + d))), 16));
      _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pv, x, _mm512_loadu_ps(acc + d)));
    }
    return;
  }
#endif
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) acc[d] += p * to_f(v[d]);
}

// Query rows and K / V rows as the dot products read them.  Where the cache holds q's
// dtype: in place (the float32 and bf16 paths).  Over an FP8 cache: q widened to float32
// once per sequence, each K / V row (all KV heads) once per token into a per-thread
// buffer, so the G query heads sharing a KV head reuse one widening, and the float32
// dot / axpy below do the math.
template <typename T, typename C>
struct RowReader {
  static constexpr bool kWiden = !std::is_same_v<T, C>;
  using Elem = std::conditional_t<kWiden, float, T>;
  std::vector<float> buf;

  const Elem* query(const T* q, int64_t n) {
    if constexpr (kWiden) {
      buf.resize(n);
      for (int64_t i = 0; i < n; ++i) buf[i] = to_f(q[i]);
      return buf.data();
    } else {
      return q;
    }
  }
  const Elem* row(const C* src, int64_t n) {
    if constexpr (kWiden) {
      buf.resize(n);
      tokserve_kernels::widen_row(src, buf.data(), n);
      return buf.data();
    } else {
      return src;
    }
  }
};

template <typename T, typename C>
void decode_impl(const T* qp, const C* kp, const C* vp, T* op, const int32_t* tp, const int32_t* lp, int64_t B,
                 int64_t H, int64_t D, int64_t G, int64_t W, int64_t bs, int64_t row, float sc) {
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(H * D), inv(H);
    RowReader<T, C> q_reader, kv_reader;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t S = lp[b];
      const int32_t* table = tp + b * W;
      const auto* qb = q_reader.query(qp + b * H * D, H * D);  // query head j reads KV head j / G
      scores.resize(H * S);
      for (int64_t t = 0; t < S; ++t) {
        const auto* krow = kv_reader.row(kp + tokserve_kernels::token_offset(table, t, bs, row), row);
        for (int64_t j = 0; j < H; ++j) scores[j * S + t] = dot(qb + j * D, krow + (j / G) * D, D) * sc;
      }
      for (int64_t j = 0; j < H; ++j) inv[j] = tokserve_kernels::softmax_unnormalized(scores.data() + j * S, S);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < S; ++t) {
        const auto* vrow = kv_reader.row(vp + tokserve_kernels::token_offset(table, t, bs, row), row);
        for (int64_t j = 0; j < H; ++j) axpy(scores[j * S + t], vrow + (j / G) * D, acc.data() + j * D, D);
      }
      T* ob = op + b * H * D;
      for (int64_t j = 0; j < H; ++j)
        for (int64_t d = 0; d < D; ++d) ob[j * D + d] = from_f<T>(acc[j * D + d] * inv[j]);
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(const torch::Tensor& q,        // [B, H, D] float32 or bfloat16
                                     const torch::Tensor& k_cache,  // [blocks, block_size, KVH, D], q's dtype or FP8
                                     const torch::Tensor& v_cache,  // [blocks, block_size, KVH, D], k_cache's dtype
                                     const torch::Tensor& block_tables,  // [B, W] int32
                                     const torch::Tensor& seq_lens,      // [B] int32
                                     double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [B, H, D] tensor");
  tokserve_kernels::check_storage_dtype(q.scalar_type(), "q");
  tokserve_kernels::check_kv_cache(k_cache, v_cache, q.scalar_type());
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
  const float sc = static_cast<float>(scale);
  const int64_t row = KVH * D;  // values between consecutive tokens of one block
  tokserve_kernels::dispatch_q_and_cache(q.scalar_type(), k_cache.scalar_type(), [&](auto q_tag, auto c_tag) {
    using Q = decltype(q_tag);
    using C = decltype(c_tag);
    decode_impl(q.data_ptr<Q>(), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), out.data_ptr<Q>(), tp, lp, B, H, D,
                G, W, bs, row, sc);
  });
  return out;
}
