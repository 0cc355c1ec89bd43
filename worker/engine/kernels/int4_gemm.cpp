// int4 weight-only GEMM (W4A16: AWQ, GPTQ, compressed-tensors pack-quantized) over weights
// kept packed in memory: out = x @ dequant(W).T + bias, with dequant(W)[n, k] =
// (q[n, k] - zero[n, g]) * scale[n, g] for k in group g.
//
// Why: batch-1 decode reads every weight once per token, so its speed is bytes over memory
// bandwidth; an int4 weight is a quarter of bf16's bytes.  Dequantizing at load (what the
// loader otherwise does) keeps the model's quality but not its size or its speed.
//
// Layout (pack_int4_weight, done once in Python): for each block of 8 output columns, one
// int32 word per k whose nibble j is column j's q (unsigned, 0..15): [N/8, K] int32.  A word
// broadcast to 8 lanes, shifted per lane and masked, is the 8 columns' q as a vector.
// scales and zeros: [N/8, G, 8] fp32 (zeros in q units, 8 for symmetric checkpoints).
//
// Arithmetic, per output element and group g: s * (sum_k x[k] * q[k] - z * sum_k x[k]);
// q is an exact small integer in fp32, so the only roundings are the fp32 sums.  Each
// element is accumulated in the same order whatever the row count (rows are tiled over
// the same per-row code), so a row's result does not depend on its batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TOKSERVE_INT4_AVX2 1
#else
#define TOKSERVE_INT4_AVX2 0
#endif

// The per-element order holds under the build's -ffast-math: the sums over k are FMA
// builtins (never reassociated), a row's per-group sum of x is computed once per call by
// the same loop whatever the row count, and each element's two partials meet in one add.

namespace {

constexpr int64_t kCols = 8;   // output columns per packed word
constexpr int kPartials = 2;   // partial sums per element over k (k % 2): independent FMA chains
constexpr int kDecodeBlocks = 4;  // one row: 4 column blocks per pass (8 chains, 32 columns)
constexpr int kTileRows = 4;      // more rows: 4 rows share each unpacked word

#if TOKSERVE_INT4_AVX2
inline __m256 unpack(int32_t word, __m256i shifts, __m256i mask) {
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), mask));
}

// MR rows x NB column blocks (nb <= NB of them real) over all groups.  Each element's
// arithmetic is the same whatever MR and NB are (its own two partial sums over k, then
// s * (dot - z * sx) per group in order), so results are batch-invariant.  sx: the rows'
// per-group sums of x, [MR][G], computed once per call.
template <int MR, int NB>
void tile(const float* x, int64_t K, const int32_t* w, int nb, const float* scales, const float* zeros,
          const float* sx, int64_t G, int64_t group, float* out, int64_t ldo, int64_t cols) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i mask = _mm256_set1_epi32(0xF);
  __m256 total[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) total[r][b] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc[MR][NB][kPartials];
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < NB; ++b)
        for (int p = 0; p < kPartials; ++p) acc[r][b][p] = _mm256_setzero_ps();
    const int64_t k0 = g * group, k1 = k0 + group;
    for (int64_t k = k0; k < k1; k += kPartials) {
      for (int p = 0; p < kPartials; ++p) {
        __m256 q[NB];
        for (int b = 0; b < NB; ++b) q[b] = b < nb ? unpack(w[b * K + k + p], shifts, mask) : _mm256_setzero_ps();
        for (int r = 0; r < MR; ++r) {
          const __m256 xb = _mm256_set1_ps(x[r * K + k + p]);
          for (int b = 0; b < NB; ++b) acc[r][b][p] = _mm256_fmadd_ps(xb, q[b], acc[r][b][p]);
        }
      }
    }
    for (int b = 0; b < nb; ++b) {
      const __m256 s = _mm256_loadu_ps(scales + (b * G + g) * kCols);
      const __m256 z = _mm256_loadu_ps(zeros + (b * G + g) * kCols);
      for (int r = 0; r < MR; ++r) {
        const __m256 dot = _mm256_add_ps(acc[r][b][0], acc[r][b][1]);
        total[r][b] = _mm256_fmadd_ps(s, _mm256_fnmadd_ps(z, _mm256_set1_ps(sx[r * G + g]), dot), total[r][b]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < nb; ++b) {
      alignas(32) float buf[kCols];
      _mm256_store_ps(buf, total[r][b]);
      const int64_t c0 = b * kCols;
      for (int64_t j = 0; j < kCols && c0 + j < cols; ++j) out[r * ldo + c0 + j] = buf[j];
    }
}
#endif

// Portable reference of the same arithmetic (CPUs without AVX2+FMA).
void tile_scalar(const float* x, int64_t K, const int32_t* w, int nb, const float* scales, const float* zeros,
                 const float* sxs, int64_t G, int64_t group, float* out, int64_t ldo, int64_t cols, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r)
    for (int b = 0; b < nb; ++b)
      for (int64_t j = 0; j < kCols && b * kCols + j < cols; ++j) {
        float total = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          float dot = 0.f;
          const float sx = sxs[r * G + g];
          for (int64_t k = g * group; k < (g + 1) * group; ++k) {
            const float q = static_cast<float>((w[b * K + k] >> (4 * j)) & 0xF);
            dot += x[r * K + k] * q;
          }
          total += scales[(b * G + g) * kCols + j] * (dot - zeros[(b * G + g) * kCols + j] * sx);
        }
        out[r * ldo + b * kCols + j] = total;
      }
}

}  // namespace

