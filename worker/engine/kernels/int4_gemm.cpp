// int4 weight-only GEMM (W4A16: AWQ, GPTQ, compressed-tensors pack-quantized) over weights
// kept packed in memory: out = x @ dequant(W).T + bias, with dequant(W)[n, k] =
// (q[n, k] - zero[n, g]) * scale[n, g] for k in group g.
//
// Why: batch-1 decode reads every weight once per token, so its speed is bytes over memory
// bandwidth; an int4 weight is a quarter of bf16's bytes.  Dequantizing at load (what the
// loader otherwise does) keeps the model's quality but not its size or its speed.
//
// Layout (pack_int4 in quantization/int4_cpu.py): for each block of 8 output columns and
// each run of 8 consecutive k, one 256-bit vector: 32-bit lane j is column j, its nibble i
// is k0 + i.  Stored as [N/8, K] int32 (K/8 vectors of 8 lanes per block).  scales:
// [N/8, G, 8] fp32; zeros: [N/8, G, 8] uint8 in q units (8 for symmetric checkpoints), a
// byte rather than a float so that at group 32 the weight stays under 0.35x bf16's bytes.
//
// Why this layout (AVX2 has no int4 or bf16 dot products, so unpacking is the cost): one
// load brings 64 weights; nibble i is taken out with one AND against the constant mask
// 0xF << 4i, with no shift: the lane then holds q * 16^i, which converts to fp32 exactly,
// and the row's x[k] was scaled by 16^-i once per call (a power of two: x * 16^-i * q *
// 16^i == x * q exactly, barring underflow of activations below 1e-31).  Nibble 7 is one
// logical shift instead (q << 28 would not fit a signed lane).  So each 8 weights cost an
// AND, a convert and, per row, an FMA: at one row that keeps up with memory, at more rows
// the unpacking is shared by up to 4 rows and the FMAs dominate, as in the bf16 GEMM.
//
// Arithmetic, per output element and group g: s * (sum_k x[k] * q[k] - z * sum_k x[k]),
// the zero point factored out of the inner loop (a row's per-group sum of x is computed
// once per call).  q is an exact small integer in fp32, so the only roundings are the fp32
// sums: the result is within fp32 rounding of x @ dequant(W).T computed in fp32.
//
// Batch invariance: every element accumulates over k in the same order whatever the row
// count or tile shape: one fp32 sum per group in k order, folded into the element's total
// group by group (independent FMA chains come from the tile's 8 elements, not from
// splitting an element's sum).  Rows are tiled over the
// same per-element code, so a row's result does not depend on the rows beside it.  The
// order holds under the build's -ffast-math: the sums are FMA intrinsics, which the
// compiler does not reassociate, and the per-row preparation is the same loop for any M.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TOKSERVE_INT4_AVX2 1
#else
#define TOKSERVE_INT4_AVX2 0
#endif

namespace {

constexpr int64_t kCols = 8;  // output columns per block (one 32-bit lane each)
constexpr int64_t kRun = 8;   // consecutive k per lane (one nibble each)
constexpr int kTaskBlocks = 8;  // column blocks per parallel task (64 columns)
constexpr int kMaxRows = 4;     // rows per tile: they share each unpacked vector
constexpr int64_t kTileCols = kTaskBlocks * kCols;  // a tile's totals per row (at most)

// x[k] * 16^-(k % 8) (nibble 7: unscaled, it is shifted down instead): what the FMA meets.
inline float nibble_scale(int64_t i) { return i == 7 ? 1.0f : 1.0f / static_cast<float>(1u << (4 * i)); }

#if TOKSERVE_INT4_AVX2
// MR rows x NB column blocks over all groups, into tot[MR][NB * kCols] (fp32 totals).
// MR * NB = 8 accumulators (1x8, 2x4, 4x2): enough independent FMA chains to hide the FMA
// latency, and each x broadcast serves NB blocks, each unpacked vector MR rows.  The
// block's vector is re-read from L1 per nibble (a memory operand of the AND) rather than
// held: 8 blocks' vectors would not fit the 16 ymm registers beside the accumulators.
template <int MR, int NB>
void tile(const float* xs, int64_t ldx, const int32_t* w, int64_t K, const float* scales, const uint8_t* zeros,
          const float* sx, int64_t G, int64_t group, float (*tot)[kTileCols]) {
  static_assert(MR * NB <= 8, "register budget");
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NB; ++b) _mm256_storeu_ps(tot[r] + b * kCols, _mm256_setzero_ps());
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc[MR][NB];
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm256_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; k += kRun) {
      const int32_t* wk = w + k;
#define TOKSERVE_INT4_STEP(I, UNPACK)                                                          \
  {                                                                                            \
    __m256 xb[MR];                                                                             \
    for (int r = 0; r < MR; ++r) xb[r] = _mm256_broadcast_ss(xs + r * ldx + k + (I));          \
    for (int b = 0; b < NB; ++b) {                                                             \
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk + b * K));      \
      const __m256 q = _mm256_cvtepi32_ps(UNPACK);                                             \
      for (int r = 0; r < MR; ++r) acc[r][b] = _mm256_fmadd_ps(xb[r], q, acc[r][b]);           \
    }                                                                                          \
  }
      TOKSERVE_INT4_STEP(0, _mm256_and_si256(v, _mm256_set1_epi32(0xF)))
      TOKSERVE_INT4_STEP(1, _mm256_and_si256(v, _mm256_set1_epi32(0xF0)))
      TOKSERVE_INT4_STEP(2, _mm256_and_si256(v, _mm256_set1_epi32(0xF00)))
      TOKSERVE_INT4_STEP(3, _mm256_and_si256(v, _mm256_set1_epi32(0xF000)))
      TOKSERVE_INT4_STEP(4, _mm256_and_si256(v, _mm256_set1_epi32(0xF0000)))
      TOKSERVE_INT4_STEP(5, _mm256_and_si256(v, _mm256_set1_epi32(0xF00000)))
      TOKSERVE_INT4_STEP(6, _mm256_and_si256(v, _mm256_set1_epi32(0xF000000)))
      TOKSERVE_INT4_STEP(7, _mm256_srli_epi32(v, 28))
