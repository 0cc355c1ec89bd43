// The engine's CPU kernels (float32 or bfloat16 storage, float32 math) and their Python bindings: the element-wise
// steps of each decoder layer that torch runs as several passes over memory
// (residual add + RMSNorm, SwiGLU, rotary embedding) live here; attention over the
// paged KV cache in decode_attention.cpp and prefill_attention.cpp.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "paged_cache.h"  // check_storage_dtype
#include "vec_math.h"

using tokserve_kernels::bf16;
using tokserve_kernels::from_f;
using tokserve_kernels::to_f;

namespace {

// Grain of at::parallel_for: rows per task so one task touches ~`elems` values.
inline int64_t grain(int64_t elems, int64_t per_row) { return std::max<int64_t>(1, elems / std::max<int64_t>(per_row, 1)); }

template <typename T>
void silu_and_mul_impl(const T* src, T* dst, int64_t M, int64_t I, int64_t stride) {
  at::parallel_for(0, M, grain(16384, I), [=](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* g = src + m * stride;
      const T* u = g + I;
      T* o = dst + m * I;
      int64_t i = 0;
      if constexpr (std::is_same_v<T, float>) {
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.f);
        for (; i + 8 <= I; i += 8) {  // g / (1 + e^-g) * u
          const __m256 gv = _mm256_loadu_ps(g + i);
          const __m256 den =
              _mm256_add_ps(one, tokserve_kernels::exp_clamped(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
          _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
      } else {
        // As HF in bf16: silu(gate) rounded to bf16, then the product rounded.
        float sg[64];
        for (; i < I; i += 64) {
          const int64_t n = std::min<int64_t>(64, I - i);
          for (int64_t j = 0; j < n; ++j) sg[j] = to_f(g[i + j]);
          tokserve_kernels::silu_inplace(sg, n);
          for (int64_t j = 0; j < n; ++j) o[i + j] = from_f<T>(to_f(from_f<T>(sg[j])) * to_f(u[i + j]));
        }
      }
    }
  });
}

template <typename T>
void rms_norm_impl(const T* xp, const T* wp, T* rp, T* op, int64_t M, int64_t N, float fe) {
  at::parallel_for(0, M, grain(16384, N), [=](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const T* src = xp + m * N;
      if (rp != nullptr) {
        T* r = rp + m * N;
#pragma omp simd
        for (int64_t i = 0; i < N; ++i) r[i] = from_f<T>(to_f(r[i]) + to_f(src[i]));
        src = r;
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < N; ++i) ss += to_f(src[i]) * to_f(src[i]);
      const float scale = 1.f / std::sqrt(ss / static_cast<float>(N) + fe);
      T* o = op + m * N;
      // HF rounds the normalised row to the storage dtype before the weight multiply
      // (a no-op in float32).
#pragma omp simd
      for (int64_t i = 0; i < N; ++i) o[i] = from_f<T>(to_f(from_f<T>(to_f(src[i]) * scale)) * to_f(wp[i]));
    }
  });
}

template <typename T>
void rotary_impl(T* xp, const T* tbl, const int64_t* pp, int64_t T_, int64_t NH, int64_t D, int64_t st,
                 int64_t sh) {
  const int64_t half = D / 2;
  at::parallel_for(0, T_, grain(4096, NH * D), [=](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = tbl + pp[t] * 2 * D;  // cos (first half of the row)
      const T* s = c + D + half;         // +sin (last quarter of the row)
      for (int64_t h = 0; h < NH; ++h) {
        T* a = xp + t * st + h * sh;
        T* b = a + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f(a[i]), x2 = to_f(b[i]), ci = to_f(c[i]), si = to_f(s[i]);
          a[i] = from_f<T>(x1 * ci - x2 * si);
          b[i] = from_f<T>(x2 * ci + x1 * si);
        }
      }
    }
  });
}

}  // namespace

// SwiGLU on the fused [gate | up] projection in one pass: silu(gate) * up.
// (torch: silu, then a multiply, each streaming the activation through memory.)
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [rows, 2 * intermediate] with contiguous rows");
  tokserve_kernels::check_storage_dtype(gate_up.scalar_type(), "gate_up");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2, stride = gate_up.stride(0);
  torch::Tensor out = torch::empty({M, I}, gate_up.options());
  if (gate_up.scalar_type() == torch::kBFloat16)
    silu_and_mul_impl(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), M, I, stride);
  else
    silu_and_mul_impl(gate_up.data_ptr<float>(), out.data_ptr<float>(), M, I, stride);
  return out;
}

