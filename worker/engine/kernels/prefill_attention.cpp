// paged_prefill_attention: causal attention of prefill chunks (many query rows per
// sequence, any cached context before them) over the paged KV cache: float32, or
// bfloat16 storage, or an FP8 cache (--kv-cache-dtype) under either q dtype: every cache
// value is widened to float32 as keys and values are packed, so the GEMMs below never
// see the storage type.
//
// torch's CPU flash SDPA runs this at ~25 GFLOP/s on a 2-core AVX2 box, a third of
// what the same core does in a GEMM, and a chunk with cached context first has to
// gather its keys into one tensor and build a mask.  Here attention is two GEMMs
// run on one register-blocked micro-kernel (6 rows x 16 columns, 12 accumulators:
// enough independent FMAs to keep both FMA pipes busy):
//   1. per (sequence, KV head): its keys packed transposed, K^T [D, S], and its
//      values packed [S, D], straight from their blocks (zero-padded to 16 keys);
//   2. per (sequence, query head, block of query rows): S = (q * scale) K^T over
//      the keys the block can see (tiles right of the causal diagonal skipped),
//      an exact softmax per row (lower-right causal: row i of a chunk after c
//      cached tokens sees keys 0..c+i), then O = P V, normalised, written out.
// Scores of a block live in a per-thread buffer (rows x keys); the row block shrinks
// for long contexts so the buffer stays within ~256 KB.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "fp8_storage.h"
#include "paged_cache.h"
#include "vec_math.h"

namespace {

using tokserve_kernels::from_f;
using tokserve_kernels::to_f;

constexpr int64_t MR = 6;   // rows of the micro-kernel
constexpr int64_t NR = 16;  // columns of the micro-kernel (two AVX2 vectors)

// C[MR x NR] (+)= A[MR x K] * B[K x NR]; A and B row-major with strides lda / ldb.
inline void gemm_tile(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t K, float* C, int64_t ldc,
                      bool accumulate) {
#if defined(__AVX2__) && defined(__FMA__)
  __m256 c[MR][2];
  for (int64_t r = 0; r < MR; ++r)
    for (int64_t h = 0; h < 2; ++h)
      c[r][h] = accumulate ? _mm256_loadu_ps(C + r * ldc + 8 * h) : _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb), b1 = _mm256_loadu_ps(B + k * ldb + 8);
    for (int64_t r = 0; r < MR; ++r) {  // unrolled by the compiler: MR is a constant
      const __m256 a = _mm256_broadcast_ss(A + r * lda + k);
      c[r][0] = _mm256_fmadd_ps(a, b0, c[r][0]);
      c[r][1] = _mm256_fmadd_ps(a, b1, c[r][1]);
    }
  }
  for (int64_t r = 0; r < MR; ++r)
    for (int64_t h = 0; h < 2; ++h) _mm256_storeu_ps(C + r * ldc + 8 * h, c[r][h]);
#else
  float c[MR][NR];
  for (int64_t r = 0; r < MR; ++r)
    for (int64_t j = 0; j < NR; ++j) c[r][j] = accumulate ? C[r * ldc + j] : 0.f;
  for (int64_t k = 0; k < K; ++k)
    for (int64_t r = 0; r < MR; ++r) {
      const float a = A[r * lda + k];
#pragma omp simd
      for (int64_t j = 0; j < NR; ++j) c[r][j] += a * B[k * ldb + j];
    }
  for (int64_t r = 0; r < MR; ++r)
    for (int64_t j = 0; j < NR; ++j) C[r * ldc + j] = c[r][j];
