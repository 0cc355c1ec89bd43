// FP8 storage of the KV cache (--kv-cache-dtype fp8 / fp8_e4m3 = float8_e4m3fn,
// fp8_e5m2 = float8_e5m2): one byte per value, widened to float32 exactly on load.  The
// attention kernels read such a cache with q and out in float32 or bfloat16; every value
// is a float32 once loaded, so the math is the float32 path's.
//
// Widening: a 256-entry float table per format (filled once from c10's own conversion,
// so it is torch's `.float()` by construction) for single values, and for runs of 8 an
// AVX2 bit-level conversion equal to the table on every byte: the exponent is rebiased
// in the integer unit (e4m3: bias 7 -> 127, e5m2: 15 -> 127), subnormals (exponent field
// 0) are m * 2^-9 / m * 2^-16 through an exact int->float conversion, NaN / infinity
// encodings map to float32's.  No float32 denormal is ever formed, so the conversion is
// exact also where FTZ/DAZ are on (-ffast-math).  A table lookup per value costs two
// dependent loads; the vector path a handful of integer ops per 8 values, which keeps
// decode bound by reading the (now 1-byte) cache rather than by widening it.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tokserve_kernels {

using fp8_e4m3 = c10::Float8_e4m3fn;
using fp8_e5m2 = c10::Float8_e5m2;

template <typename C>
inline constexpr bool is_fp8 = std::is_same_v<C, fp8_e4m3> || std::is_same_v<C, fp8_e5m2>;

template <typename C>
std::array<float, 256> widening_table() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    C v;
    const uint8_t bits = static_cast<uint8_t>(b);
    std::memcpy(&v, &bits, 1);
    t[b] = static_cast<float>(v);
  }
  return t;
}

// Built once when the library loads (C++17 inline variables: one copy for every file).
inline const std::array<float, 256> kE4M3Table = widening_table<fp8_e4m3>();
inline const std::array<float, 256> kE5M2Table = widening_table<fp8_e5m2>();

inline float to_f(fp8_e4m3 x) { return kE4M3Table[x.x]; }
inline float to_f(fp8_e5m2 x) { return kE5M2Table[x.x]; }

#if defined(__AVX2__)
// 8 FP8 values (bytes at src) -> 8 float32, equal to the table.
template <typename C>
inline __m256 widen8(const C* src) {
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
  const __m256i mag = _mm256_and_si256(x, _mm256_set1_epi32(0x7f));
  // e4m3: seee emmm -> exponent + (127 - 7), mantissa to float's top bits; e5m2: seeeeemm.
  constexpr bool e4 = std::is_same_v<C, fp8_e4m3>;
  constexpr int kMant = e4 ? 3 : 2, kRebias = e4 ? 127 - 7 : 127 - 15;
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 23 - kMant), _mm256_set1_epi32(kRebias << 23));
  // Subnormals (exponent field 0): m * 2^(1 - bias - mantissa bits).
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(e4 ? 0x1p-9f : 0x1p-16f));
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(1 << kMant), mag);
  __m256i bits = _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(normal), sub, _mm256_castsi256_ps(is_sub)));
  if constexpr (e4) {  // e4m3fn has no infinity; S.1111.111 is NaN
    const __m256i nan = _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f));
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7fc00000), nan);
  } else {  // exponent field 31 (31 + 112 above): infinity (mantissa 0) or NaN, float32's exponent 255
    const __m256i special = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7b));
    bits = _mm256_blendv_epi8(bits, _mm256_add_epi32(normal, _mm256_set1_epi32(112 << 23)), special);
  }
  return _mm256_castsi256_ps(_mm256_or_si256(bits, sign));
}
#endif

// dst[0:n] <- src[0:n] widened to float32.
template <typename C>
inline void widen_row(const C* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, widen8(src + i));
#endif
  for (; i < n; ++i) dst[i] = to_f(src[i]);
}

}  // namespace tokserve_kernels