// RMSNorm of each row, as HF computes it (float32 math): (x * rsqrt(mean(x^2) + eps)) * w.
// With a residual (the pre-norm decoder's running sum), residual += x first, in
// place, and the sum is normalised: one pass where torch makes three (add, the norm's
// reduction, its scaling).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                       c10::optional<torch::Tensor> residual) {
  const auto dt = x.scalar_type();
  tokserve_kernels::check_storage_dtype(dt, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, hidden] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == dt && weight.is_contiguous(),
              "weight must be a contiguous [hidden] tensor of x's dtype");
  if (residual.has_value())
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == dt && residual->is_contiguous(),
                "residual must be a contiguous tensor shaped like x, of x's dtype");
  const int64_t M = x.size(0), N = x.size(1);
  torch::Tensor out = torch::empty_like(x);
  const float fe = static_cast<float>(eps);
  if (dt == torch::kBFloat16)
    rms_norm_impl(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(),
                  residual.has_value() ? residual->data_ptr<at::BFloat16>() : nullptr, out.data_ptr<at::BFloat16>(),
                  M, N, fe);
  else
    rms_norm_impl(x.data_ptr<float>(), weight.data_ptr<float>(),
                  residual.has_value() ? residual->data_ptr<float>() : nullptr, out.data_ptr<float>(), M, N, fe);
  return out;
}

// Rotary embedding in place, rotating halves (HF's rotate_half / neox style):
// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin (float32 math, one rounding per value).
// x: [T, heads, D] with contiguous head vectors (any row/head strides: q and k inside
// the fused qkv output); table: [N, 2 * D] rows cos | cos | -sin | sin
// (models/rotary.py rotation_table), in x's dtype.
void rotary_(torch::Tensor x, const torch::Tensor& table, const torch::Tensor& positions) {
  const auto dt = x.scalar_type();
  tokserve_kernels::check_storage_dtype(dt, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x must be [T, heads, D] with contiguous head vectors");
  const int64_t T = x.size(0), NH = x.size(1), D = x.size(2);
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == dt && table.is_contiguous() && table.size(1) == 2 * D,
              "table must be contiguous [positions, 2 * head_dim] of x's dtype");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == T && positions.scalar_type() == torch::kInt64,
              "positions must be int64 [T]");
  const torch::Tensor pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t N = table.size(0);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pp[t] >= 0 && pp[t] < N, "position out of range of the rotary table");
  if (dt == torch::kBFloat16)
    rotary_impl(x.data_ptr<at::BFloat16>(), table.data_ptr<at::BFloat16>(), pp, T, NH, D, x.stride(0), x.stride(1));
  else
    rotary_impl(x.data_ptr<float>(), table.data_ptr<float>(), pp, T, NH, D, x.stride(0), x.stride(1));
}

// decode_attention.cpp, prefill_attention.cpp
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                                     const torch::Tensor& seq_lens, double scale);
void paged_prefill_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                             const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                             const torch::Tensor& query_start, const torch::Tensor& seqs, double scale,
                             torch::Tensor out);
// bf16_gemm.cpp
std::string native_bf16_gemm_isa();
torch::Tensor pack_bf16_weight(const torch::Tensor& weight);
torch::Tensor unpack_bf16_weight(const torch::Tensor& packed);
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias);
// int4_gemm.cpp
std::string int4_gemm_isa();
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          const torch::Tensor& zeros, int64_t group, int64_t n, const c10::optional<torch::Tensor>& bias);

// The compute kernels run without the GIL (as torch's own ops do): the worker's other
// threads -- the engine's host thread planning the next step under async scheduling, the
// transfer server, the heartbeats -- keep running Python meanwhile.  Arguments are
// converted before the guard releases it and the result after it is taken back.
using nogil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "single-token attention over the paged KV cache (CPU, float32 / bfloat16)", nogil());
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of prefill chunks over the paged KV cache, written into out (CPU, float32 / bfloat16)",
        nogil());
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, after residual += x when a residual is given (CPU, float32 / bfloat16)",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none(), nogil());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused [gate | up] projection (CPU, float32 / bfloat16)",
        nogil());
  m.def("rotary_", &rotary_, "rotary embedding in place, rotating halves (CPU, float32 / bfloat16)", nogil());
  m.def("native_bf16_gemm_isa", &native_bf16_gemm_isa,
        "the ISA of this build's bf16 GEMM (avx512_bf16 / avx2), empty where it has none");
  m.def("pack_bf16_weight", &pack_bf16_weight, "a bf16 [out, in] weight packed for bf16_linear (same shape)", nogil());
  m.def("unpack_bf16_weight", &unpack_bf16_weight, "the dense [out, in] weight of a packed one (exact)", nogil());
  m.def("bf16_linear", &bf16_linear, "x @ weight.T + bias over a packed bf16 weight, fp32 accumulation (CPU)",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(), nogil());
  m.def("int4_gemm_isa", &int4_gemm_isa, "the ISA of this build's int4 GEMM (avx2 / scalar)");
  m.def("int4_linear", &int4_linear,
        "x @ dequant(W).T + bias over an int4 weight packed by pack_int4_weight (W4A16, fp32 accumulation, CPU)",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("zeros"), py::arg("group"), py::arg("n"),
        py::arg("bias") = py::none(), nogil());
}
