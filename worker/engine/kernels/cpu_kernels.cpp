// The engine's CPU kernels (float32): paged decode attention, and the two
// element-wise steps of each decoder layer that torch runs as several passes over
// memory (SwiGLU, rotary embedding).
//
// paged_decode_attention: single-token ("decode") attention reading the paged KV
// cache in place.
// torch's SDPA needs each sequence's keys gathered into one tensor first; this reads
// them straight from their blocks.  One task per sequence: all query heads are
// scored against each token's K row (every KV head, contiguous in the block) as it
// streams by, so each K and V row is loaded once per step.  Two passes over the
// keys (scores, then softmax-weighted values) with the scores in a per-thread
// buffer; float32 throughout.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

torch::Tensor paged_decode_attention(const torch::Tensor& q,        // [B, H, D] float32
                                     const torch::Tensor& k_cache,  // [blocks, block_size, KVH, D]
                                     const torch::Tensor& v_cache,  // [blocks, block_size, KVH, D]
                                     const torch::Tensor& block_tables,  // [B, W] int32
                                     const torch::Tensor& seq_lens,      // [B] int32
                                     double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(),
              "q must be a contiguous float32 [B, H, D] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == torch::kFloat32 && k_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == torch::kFloat32 &&
                  v_cache.is_contiguous(),
              "k_cache/v_cache must be contiguous float32 [blocks, block_size, KVH, D] tensors");
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
    for (int64_t j = 0; j < (lp[b] + bs - 1) / bs; ++j)
      TORCH_CHECK(tp[b * W + j] >= 0 && tp[b * W + j] < num_blocks, "block id out of range");
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
        const float* krow = kp + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * row;
        for (int64_t j = 0; j < H; ++j) {
          const float* qj = qb + j * D;
          const float* k = krow + (j / G) * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qj[d] * k[d];
          scores[j * S + t] = s * sc;
        }
      }
      for (int64_t j = 0; j < H; ++j) {
        float* sj = scores.data() + j * S;
        const float m = *std::max_element(sj, sj + S);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < S; ++t) {
          sj[t] = std::exp(sj[t] - m);
          sum += sj[t];
        }
        inv[j] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < S; ++t) {
        const float* vrow = vp + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * row;
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
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "single-token attention over the paged KV cache (CPU, float32)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused [gate | up] projection (CPU, float32)");
  m.def("rotary_", &rotary_, "rotary embedding in place, rotating halves (CPU, float32)");
}
