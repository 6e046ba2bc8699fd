// GPT-OSS's clamped SwiGLU over the expert rows in one pass. gate_up [R, 2I] float32, gate and up
// interleaved (gate = even columns, up = odd); the operations and their order are transformers':
//
//   gate = min(gate, limit);   up = clamp(up, -limit, limit)
//   out  = (sigmoid(gate * alpha) * gate) * (up + 1)                          [R, I]
//
// torch runs this as seven elementwise passes, two of them copies of the stride-2 halves.
// sigmoid(t) = 1 / (1 + exp(-t)) with vec_exp.h's exponential: the last bits differ from torch's.
#include <ATen/Parallel.h>

#include "kernels.h"
#include "vec_exp.h"

namespace {

inline float swiglu_one(float gate, float up, float alpha, float limit) {
  gate = limit < gate ? limit : gate;  // NaN passes through, as in torch's clamp
  up = -limit > up ? -limit : up;
  up = limit < up ? limit : up;
  const float sigmoid = 1.0f / (1.0f + windserve::exp_clamped(-(gate * alpha)));
  return (sigmoid * gate) * (up + 1.0f);
}

}  // namespace

namespace windserve {

void swiglu_row(const float* x, float* y, int64_t width, float alpha, float limit) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512 a = _mm512_set1_ps(alpha), hi = _mm512_set1_ps(limit), lo = _mm512_set1_ps(-limit);
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  for (; i + 16 <= width; i += 16) {
    const __m512 first = _mm512_loadu_ps(x + 2 * i), second = _mm512_loadu_ps(x + 2 * i + 16);
    // min/max return their second operand where either is NaN: NaN passes through, as in torch's clamp
    const __m512 gate = _mm512_min_ps(hi, _mm512_permutex2var_ps(first, even, second));
    const __m512 up = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_permutex2var_ps(first, odd, second)));
    const __m512 e = windserve::exp_clamped_16(_mm512_sub_ps(zero, _mm512_mul_ps(gate, a)));
    const __m512 sigmoid = _mm512_div_ps(one, _mm512_add_ps(one, e));
    _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(sigmoid, gate), _mm512_add_ps(up, one)));
  }
#endif
  for (; i < width; ++i) y[i] = swiglu_one(x[2 * i], x[2 * i + 1], alpha, limit);
}

}  // namespace windserve

at::Tensor clamped_swiglu(const at::Tensor& gate_up, double alpha, double limit) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.device().is_cpu() && gate_up.dim() == 2 &&
                  gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "clamped_swiglu: a contiguous float32 CPU [rows, 2 * I] tensor");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float a = static_cast<float>(alpha), lim = static_cast<float>(limit);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) windserve::swiglu_row(in + r * 2 * width, o + r * width, width, a, lim);
  });
  return out;
}
