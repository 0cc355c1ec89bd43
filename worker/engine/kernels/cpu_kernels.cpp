// The engine's CPU kernels (float32) and their Python bindings: the element-wise
// steps of each decoder layer that torch runs as several passes over memory
// (residual add + RMSNorm, SwiGLU, rotary embedding) live here; attention over the
// paged KV cache in decode_attention.cpp and prefill_attention.cpp.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec_math.h"

// SwiGLU on the fused [gate | up] projection in one pass: silu(gate) * up.
// (torch: silu, then a multiply, each streaming the activation through memory.)
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == torch::kFloat32 && gate_up.stride(1) == 1 &&
                  gate_up.size(1) % 2 == 0,
              "gate_up must be float32 [rows, 2 * intermediate] with contiguous rows");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2, stride = gate_up.stride(0);
  torch::Tensor out = torch::empty({M, I}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [=](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* g = src + m * stride;
      const float* u = g + I;
      float* o = dst + m * I;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 one = _mm256_set1_ps(1.f);
      for (; i + 8 <= I; i += 8) {  // g / (1 + e^-g) * u
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 den = _mm256_add_ps(one, tokserve_kernels::exp_clamped(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
      }
#endif
      for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// RMSNorm of each row, as HF computes it in float32: (x * rsqrt(mean(x^2) + eps)) * w.
// With a residual (the pre-norm decoder's running sum), residual += x first, in
// place, and the sum is normalised: one pass where torch makes three (add, the norm's
// reduction, its scaling).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                       c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 [rows, hidden] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == torch::kFloat32 &&
                  weight.is_contiguous(),
              "weight must be a contiguous float32 [hidden] tensor");
  float* rp = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == torch::kFloat32 &&
                    residual->is_contiguous(),
                "residual must be a contiguous float32 tensor shaped like x");
    rp = residual->data_ptr<float>();
  }
  const int64_t M = x.size(0), N = x.size(1);
  torch::Tensor out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fe = static_cast<float>(eps);
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1)), [=](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* src = xp + m * N;
      if (rp != nullptr) {
        float* r = rp + m * N;
#pragma omp simd
        for (int64_t i = 0; i < N; ++i) r[i] += src[i];
        src = r;
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < N; ++i) ss += src[i] * src[i];
      const float scale = 1.f / std::sqrt(ss / static_cast<float>(N) + fe);
      float* o = op + m * N;
#pragma omp simd
      for (int64_t i = 0; i < N; ++i) o[i] = src[i] * scale * wp[i];
    }
  });
  return out;
}

// Rotary embedding in place, rotating halves (HF's rotate_half / neox style):
// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin.  x: [T, heads, D] with contiguous
// head vectors (any row/head strides: q and k inside the fused qkv output);
// table: [N, 2 * D] rows cos | cos | -sin | sin (models/rotary.py rotation_table).
void rotary_(torch::Tensor x, const torch::Tensor& table, const torch::Tensor& positions) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "x must be float32 [T, heads, D] with contiguous head vectors");
  const int64_t T = x.size(0), NH = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == torch::kFloat32 && table.is_contiguous() &&
                  table.size(1) == 2 * D,
              "table must be contiguous float32 [positions, 2 * head_dim]");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T && positions.scalar_type() == torch::kInt64,
              "positions must be int64 [T]");
  const torch::Tensor pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t N = table.size(0);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pp[t] >= 0 && pp[t] < N, "position out of range of the rotary table");
  float* xp = x.data_ptr<float>();
  const float* tbl = table.data_ptr<float>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  at::parallel_for(0, T, std::max<int64_t>(1, 4096 / std::max<int64_t>(NH * D, 1)), [=](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = tbl + pp[t] * 2 * D;  // cos (first half of the row)
      const float* s = c + D + half;         // +sin (last quarter of the row)
      for (int64_t h = 0; h < NH; ++h) {
        float* a = xp + t * st + h * sh;
        float* b = a + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = a[i], x2 = b[i];
          a[i] = x1 * c[i] - x2 * s[i];
          b[i] = x2 * c[i] + x1 * s[i];
        }
      }
    }
  });
}

// decode_attention.cpp, prefill_attention.cpp
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale);
void paged_prefill_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                             const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                             const torch::Tensor& query_start, const torch::Tensor& seqs, double scale,
                             torch::Tensor out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "single-token attention over the paged KV cache (CPU, float32)");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of prefill chunks over the paged KV cache, written into out (CPU, float32)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, after residual += x when a residual is given (CPU, float32)",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused [gate | up] projection (CPU, float32)");
  m.def("rotary_", &rotary_, "rotary embedding in place, rotating halves (CPU, float32)");
}