#undef TOKSERVE_INT4_STEP
    }
    for (int b = 0; b < NB; ++b) {
      const __m256 s = _mm256_loadu_ps(scales + (b * G + g) * kCols);
      const __m256 z = _mm256_cvtepi32_ps(
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(zeros + (b * G + g) * kCols))));
      for (int r = 0; r < MR; ++r) {
        float* t = tot[r] + b * kCols;
        const __m256 part = _mm256_fnmadd_ps(z, _mm256_set1_ps(sx[r * G + g]), acc[r][b]);
        _mm256_storeu_ps(t, _mm256_fmadd_ps(s, part, _mm256_loadu_ps(t)));
      }
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const int32_t*, int64_t, const float*, const uint8_t*, const float*,
                        int64_t, int64_t, float (*)[kTileCols]);

template <int MR>
TileFn pick_blocks(int64_t nb) {
  switch (nb) {
    case 8: return tile<MR, 8 / MR>;  // only reached for MR == 1
    case 7: return tile<MR, 7>;
    case 6: return tile<MR, 6>;
    case 5: return tile<MR, 5>;
    case 4: return tile<MR, 4>;
    case 3: return tile<MR, 3>;
    case 2: return tile<MR, 2>;
    default: return tile<MR, 1>;
  }
}

// Rows per tile 1, 2 or 4 (3 rows: a tile of 2 and one of 1); blocks per tile 8 / rows,
// fewer at the end of a task.  The per-element order is the same in all of them.
inline int64_t tile_rows(int64_t left) { return left >= 4 ? 4 : left >= 2 ? 2 : 1; }
inline int64_t tile_blocks(int64_t mr) { return 8 / mr; }
TileFn pick_tile(int64_t mr, int64_t nb) {
  if (mr == 4) return nb >= 2 ? tile<4, 2> : tile<4, 1>;
  if (mr == 2) return nb >= 4 ? tile<2, 4> : nb == 3 ? tile<2, 3> : nb == 2 ? tile<2, 2> : tile<2, 1>;
  return pick_blocks<1>(nb);
}
#else
// Portable reference of the same arithmetic and per-element order (CPUs without AVX2+FMA).
void tile_scalar(const float* xs, int64_t ldx, const int32_t* w, int64_t K, const float* scales, const uint8_t* zeros,
                 const float* sx, int64_t G, int64_t group, int64_t mr, int64_t nb,
                 float (*tot)[kTileCols]) {
  for (int64_t r = 0; r < mr; ++r)
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t j = 0; j < kCols; ++j) {
        float total = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          float dot = 0.f;
          for (int64_t k = g * group; k < (g + 1) * group; ++k) {
            const int64_t i = k % kRun;
            const uint32_t word = static_cast<uint32_t>(w[b * K + k - i + j]);
            const float q = i == 7 ? static_cast<float>(word >> 28) : static_cast<float>(word & (0xFu << (4 * i)));
            dot = std::fma(xs[r * ldx + k], q, dot);
          }
          const float s = scales[(b * G + g) * kCols + j], z = static_cast<float>(zeros[(b * G + g) * kCols + j]);
          total = std::fma(s, std::fma(-z, sx[r * G + g], dot), total);
        }
        tot[r][b * kCols + j] = total;
      }
}
#endif

