// The MoE's combine step: out[tokens[i]] += weights[i] * rows[i], in the order of i (experts in
// ascending order, as transformers' index_add_ runs them): one pass over the expert outputs where
// torch needed three (scale the rows, copy them back to (token, choice) order, sum the choices).
// Multiply, then add, each rounded, as the two torch ops do (no fused multiply-add).
#include <ATen/Parallel.h>

#include "kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace windserve {

void add_weighted_row(float* y, const float* v, float weight, int64_t width) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 scale = _mm512_set1_ps(weight);
  for (; d + 16 <= width; d += 16) {
    _mm512_storeu_ps(y + d, _mm512_add_ps(_mm512_loadu_ps(y + d), _mm512_mul_ps(scale, _mm512_loadu_ps(v + d))));
  }
#endif
  for (; d < width; ++d) {
    const float scaled = weight * v[d];
    y[d] += scaled;
  }
}

}  // namespace windserve

void add_weighted_rows(at::Tensor& out, const at::Tensor& tokens, const at::Tensor& rows, const at::Tensor& weights) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && rows.scalar_type() == at::kFloat &&
                  weights.scalar_type() == at::kFloat && tokens.scalar_type() == at::kLong,
              "add_weighted_rows: float32 out, rows and weights, int64 tokens");
  TORCH_CHECK(out.device().is_cpu() && rows.device().is_cpu() && out.dim() == 2 && rows.dim() == 2 &&
                  out.is_contiguous() && rows.is_contiguous() && tokens.is_contiguous() && weights.is_contiguous() &&
                  rows.size(1) == out.size(1) && tokens.numel() == rows.size(0) && weights.numel() == rows.size(0),
              "add_weighted_rows: contiguous CPU out [N, H], rows [M, H], tokens [M], weights [M]");
  const int64_t num_rows = rows.size(0), width = rows.size(1), num_tokens = out.size(0);
  float* o = out.data_ptr<float>();
  const float* x = rows.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  const int64_t* t = tokens.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_rows; ++i) {
    TORCH_CHECK(0 <= t[i] && t[i] < num_tokens, "add_weighted_rows: token index out of range");
  }
  for (int64_t i = 0; i < num_rows; ++i) {  // sequential: two rows of one token add in this order
    windserve::add_weighted_row(o + t[i] * width, x + i * width, w[i], width);
  }
}