std::string int4_gemm_isa() { return TOKSERVE_INT4_AVX2 ? "avx2" : "scalar"; }

torch::Tensor int4_linear(const torch::Tensor& x_in, const torch::Tensor& packed, const torch::Tensor& scales,
                          const torch::Tensor& zeros, int64_t group, int64_t n,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && packed.dim() == 2 && packed.scalar_type() == torch::kInt32,
              "int4_linear: x [M, K] and packed [N/8, K] int32 expected");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && zeros.scalar_type() == torch::kFloat32 &&
              scales.is_contiguous() && zeros.is_contiguous(), "int4_linear: fp32 contiguous scales and zeros");
  const auto x = x_in.to(torch::kFloat32).contiguous();
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && group > 0 && K % group == 0 && group % kPartials == 0,
              "int4_linear: K must be the packed weight's and a multiple of the group size");
  TORCH_CHECK(n > 0 && n <= NB * kCols, "int4_linear: n out of range");
  const int64_t G = K / group;
  TORCH_CHECK(scales.numel() == NB * G * kCols && zeros.numel() == NB * G * kCols, "int4_linear: scale shape");
  auto out = torch::empty({M, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const int32_t* wp = packed.data_ptr<int32_t>();
  const float* sp = scales.data_ptr<float>();
  const float* zp = zeros.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Each row's per-group sum of x, once (every column block needs it), in k order.
  std::vector<float> sxs(M * G);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) sum += xp[m * K + k];
      sxs[m * G + g] = sum;
    }
  const float* sxp = sxs.data();
  const int64_t per_task = M == 1 ? kDecodeBlocks : 1;
  const int64_t tasks = (NB + per_task - 1) / per_task;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b0 = t * per_task;
      const int nb = static_cast<int>(NB - b0 < per_task ? NB - b0 : per_task);
      const int64_t c0 = b0 * kCols, cols = n - c0 < nb * kCols ? n - c0 : nb * kCols;
      const int32_t* w = wp + b0 * K;
      const float* s = sp + b0 * G * kCols;
      const float* z = zp + b0 * G * kCols;
#if TOKSERVE_INT4_AVX2
      if (M == 1) {
        tile<1, kDecodeBlocks>(xp, K, w, nb, s, z, sxp, G, group, op + c0, n, cols);
        continue;
      }
      int64_t m = 0;
      for (; m + kTileRows <= M; m += kTileRows)
        tile<kTileRows, 1>(xp + m * K, K, w, nb, s, z, sxp + m * G, G, group, op + m * n + c0, n, cols);
      for (; m < M; ++m) tile<1, 1>(xp + m * K, K, w, nb, s, z, sxp + m * G, G, group, op + m * n + c0, n, cols);
#else
      tile_scalar(xp, K, w, nb, s, z, sxp, G, group, op + c0, n, cols, M);
#endif
    }
  });
  if (bias.has_value() && bias->defined()) out.add_(bias->to(torch::kFloat32));
  return out.to(x_in.scalar_type());
}
