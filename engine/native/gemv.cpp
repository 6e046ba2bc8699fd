// y = x @ weight.T + bias for a few rows x [T, in], weight [out, in] contiguous: a batch-1 (or
// few-row) decode's matmuls, which read every weight byte for one to eight rows of work.
//
// MKL's one-row GEMV streamed gptoss-mid's [1024, 512] expert weights from memory at ~10 GB/s on
// the 2-core EPYC box, against ~23 GB/s for a plain one-thread read: it reads several weight rows
// at once (several memory streams). Here each weight row is one sequential stream, dotted with up
// to four input rows at a time (4 x 16-lane accumulators each); more input rows take further
// groups of four over the same block of weight rows while it is still in L2.
//
// Every output element is summed in the same order whatever T is and whichever group its row
// falls in, so a row's result does not depend on what else is in the batch (a 5-row speculative
// verify gives each row what a 1-row decode step gives it).
#include "kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 64;               // four 16-float accumulators
constexpr int64_t kBlockBytes = 128 * 1024;  // weight rows per block: stays in L2 across the groups

#if defined(__AVX512F__)
template <int T>
void dot_rows(const float* w, const float* x, int64_t x_stride, const float* bias, float* y, int64_t y_stride,
              int64_t first, int64_t last, int64_t in) {
  for (int64_t o = first; o < last; ++o) {
    const float* row = w + o * in;
    windserve::prefetch_ahead(row, in * static_cast<int64_t>(sizeof(float)), w + last * in);
    __m512 acc[T][4];
    for (int t = 0; t < T; ++t) {
      for (int c = 0; c < 4; ++c) acc[t][c] = _mm512_setzero_ps();
    }
    int64_t i = 0;
    for (; i + kLanes <= in; i += kLanes) {
      const __m512 w0 = _mm512_loadu_ps(row + i), w1 = _mm512_loadu_ps(row + i + 16);
      const __m512 w2 = _mm512_loadu_ps(row + i + 32), w3 = _mm512_loadu_ps(row + i + 48);
      for (int t = 0; t < T; ++t) {
        const float* xt = x + t * x_stride + i;
        acc[t][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xt), acc[t][0]);
        acc[t][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xt + 16), acc[t][1]);
        acc[t][2] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xt + 32), acc[t][2]);
        acc[t][3] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xt + 48), acc[t][3]);
      }
    }
    for (; i < in; i += 16) {  // the tail, 16 (or fewer, masked) at a time, into the first accumulator
      const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, in - i)) - 1);
      const __m512 wv = _mm512_maskz_loadu_ps(mask, row + i);
      for (int t = 0; t < T; ++t) {
        acc[t][0] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x + t * x_stride + i), acc[t][0]);
      }
    }
    const float b = bias ? bias[o] : 0.0f;
    for (int t = 0; t < T; ++t) {
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]), _mm512_add_ps(acc[t][2], acc[t][3]));
      y[t * y_stride + o] = _mm512_reduce_add_ps(sum) + b;
    }
  }
}
#else
template <int T>
void dot_rows(const float* w, const float* x, int64_t x_stride, const float* bias, float* y, int64_t y_stride,
              int64_t first, int64_t last, int64_t in) {
  for (int64_t o = first; o < last; ++o) {
    const float* row = w + o * in;
    for (int t = 0; t < T; ++t) {
      float lanes[kLanes] = {};
      int64_t i = 0;
      for (; i + kLanes <= in; i += kLanes) {
        for (int64_t l = 0; l < kLanes; ++l) lanes[l] += row[i + l] * x[t * x_stride + i + l];
      }
      for (; i < in; ++i) lanes[i % 16] += row[i] * x[t * x_stride + i];
      float sum = 0.0f;
      for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
      y[t * y_stride + o] = sum + (bias ? bias[o] : 0.0f);
    }
  }
}
#endif

}  // namespace

namespace windserve {

void linear_rows(const float* x, int64_t rows, int64_t x_stride, const float* weight, const float* bias,
                 int64_t out, int64_t in, float* y, int64_t y_stride) {
  const int64_t block = std::max<int64_t>(1, kBlockBytes / (in * static_cast<int64_t>(sizeof(float))));
  for (int64_t first = 0; first < out; first += block) {
    const int64_t last = std::min(out, first + block);
    for (int64_t t = 0; t < rows; t += 4) {
      const float* xt = x + t * x_stride;
      float* yt = y + t * y_stride;
      switch (std::min<int64_t>(4, rows - t)) {
        case 1: dot_rows<1>(weight, xt, x_stride, bias, yt, y_stride, first, last, in); break;
        case 2: dot_rows<2>(weight, xt, x_stride, bias, yt, y_stride, first, last, in); break;
        case 3: dot_rows<3>(weight, xt, x_stride, bias, yt, y_stride, first, last, in); break;
        default: dot_rows<4>(weight, xt, x_stride, bias, yt, y_stride, first, last, in); break;
      }
    }
  }
}

}  // namespace windserve

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.device().is_cpu() &&
                  weight.device().is_cpu() && x.dim() == 2 && weight.dim() == 2 && x.is_contiguous() &&
                  weight.is_contiguous() && x.size(1) == weight.size(1),
              "rows_linear: contiguous float32 CPU x [T, in] and weight [out, in]");
  const int64_t out = weight.size(0), in = weight.size(1);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out,
                "rows_linear: a contiguous float32 bias [out]");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({x.size(0), out}, x.options());
  windserve::linear_rows(x.data_ptr<float>(), x.size(0), in, weight.data_ptr<float>(), b, out, in,
                         y.data_ptr<float>(), out);
  return y;
}