// A tile's totals plus bias into the output (fp32, or rounded once to bf16 as a bf16
// F.linear rounds its fp32 accumulator).
template <typename T>
void store(const float (*tot)[kTileCols], int64_t mr, const float* bias, T* out, int64_t ldo, int64_t c0,
           int64_t cols) {
  for (int64_t r = 0; r < mr; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * ldo + c0 + c] = T(tot[r][c] + (bias != nullptr ? bias[c0 + c] : 0.f));
}

}  // namespace

std::string int4_gemm_isa() { return TOKSERVE_INT4_AVX2 ? "avx2" : "scalar"; }

torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          const torch::Tensor& zeros, int64_t group, int64_t n,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && packed.scalar_type() == torch::kInt32 && packed.is_contiguous(),
              "int4_linear: x [M, K] and packed [N/8, K] int32 expected");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
              "int4_linear: float32 or bfloat16 activations");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && zeros.scalar_type() == torch::kUInt8 &&
              scales.is_contiguous() && zeros.is_contiguous(), "int4_linear: contiguous fp32 scales and uint8 zeros");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && group > 0 && K % group == 0 && group % kRun == 0,
              "int4_linear: K must be the packed weight's and a multiple of the group size (a multiple of 8)");
  TORCH_CHECK(n > 0 && n <= NB * kCols, "int4_linear: n out of range");
  const int64_t G = K / group;
  TORCH_CHECK(scales.numel() == NB * G * kCols && zeros.numel() == NB * G * kCols, "int4_linear: scale shape");
  torch::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "int4_linear: bias of ", bias->numel(), " for ", n, " outputs");
    bias_f = bias->to(torch::kFloat32).contiguous();
  }
  auto out = torch::empty({M, n}, x.options());
  if (M == 0) return out;
  // Each row widened to fp32 and scaled per nibble (xs), and its per-group sums of x (sx),
  // once per call into this thread's scratch: a torch conversion per call would cost more
  // than a decode-sized GEMM's unpacking.  The same loop for any M (batch invariance).
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(M * K + M * G));
  float* xs = scratch.data();
  float* sxs = xs + M * K;
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  for (int64_t m = 0; m < M; ++m) {
    float* dst = xs + m * K;
    if (bf16) {
      const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) + m * x.stride(0);
      for (int64_t k = 0; k < K; ++k) {
        const uint32_t bits = static_cast<uint32_t>(src[k * x.stride(1)]) << 16;
        std::memcpy(dst + k, &bits, sizeof(float));
      }
    } else {
      const float* src = x.data_ptr<float>() + m * x.stride(0);
      for (int64_t k = 0; k < K; ++k) dst[k] = src[k * x.stride(1)];
    }
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.f;  // a plain serial sum: the same code and order for every row
      for (int64_t k = g * group; k < (g + 1) * group; ++k) sum += dst[k];
      sxs[m * G + g] = sum;
    }
    for (int64_t k = 0; k < K; ++k) dst[k] *= nibble_scale(k % kRun);
  }
  const int32_t* wp = packed.data_ptr<int32_t>();
  const float* sp = scales.data_ptr<float>();
  const uint8_t* zp = zeros.data_ptr<uint8_t>();
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  // Tasks over groups of kTaskBlocks column blocks: the slice of the weight a task reads
  // (K * 16 bytes) stays in L2 while its row tiles pass over it.
  const int64_t tasks = (NB + kTaskBlocks - 1) / kTaskBlocks;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    alignas(32) float tot[kMaxRows][kTileCols];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b_end = std::min(NB, (t + 1) * kTaskBlocks);
      for (int64_t m = 0, mr; m < M; m += mr) {
#if TOKSERVE_INT4_AVX2
        mr = tile_rows(M - m);
#else
        mr = std::min<int64_t>(kMaxRows, M - m);
#endif
        for (int64_t b0 = t * kTaskBlocks; b0 < b_end;) {
#if TOKSERVE_INT4_AVX2
          const int64_t nb = std::min(tile_blocks(mr), b_end - b0);
          pick_tile(mr, nb)(xs + m * K, K, wp + b0 * K, K, sp + b0 * G * kCols, zp + b0 * G * kCols, sxs + m * G, G,
                            group, tot);
#else
          const int64_t nb = std::min<int64_t>(kTaskBlocks, b_end - b0);
          tile_scalar(xs + m * K, K, wp + b0 * K, K, sp + b0 * G * kCols, zp + b0 * G * kCols, sxs + m * G, G, group,
                      mr, nb, tot);
#endif
          const int64_t c0 = b0 * kCols, cols = std::min(n - c0, nb * kCols);
          if (cols > 0) {
            if (bf16)
              store(tot, mr, bp, out.data_ptr<at::BFloat16>() + m * n, n, c0, cols);
            else
              store(tot, mr, bp, out.data_ptr<float>() + m * n, n, c0, cols);
          }
          b0 += nb;
        }
      }
    }
  });
  return out;
}
