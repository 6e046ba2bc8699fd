// y = x @ W.T + bias for a few float32 rows x [T, in] (a decode step's, a speculative verify's) and a
// weight W [out, in] kept in GGUF blocks (quant_blocks.h): each block's 32 integers are widened to
// float32 in registers and dotted with the activations, which stay float32 (never quantized).
//
// A block's scale is applied once to the block's dot product instead of to each weight, and Q4_1's
// offset m through the block's sum of activations:
//
//     sum_j (d q_j + m) x_j  =  d * (sum_j q_j x_j)  +  m * (sum_j x_j)
//
// so the result equals the dequantized float32 weights' product up to float32 rounding (where the
// rounding falls), at a fraction of the instructions of dequantizing every weight.
//
// Order (the same for every output whatever T and whichever group of rows it falls in, so a row's
// result does not depend on what else is in the batch):
//
//     block b:  s = ((q[0:8] x[0:8] + q[8:16] x[8:16]) + q[16:24] x[16:24]) + q[24:32] x[24:32]   8 lanes
//               acc[b % 2] = acc[b % 2] + d_b s   (then + m_b xsum_b for Q4_1)                     8 lanes
//     y = lanes of (acc[0] + acc[1]) added in a fixed tree, + bias
#include <ATen/Parallel.h>

#include <vector>

#include "kernels.h"
#include "quant_blocks.h"

namespace {

using windserve::half_at;
using windserve::kBlock;
using windserve::kBlockBytes;
using windserve::kQ4_0;
using windserve::kQ4_1;
using windserve::kQ8_0;

constexpr int64_t kTileBytes = 64 * 1024;  // weight rows per tile: stays in L2 across the groups of rows
constexpr int64_t kGrainWeights = 1 << 16;  // weights per thread's share at least (a fork costs a few us)

// xsum[t][b][l] = (x[32 b + l] + x[32 b + 8 + l]) + (x[32 b + 16 + l] + x[32 b + 24 + l]): Q4_1's
// m term per block, as 8 lanes.
std::vector<float> block_sums(const float* x, int64_t rows, int64_t in) {
  std::vector<float> sums(static_cast<size_t>(rows * in / 4));
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t b = 0; b < in / kBlock; ++b) {
      const float* xb = x + t * in + b * kBlock;
      float* s = sums.data() + (t * in + b * kBlock) / 4;
      for (int l = 0; l < 8; ++l) s[l] = (xb[l] + xb[8 + l]) + (xb[16 + l] + xb[24 + l]);
    }
  }
  return sums;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// A block's 32 integers as four 8-float vectors, in order.
template <int64_t K>
inline void load_q(const uint8_t* block, __m256 q[4]) {
  __m128i parts[4];
  if constexpr (K == kQ8_0) {
    const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
    const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 18));
    parts[0] = q0, parts[1] = _mm_srli_si128(q0, 8), parts[2] = q1, parts[3] = _mm_srli_si128(q1, 8);
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (K == kQ4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    if constexpr (K == kQ4_0) {
      lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
      hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
    }
    parts[0] = lo, parts[1] = _mm_srli_si128(lo, 8), parts[2] = hi, parts[3] = _mm_srli_si128(hi, 8);
  }
  for (int p = 0; p < 4; ++p) q[p] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[p]));
}

inline float sum_lanes(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

template <int64_t K, int T>
void dot_rows(const uint8_t* row, int64_t in, const float* x, const float* xsum, float* y, int64_t y_stride,
              float bias) {
  __m256 acc[T][2];
  for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < in / kBlock; ++b) {
    const uint8_t* block = row + b * kBlockBytes<K>;
    __m256 q[4];
    load_q<K>(block, q);
    const __m256 d = _mm256_set1_ps(half_at(block));
    for (int t = 0; t < T; ++t) {
      const float* xb = x + t * in + b * kBlock;
      __m256 s = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
      for (int p = 1; p < 4; ++p) s = _mm256_fmadd_ps(q[p], _mm256_loadu_ps(xb + 8 * p), s);
      acc[t][b & 1] = _mm256_fmadd_ps(d, s, acc[t][b & 1]);
      if constexpr (K == kQ4_1) {
        const __m256 m = _mm256_set1_ps(half_at(block + 2));
        acc[t][b & 1] = _mm256_fmadd_ps(m, _mm256_loadu_ps(xsum + (t * in + b * kBlock) / 4), acc[t][b & 1]);
      }
    }
  }
  for (int t = 0; t < T; ++t) y[t * y_stride] = sum_lanes(_mm256_add_ps(acc[t][0], acc[t][1])) + bias;
}
#else
template <int64_t K>
inline float q_at(const uint8_t* block, int j) {
  if constexpr (K == kQ8_0) return static_cast<float>(reinterpret_cast<const int8_t*>(block + 2)[j]);
  const uint8_t* qs = block + (K == kQ4_1 ? 4 : 2);
  const int nibble = j < 16 ? (qs[j] & 15) : (qs[j - 16] >> 4);
  return static_cast<float>(K == kQ4_0 ? nibble - 8 : nibble);
}

