// y = x @ W.T + bias for a few float32 rows x [T, in] (a decode step's, a speculative verify's) and a
// weight W [out, in] kept in GGUF blocks (quant_blocks.h): each group of 32 weights (quant_groups.h) is
// widened to float32 in registers and dotted with the activations, which stay float32 (never quantized).
//
// A group's scale is applied once to the group's dot product instead of to each weight, and an offset m
// (Q4_1, Q4_K, Q5_K) through the group's sum of activations:
//
//     sum_j (d q_j + m) x_j  =  d * (sum_j q_j x_j)  +  m * (sum_j x_j)
//
// so the result equals the dequantized float32 weights' product up to float32 rounding (where the
// rounding falls), at a fraction of the instructions of dequantizing every weight.
//
// Order (the same for every output whatever T and whichever group of rows it falls in, so a row's
// result does not depend on what else is in the batch), g the row's groups in order, blocks and
// K-quant super-blocks alike:
//
//     group g:  s = ((q[0:8] x[0:8] + q[8:16] x[8:16]) + q[16:24] x[16:24]) + q[24:32] x[24:32]   8 lanes
//               acc[g % 2] = acc[g % 2] + d_g s                                                    8 lanes
//               Q6_K (a scale per 16): s0 = q[0:8] x[0:8] + q[8:16] x[8:16], s1 the same over [16:32],
//               acc[g % 2] = (acc[g % 2] + d0_g s0) + d1_g s1
//               offset: accm[g % 2] = accm[g % 2] + m_g X_g   (X_g: the group's activations summed)
//     y = (lanes of (acc[0] + acc[1]) added in a fixed tree + (accm[0] + accm[1])) + bias
//
// The group loop is unrolled by two so that the accumulators stay in registers (indexed by g % 2 at run
// time they lived on the stack, and every block waited on a store-to-load round trip: 1.5x slower).
// Threads split the outputs (whole rows, so whole super-blocks), never a row.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "quant_groups.h"

namespace {

using windserve::block_of_group;
using windserve::GroupScales;
using windserve::group_scales;
using windserve::kGroup;
using windserve::kGroupsPer;
using windserve::kHasOffset;
using windserve::kIsKQuant;
using windserve::kQ6_K;

constexpr int64_t kTileBytes = 64 * 1024;  // weight rows per tile: stays in L2 across the groups of rows
// weights per chunk (work_pool.cpp): SmolLM2's [576, 576] in 20 chunks, so a thread the OS takes away
// leaves little for the others to wait on; claiming a chunk costs one atomic add
constexpr int64_t kChunkWeights = 1 << 14;
constexpr int64_t kMaxChunks = 64;  // a large weight (the LM head) in chunks of more rows: fewer claims

// xsum[t][g] = X_g, group g's 32 activations summed: ((x[l] + x[8 + l]) + (x[16 + l] + x[24 + l])) over
// lanes l, the lanes in a fixed tree. The offset's term per group.
float lanes_tree(const float v[8]) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

std::vector<float> group_sums(const float* x, int64_t rows, int64_t in) {
  std::vector<float> sums(static_cast<size_t>(rows * in / kGroup));
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t g = 0; g < in / kGroup; ++g) {
      const float* xg = x + t * in + g * kGroup;
      float s[8];
      for (int l = 0; l < 8; ++l) s[l] = (xg[l] + xg[8 + l]) + (xg[16 + l] + xg[24 + l]);
      sums[t * (in / kGroup) + g] = lanes_tree(s);
    }
  }
  return sums;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// A 32-weight block's d (and Q4_1's m after it) widened from one 4-byte load: two halves in one
// vcvtph2ps, not one each (a scalar load, insert and convert per half: ~5% of a Q4_1 row's time, measured
// alone). A K-quant's come from its super-block (quant_groups.h).
template <int64_t K>
inline GroupScales scales_of(const uint8_t* block, int i) {
  if constexpr (kIsKQuant<K>) {
    return group_scales<K>(block, i);
  } else {
    int32_t bits;
    std::memcpy(&bits, block, sizeof(bits));
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
    const float d = _mm_cvtss_f32(dm);
    return {d, d, K == windserve::kQ4_1 ? _mm_cvtss_f32(_mm_movehdup_ps(dm)) : 0.0f};
  }
}

inline float sum_lanes(__m256 v) {
  float lanes[8];
  _mm256_storeu_ps(lanes, v);
  return lanes_tree(lanes);
}

