// FP8 storage of the KV cache (--kv-cache-dtype fp8 / fp8_e4m3 = float8_e4m3fn,
// fp8_e5m2 = float8_e5m2): one byte per value, widened to float32 exactly on load.  The
// attention kernels read such a cache with q and out in float32 or bfloat16; every value
// is a float32 once loaded, so the math is the float32 path's.
//
// Widening: a 256-entry float table per format (filled once from c10's own conversion,
// so it is torch's `.float()` by construction) for single values, and for runs of 16 the
// CPU's half-precision conversion (F16C), equal to the table on every byte: an e5m2 byte
// is the top byte of the float16 of the same value, and an e4m3 byte's exponent and
// mantissa shifted one bit lower make a float16 of its value / 2^8 (float16's exponent
// bias is 15, e4m3's 7), subnormals included, scaled back by an exact multiply; e4m3fn's
// NaN (S.1111.111) is set apart, it has no infinity.  A table lookup costs two dependent
// loads per value; this path under one vector instruction per value (e4m3) and a third of
// one (e5m2), about half of an integer rebias with blends for subnormals: decode over the
// FP8 cache then runs as fast as over a bf16 cache (`python -m benchmarks.bench_model
// --kv-fp8`, benchmarks/README.md), the widening paid for by reading half the bytes.
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

#if defined(__AVX2__) && defined(__F16C__)
// 16 FP8 values (bytes at src) -> float32 at dst[0:16], equal to the table.
template <typename C>
inline void widen16(const C* src, float* dst) {
  const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  __m256i h = _mm256_slli_epi16(x, 8);  // e5m2: already the float16
  if constexpr (std::is_same_v<C, fp8_e4m3>) {
    // seee emmm 0000 0000 -> ssee eemm m000 0000 (arithmetic shift), then the second s cleared:
    // float16 0 0eeee mmm0000000 = value / 2^8, sign kept.
    h = _mm256_and_si256(_mm256_srai_epi16(h, 1), _mm256_set1_epi16(static_cast<int16_t>(0xbfff)));
    const __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7f)), _mm256_set1_epi16(0x7f));
    h = _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7c00)));  // exponent 31, mantissa 111...: NaN
    const __m256 scale = _mm256_set1_ps(256.f);
    _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), scale));
    _mm256_storeu_ps(dst + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), scale));
  } else {
    _mm256_storeu_ps(dst, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
    _mm256_storeu_ps(dst + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
  }
}
#endif

// dst[0:n] <- src[0:n] widened to float32.
template <typename C>
inline void widen_row(const C* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__F16C__)
  for (; i + 16 <= n; i += 16) widen16(src + i, dst + i);
#endif
  for (; i < n; ++i) dst[i] = to_f(src[i]);
}

}  // namespace tokserve_kernels