#endif
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The work of paged_prefill_attention once its arguments are checked: T is the
// storage type of q and out, C the cache's (T, or FP8); keys, values and scores are
// float32 in the packed buffers, so both GEMMs run on the float32 micro-kernel.
template <typename T, typename C>
void prefill_impl(const T* qp, const C* kp, const C* vp, T* op, int64_t qs_t, int64_t qs_h, const int32_t* tp,
                  const int32_t* lp, const int32_t* sp, const int64_t* wp, const std::vector<int64_t>& pack_off,
                  int64_t N, int64_t H, int64_t D, int64_t G, int64_t W, int64_t bs, int64_t KVH, float scale) {
  const int64_t row = KVH * D;  // values between consecutive tokens of one block
  // Uninitialised: packing writes every element (padding included).
  std::unique_ptr<float[]> kt_buf(new float[pack_off[N]]), v_buf(new float[pack_off[N]]);
  float* ktp = kt_buf.get();
  float* vbp = v_buf.get();

  // 1. Pack K^T [D, Sp] and V [Sp, D] per (sequence, KV head).
  at::parallel_for(0, N * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> krow(tokserve_kernels::is_fp8<C> ? D : 0);  // an FP8 key row, widened before its transposed store
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / KVH, h = task % KVH, b = wp[n], S = lp[b], Sp = round_up(S, NR);
      float* kt = ktp + pack_off[n] + h * Sp * D;
      float* vv = vbp + pack_off[n] + h * Sp * D;
      const int32_t* table = tp + b * W;
      for (int64_t t = 0; t < S; ++t) {
        const int64_t off = tokserve_kernels::token_offset(table, t, bs, row) + h * D;
        const C* k = kp + off;
        const C* v = vp + off;
        if constexpr (tokserve_kernels::is_fp8<C>) {
          tokserve_kernels::widen_row(k, krow.data(), D);
          for (int64_t d = 0; d < D; ++d) kt[d * Sp + t] = krow[d];
          tokserve_kernels::widen_row(v, vv + t * D, D);
        } else {
          for (int64_t d = 0; d < D; ++d) kt[d * Sp + t] = to_f(k[d]);
          for (int64_t d = 0; d < D; ++d) vv[t * D + d] = to_f(v[d]);
        }
      }
      for (int64_t d = 0; d < D; ++d) std::fill(kt + d * Sp + S, kt + d * Sp + Sp, 0.f);
      std::fill(vv + S * D, vv + Sp * D, 0.f);
    }
  });

  // 2. Tasks: (sequence, query head, block of query rows).
  constexpr int64_t kScoreFloats = 64 * 1024;  // ~256 KB of scores per block
  struct Task {
    int64_t n, h, r0, rows;
  };
  std::vector<Task> tasks;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t b = wp[n], qlen = sp[b + 1] - sp[b];
    const int64_t rb = std::clamp<int64_t>(kScoreFloats / round_up(lp[b], NR) / MR * MR, MR, 8 * MR);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r0 = 0; r0 < qlen; r0 += rb) tasks.push_back({n, h, r0, std::min(rb, qlen - r0)});
  }
  const float sc = scale;
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qbuf, sbuf, obuf, inv;
    for (int64_t ti = begin; ti < end; ++ti) {
      const Task& tk = tasks[ti];
      const int64_t b = wp[tk.n], S = lp[b], Sp = round_up(S, NR), qlen = sp[b + 1] - sp[b];
      const int64_t ctx = S - qlen, kvh = tk.h / G;
      const float* kt = ktp + pack_off[tk.n] + kvh * Sp * D;
      const float* vv = vbp + pack_off[tk.n] + kvh * Sp * D;
      const int64_t R = round_up(tk.rows, MR);  // padded rows: computed, never written
      // Keys the block can see (its last row's), and each row tile's.
      const int64_t ld = std::min(Sp, round_up(ctx + tk.r0 + R, NR));
      auto tile_keys = [&](int64_t rt) { return std::min(S, ctx + tk.r0 + rt + MR); };
      qbuf.assign(R * D, 0.f);
      sbuf.resize(R * ld);
      obuf.resize(R * D);
      inv.resize(R);
      for (int64_t r = 0; r < tk.rows; ++r) {
        const T* src = qp + (sp[b] + tk.r0 + r) * qs_t + tk.h * qs_h;
        for (int64_t d = 0; d < D; ++d) qbuf[r * D + d] = to_f(src[d]) * sc;
      }
      // S = Q K^T, key tile outer so a K^T tile stays in L1 across the row tiles.
      for (int64_t j0 = 0; j0 < ld; j0 += NR)
        for (int64_t rt = 0; rt < R; rt += MR)
          if (j0 < tile_keys(rt))  // tiles right of the diagonal: never read
            gemm_tile(qbuf.data() + rt * D, D, kt + j0, Sp, D, sbuf.data() + rt * ld + j0, ld, false);
      // Exact softmax per row; keys past a row's causal limit get weight 0 up to its tile's end.
      for (int64_t r = 0; r < R; ++r) {
        float* s = sbuf.data() + r * ld;
        const int64_t rt = r / MR * MR, width = tile_keys(rt);
        const int64_t lim = r < tk.rows ? ctx + tk.r0 + r + 1 : 0;
        inv[r] = lim ? tokserve_kernels::softmax_unnormalized(s, lim) : 0.f;
        std::fill(s + lim, s + width, 0.f);
      }
      // O = P V.
      if (D % NR == 0) {
        for (int64_t rt = 0; rt < R; rt += MR)
          for (int64_t c0 = 0; c0 < D; c0 += NR)
            gemm_tile(sbuf.data() + rt * ld, ld, vv + c0, D, tile_keys(rt), obuf.data() + rt * D + c0, D, false);
      } else {
        for (int64_t r = 0; r < R; ++r) {
          float* o = obuf.data() + r * D;
          std::fill(o, o + D, 0.f);
          const float* p = sbuf.data() + r * ld;
          for (int64_t j = 0; j < tile_keys(r / MR * MR); ++j)
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) o[d] += p[j] * vv[j * D + d];
        }
      }
      for (int64_t r = 0; r < tk.rows; ++r) {
        T* dst = op + ((sp[b] + tk.r0 + r) * H + tk.h) * D;
        const float* o = obuf.data() + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] = from_f<T>(o[d] * inv[r]);
      }
    }
  });
}

}  // namespace