// Group g of each of T rows into acc[t] (and accm[t] where the kind has an offset).
template <int64_t K, int T>
inline void dot_group(const uint8_t* row, int64_t g, int64_t in, const float* xg, const float* xsum_g,
                      __m256 acc[T], float accm[T]) {
  const uint8_t* block = block_of_group<K>(row, g);
  const int i = static_cast<int>(g % kGroupsPer<K>);
  __m256 q[4];
  windserve::load_group<K>(block, i, q);
  const GroupScales scales = scales_of<K>(block, i);
  const __m256 d0 = _mm256_set1_ps(scales.d0);
  for (int t = 0; t < T; ++t) {
    const float* x = xg + t * in;
    if constexpr (K == kQ6_K) {
      const __m256 s0 = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(x + 8), _mm256_mul_ps(q[0], _mm256_loadu_ps(x)));
      const __m256 s1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(x + 24), _mm256_mul_ps(q[2], _mm256_loadu_ps(x + 16)));
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(scales.d1), s1, _mm256_fmadd_ps(d0, s0, acc[t]));
    } else {
      __m256 s = _mm256_mul_ps(q[0], _mm256_loadu_ps(x));
      for (int p = 1; p < 4; ++p) s = _mm256_fmadd_ps(q[p], _mm256_loadu_ps(x + 8 * p), s);
      acc[t] = _mm256_fmadd_ps(d0, s, acc[t]);
    }
  }
  if constexpr (kHasOffset<K>) {
    for (int t = 0; t < T; ++t) accm[t] = std::fma(scales.m, xsum_g[t * (in / kGroup)], accm[t]);
  }
}

template <int64_t K, int T>
void dot_rows(const uint8_t* row, int64_t in, const float* x, const float* xsum, float* y, int64_t y_stride,
              float bias) {
  __m256 even[T], odd[T];
  float even_m[T], odd_m[T];
  for (int t = 0; t < T; ++t) even[t] = odd[t] = _mm256_setzero_ps(), even_m[t] = odd_m[t] = 0.0f;
  const int64_t groups = in / kGroup;
  int64_t g = 0;
  for (; g + 1 < groups; g += 2) {
    dot_group<K, T>(row, g, in, x + g * kGroup, xsum + g, even, even_m);
    dot_group<K, T>(row, g + 1, in, x + (g + 1) * kGroup, xsum + g + 1, odd, odd_m);
  }
  if (g < groups) dot_group<K, T>(row, g, in, x + g * kGroup, xsum + g, even, even_m);
  for (int t = 0; t < T; ++t) {
    const float m_term = kHasOffset<K> ? even_m[t] + odd_m[t] : 0.0f;
    y[t * y_stride] = (sum_lanes(_mm256_add_ps(even[t], odd[t])) + m_term) + bias;
  }
}
#else
// Lane l of group g's dot product into acc (quant_gemv's order, one lane at a time).
template <int64_t K>
inline void dot_group_lane(const uint8_t* block, int i, const GroupScales& scales, const float* x, int l,
                           float* acc) {
  const auto qx = [&](int j) { return static_cast<float>(windserve::q_at<K>(block, i, j)) * x[j]; };
  const auto qx_plus = [&](int j, float s) {
    return std::fma(static_cast<float>(windserve::q_at<K>(block, i, j)), x[j], s);
  };
  if constexpr (K == kQ6_K) {
    *acc = std::fma(scales.d0, qx_plus(8 + l, qx(l)), *acc);
    *acc = std::fma(scales.d1, qx_plus(24 + l, qx(16 + l)), *acc);
  } else {
    float s = qx(l);
    for (int p = 1; p < 4; ++p) s = qx_plus(8 * p + l, s);
    *acc = std::fma(scales.d0, s, *acc);
  }
}

template <int64_t K, int T>
void dot_rows(const uint8_t* row, int64_t in, const float* x, const float* xsum, float* y, int64_t y_stride,
              float bias) {
  const int64_t groups = in / kGroup;
  for (int t = 0; t < T; ++t) {
    float acc[2][8] = {}, accm[2] = {};
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* block = block_of_group<K>(row, g);
      const int i = static_cast<int>(g % kGroupsPer<K>);
      const GroupScales scales = group_scales<K>(block, i);
      for (int l = 0; l < 8; ++l) dot_group_lane<K>(block, i, scales, x + t * in + g * kGroup, l, &acc[g & 1][l]);
      if constexpr (kHasOffset<K>) accm[g & 1] = std::fma(scales.m, xsum[t * groups + g], accm[g & 1]);
    }
    float lanes[8];
    for (int l = 0; l < 8; ++l) lanes[l] = acc[0][l] + acc[1][l];
    y[t * y_stride] = (lanes_tree(lanes) + (accm[0] + accm[1])) + bias;
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
      const float* st = xsum ? xsum + t * (in / kGroup) : nullptr;
      for (int64_t o = start; o < stop; ++o) {
        const uint8_t* row = blocks + o * row_bytes;
        if (t == 0) {  // rows of x beyond the first three find the tile in L2
          windserve::prefetch_ahead(row, row_bytes, blocks + last * row_bytes);
        }
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
  const bool has_offset = windserve::dispatch_kind(kind, [](auto k) { return kHasOffset<decltype(k)::value>; });
  const std::vector<float> sums = has_offset ? group_sums(xs, rows, in) : std::vector<float>();
  const float* xsum = sums.empty() ? nullptr : sums.data();
  // each output is computed by one thread, the same way whatever the split or the thread: no bit changes
  const int64_t grain = std::max({int64_t{1}, kChunkWeights / in, (out + kMaxChunks - 1) / kMaxChunks});
  windserve::parallel_chunks(out, grain, [&](int64_t first, int64_t last) {
    windserve::dispatch_kind(kind, [&](auto k) {
      linear_range<decltype(k)::value>(data, row_bytes, in, xs, rows, xsum, b, ys, out, first, last);
    });
  });
  return y;
}