template <int64_t K, int T>
void dot_rows(const uint8_t* row, int64_t in, const float* x, const float* xsum, float* y, int64_t y_stride,
              float bias) {
  for (int t = 0; t < T; ++t) {
    float acc[2][8] = {};
    for (int64_t b = 0; b < in / kBlock; ++b) {
      const uint8_t* block = row + b * kBlockBytes<K>;
      const float* xb = x + t * in + b * kBlock;
      const float d = half_at(block);
      for (int l = 0; l < 8; ++l) {
        float s = q_at<K>(block, l) * xb[l];
        for (int p = 1; p < 4; ++p) s += q_at<K>(block, 8 * p + l) * xb[8 * p + l];
        acc[b & 1][l] += d * s;
        if constexpr (K == kQ4_1) acc[b & 1][l] += half_at(block + 2) * xsum[(t * in + b * kBlock) / 4 + l];
      }
    }
    float lanes[8];
    for (int l = 0; l < 8; ++l) lanes[l] = acc[0][l] + acc[1][l];
    y[t * y_stride] = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    y[t * y_stride] += bias;
  }
}
#endif

// Outputs [first, last) for every row of x, tile by tile of weight rows, three rows of x at a time
// (their 6 accumulators, 4 weight vectors and the scales fit AVX2's 16 registers).
template <int64_t K>
void linear_range(const uint8_t* blocks, int64_t row_bytes, int64_t in, const float* x, int64_t rows,
                  const float* xsum, const float* bias, float* y, int64_t out, int64_t first, int64_t last) {
  const int64_t tile = std::max<int64_t>(1, kTileBytes / row_bytes);
  for (int64_t start = first; start < last; start += tile) {
    const int64_t stop = std::min(last, start + tile);
    for (int64_t t = 0; t < rows; t += 3) {
      const float* xt = x + t * in;
      const float* st = xsum ? xsum + t * in / 4 : nullptr;
      for (int64_t o = start; o < stop; ++o) {
        const uint8_t* row = blocks + o * row_bytes;
        float* yo = y + t * out + o;
        const float b = bias ? bias[o] : 0.0f;
        switch (std::min<int64_t>(3, rows - t)) {
          case 1: dot_rows<K, 1>(row, in, xt, st, yo, out, b); break;
          case 2: dot_rows<K, 2>(row, in, xt, st, yo, out, b); break;
          default: dot_rows<K, 3>(row, in, xt, st, yo, out, b); break;
        }
      }
    }
  }
}

}  // namespace

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                        const c10::optional<at::Tensor>& bias) {
  const int64_t in = windserve::check_quant_blocks(blocks, kind, "quant_linear");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                  x.size(1) == in,
              "quant_linear: a contiguous float32 CPU x [T, in] with in = ", in);
  const int64_t out = blocks.size(0), rows = x.size(0), row_bytes = blocks.size(1);
  const float* b = windserve::optional_bias(bias, out, "quant_linear");
  at::Tensor y = at::empty({rows, out}, x.options());
  const uint8_t* data = blocks.data_ptr<uint8_t>();
  const float* xs = x.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const std::vector<float> sums = kind == kQ4_1 ? block_sums(xs, rows, in) : std::vector<float>();
  const float* xsum = sums.empty() ? nullptr : sums.data();
  // each output is computed by one thread, the same way whatever the split: the split changes no bits
  at::parallel_for(0, out, std::max<int64_t>(1, kGrainWeights / in), [&](int64_t first, int64_t last) {
    switch (kind) {
      case kQ8_0: linear_range<kQ8_0>(data, row_bytes, in, xs, rows, xsum, b, ys, out, first, last); break;
      case kQ4_0: linear_range<kQ4_0>(data, row_bytes, in, xs, rows, xsum, b, ys, out, first, last); break;
      default: linear_range<kQ4_1>(data, row_bytes, in, xs, rows, xsum, b, ys, out, first, last); break;
    }
  });
  return y;
}
