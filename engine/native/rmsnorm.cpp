// RMSNorm of float32 rows in one pass: out = weight * (x * (1 / sqrt(mean(x^2) + eps))).
//
// ATen's rms_norm on the CPU is a composite of about eight ops (pow, mean, add, rsqrt, two muls,
// casts): ~10 us a call for one row of 512 warm, 35 in a decode step, whose weight streaming
// has just evicted everything (nine calls a step in gptoss-mid). The products and the order of the
// last three operations are transformers' (x * rsqrt, then weight *, each rounded); the sum of
// squares runs in 4 x 16 lanes, so the mean may differ from ATen's in its last bit.
#include <cmath>

#include "kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

float sum_of_squares(const float* x, int64_t width) {
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (; i + 64 <= width; i += 64) {
    for (int c = 0; c < 4; ++c) {
      const __m512 v = _mm512_loadu_ps(x + i + 16 * c);
      acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(v, v));
    }
  }
  for (; i < width; i += 16) {
    const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, width - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(mask, x + i);
    acc[0] = _mm512_add_ps(acc[0], _mm512_mul_ps(v, v));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
#else
  float lanes[64] = {};
  for (; i + 64 <= width; i += 64) {
    for (int l = 0; l < 64; ++l) lanes[l] += x[i + l] * x[i + l];
  }
  for (; i < width; ++i) lanes[i % 16] += x[i] * x[i];
  float sum = 0.0f;
  for (float lane : lanes) sum += lane;
  return sum;
#endif
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.device().is_cpu() &&
                  x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm: contiguous float32 CPU x [N, H] and weight [H]");
  const int64_t rows = x.size(0), width = x.size(1);
  at::Tensor out = at::empty_like(x);
  const float* w = weight.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x.data_ptr<float>() + r * width;
    float* o = out.data_ptr<float>() + r * width;
    const float mean = sum_of_squares(in, width) / static_cast<float>(width);
    const float scale = 1.0f / std::sqrt(mean + static_cast<float>(eps));
    for (int64_t i = 0; i < width; ++i) {
      const float normed = in[i] * scale;
      o[i] = w[i] * normed;
    }
  }
  return out;
}