void paged_prefill_attention(const torch::Tensor& q,             // [T, H, D] float32 / bfloat16, head vectors contiguous
                             const torch::Tensor& k_cache,       // [blocks, block_size, KVH, D], q's dtype or FP8
                             const torch::Tensor& v_cache,       // [blocks, block_size, KVH, D], k_cache's dtype
                             const torch::Tensor& block_tables,  // [B, W] int32
                             const torch::Tensor& seq_lens,      // [B] int32
                             const torch::Tensor& query_start,   // [B + 1] int32: rows of each sequence in q
                             const torch::Tensor& seqs,          // [N] int64: the sequences to compute
                             double scale,
                             torch::Tensor out) {                // [T, H, D] q's dtype, contiguous; rows of seqs written
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, H, D] with contiguous head vectors");
  tokserve_kernels::check_storage_dtype(q.scalar_type(), "q");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.is_contiguous(),
              "out must be a contiguous tensor shaped like q, of q's dtype");
  tokserve_kernels::check_kv_cache(k_cache, v_cache, q.scalar_type());
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == torch::kInt32 && seq_lens.dim() == 1 &&
                  seq_lens.scalar_type() == torch::kInt32 && query_start.dim() == 1 &&
                  query_start.scalar_type() == torch::kInt32 && seqs.dim() == 1 &&
                  seqs.scalar_type() == torch::kInt64,
              "block_tables int32 [B, W], seq_lens int32 [B], query_start int32 [B + 1], seqs int64 [N]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && KVH > 0 && H % KVH == 0, "head shapes of q and the cache disagree");
  const int64_t B = seq_lens.size(0);
  TORCH_CHECK(block_tables.size(0) == B && query_start.size(0) == B + 1, "one block table and length per sequence");
  const torch::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous(), qsl = query_start.contiguous(),
                      which = seqs.contiguous();
  const int64_t G = H / KVH, W = tables.size(1), N = which.size(0);
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* sp = qsl.data_ptr<int32_t>();
  const int64_t* wp = which.data_ptr<int64_t>();

  // Validate every index once, so the loops below can trust them.
  std::vector<int64_t> pack_off(N + 1, 0);  // float offset of each sequence's packed K^T / V per KV head
  for (int64_t n = 0; n < N; ++n) {
    const int64_t b = wp[n];
    TORCH_CHECK(b >= 0 && b < B, "sequence index out of range");
    const int64_t start = sp[b], qlen = sp[b + 1] - sp[b], S = lp[b];
    TORCH_CHECK(qlen >= 1 && start >= 0 && start + qlen <= T, "query rows out of range of q");
    TORCH_CHECK(S >= qlen && S <= W * bs, "seq_len shorter than its query rows or longer than its block table");
    tokserve_kernels::check_block_ids(tp + b * W, S, bs, num_blocks);
    pack_off[n + 1] = pack_off[n] + KVH * round_up(S, NR) * D;
  }
  if (N == 0) return;

  const float sc = static_cast<float>(scale);
  tokserve_kernels::dispatch_q_and_cache(q.scalar_type(), k_cache.scalar_type(), [&](auto q_tag, auto c_tag) {
    using Q = decltype(q_tag);
    using C = decltype(c_tag);
    prefill_impl(q.data_ptr<Q>(), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), out.data_ptr<Q>(), q.stride(0),
                 q.stride(1), tp, lp, sp, wp, pack_off, N, H, D, G, W, bs, KVH, sc);
  });
}
