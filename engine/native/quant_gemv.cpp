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
//               acc[b % 2] = acc[b % 2] + d_b s                                                    8 lanes
//               Q4_1: accm[b % 2] = accm[b % 2] + m_b X_b   (X_b: the block's activations summed, a scalar)
//     y = (lanes of (acc[0] + acc[1]) added in a fixed tree + (accm[0] + accm[1])) + bias
//
// The block loop is unrolled by two so that the accumulators stay in registers (indexed by b % 2 at run
// time they lived on the stack, and every block waited on a store-to-load round trip: 1.5x slower).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
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
// weights per chunk (work_pool.cpp): SmolLM2's [576, 576] in 20 chunks, so a thread the OS takes away
// leaves little for the others to wait on; claiming a chunk costs one atomic add
constexpr int64_t kChunkWeights = 1 << 14;
constexpr int64_t kMaxChunks = 64;  // a large weight (the LM head) in chunks of more rows: fewer claims

// xsum[t][b] = X_b, block b's 32 activations summed: ((x[l] + x[8 + l]) + (x[16 + l] + x[24 + l])) over
// lanes l, the lanes in a fixed tree. Q4_1's m term per block.
float lanes_tree(const float v[8]) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

std::vector<float> block_sums(const float* x, int64_t rows, int64_t in) {
  std::vector<float> sums(static_cast<size_t>(rows * in / kBlock));
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t b = 0; b < in / kBlock; ++b) {
      const float* xb = x + t * in + b * kBlock;
      float s[8];
      for (int l = 0; l < 8; ++l) s[l] = (xb[l] + xb[8 + l]) + (xb[16 + l] + xb[24 + l]);
      sums[t * (in / kBlock) + b] = lanes_tree(s);
    }
  }
  return sums;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// A block's 32 integers as four 8-float vectors, in order. Bytes are widened straight from memory
// (vpmovsxbd / vpmovzxbd m64): a Q4 byte holds weights j and j + 16, split after widening.
template <int64_t K>
inline void load_q(const uint8_t* block, __m256 q[4]) {
  if constexpr (K == kQ8_0) {
    for (int p = 0; p < 4; ++p)
      q[p] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * p))));
  } else {
    const uint8_t* qs = block + (K == kQ4_1 ? 4 : 2);
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));
    const __m256i mask = _mm256_set1_epi32(15);
    __m256i w[4] = {_mm256_and_si256(a, mask), _mm256_and_si256(b, mask), _mm256_srli_epi32(a, 4),
                    _mm256_srli_epi32(b, 4)};
    for (int p = 0; p < 4; ++p) {
      if constexpr (K == kQ4_0) w[p] = _mm256_sub_epi32(w[p], _mm256_set1_epi32(8));
      q[p] = _mm256_cvtepi32_ps(w[p]);
    }
  }
}

inline float sum_lanes(__m256 v) {
  float lanes[8];
  _mm256_storeu_ps(lanes, v);
  return lanes_tree(lanes);
}

// One block b of each of T rows into acc[t] (and accm[t] for Q4_1).
template <int64_t K, int T>
inline void dot_block(const uint8_t* block, int64_t in, const float* xb, const float* xsum_b, __m256 acc[T],
                      float accm[T]) {
  __m256 q[4];
  load_q<K>(block, q);
  // d (and Q4_1's m after it) widened from one 4-byte load: two halves in one vcvtph2ps, not one each
  // (a scalar load, insert and convert per half: ~5% of a Q4_1 row's time, measured alone)
  int32_t scales;
  std::memcpy(&scales, block, sizeof(scales));
  const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(scales));
  const __m256 d = _mm256_broadcastss_ps(dm);
  for (int t = 0; t < T; ++t) {
    const float* x = xb + t * in;
    __m256 s = _mm256_mul_ps(q[0], _mm256_loadu_ps(x));
    for (int p = 1; p < 4; ++p) s = _mm256_fmadd_ps(q[p], _mm256_loadu_ps(x + 8 * p), s);
    acc[t] = _mm256_fmadd_ps(d, s, acc[t]);
  }
  if constexpr (K == kQ4_1) {
    const float m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
    for (int t = 0; t < T; ++t) accm[t] = std::fma(m, xsum_b[t * (in / kBlock)], accm[t]);
  }
}

template <int64_t K, int T>
void dot_rows(const uint8_t* row, int64_t in, const float* x, const float* xsum, float* y, int64_t y_stride,
              float bias) {
  __m256 even[T], odd[T];
  float even_m[T], odd_m[T];
  for (int t = 0; t < T; ++t) even[t] = odd[t] = _mm256_setzero_ps(), even_m[t] = odd_m[t] = 0.0f;
  const int64_t blocks = in / kBlock;
  int64_t b = 0;
  for (; b + 1 < blocks; b += 2) {
    dot_block<K, T>(row + b * kBlockBytes<K>, in, x + b * kBlock, xsum + b, even, even_m);
    dot_block<K, T>(row + (b + 1) * kBlockBytes<K>, in, x + (b + 1) * kBlock, xsum + b + 1, odd, odd_m);
  }
  if (b < blocks) dot_block<K, T>(row + b * kBlockBytes<K>, in, x + b * kBlock, xsum + b, even, even_m);
  for (int t = 0; t < T; ++t) {
    const float m_term = K == kQ4_1 ? even_m[t] + odd_m[t] : 0.0f;
    y[t * y_stride] = (sum_lanes(_mm256_add_ps(even[t], odd[t])) + m_term) + bias;
  }
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
  const int64_t blocks = in / kBlock;
  for (int t = 0; t < T; ++t) {
    float acc[2][8] = {}, accm[2] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = row + b * kBlockBytes<K>;
      const float* xb = x + t * in + b * kBlock;
      const float d = half_at(block);
      for (int l = 0; l < 8; ++l) {
        float s = q_at<K>(block, l) * xb[l];
        for (int p = 1; p < 4; ++p) s = std::fma(q_at<K>(block, 8 * p + l), xb[8 * p + l], s);
        acc[b & 1][l] = std::fma(d, s, acc[b & 1][l]);
      }
      if constexpr (K == kQ4_1) accm[b & 1] = std::fma(half_at(block + 2), xsum[t * blocks + b], accm[b & 1]);
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
      const float* st = xsum ? xsum + t * (in / kBlock) : nullptr;
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
  const std::vector<float> sums = kind == kQ4_1 ? block_sums(xs, rows, in) : std::vector<float>();
  const float* xsum = sums.empty() ? nullptr : sums.data();
  // each output is computed by one thread, the same way whatever the split or the thread: no bit changes
  const int64_t grain = std::max({int64_t{1}, kChunkWeights / in, (out + kMaxChunks - 1) / kMaxChunks});
  windserve::parallel_chunks(out, grain, [&](int64_t first, int64_t last) {
    switch (kind) {
      case kQ8_0: linear_range<kQ8_0>(data, row_bytes, in, xs, rows, xsum, b, ys, out, first, last); break;
      case kQ4_0: linear_range<kQ4_0>(data, row_bytes, in, xs, rows, xsum, b, ys, out, first, last); break;
      default: linear_range<kQ4_1>(data, row_bytes, in, xs, rows, xsum, b, ys, out, first, last); break;
    }
  });
  return y;
}
