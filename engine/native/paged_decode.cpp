// Attention of a few new queries per request (decode and speculative verify steps), each key
// read in place from the KV pages: nothing gathered, no mask, one call per layer.
//
//   cache      [pages, layers, 2, B, Hkv, D] float32; position p of request r: page
//              tables[r][p / B], slot p % B (K at [.., 0, ..], V at [.., 1, ..])
//   query      [N, Hq, D] (rows may be strided, heads contiguous); request r's Q = query_lens[r]
//              queries are rows first_rows[r] .. + Q - 1, at positions S - Q .. S - 1 (S = seq_lens[r])
//   reads      the query at position p attends keys max(0, p - W + 1) .. p (W = window; 0: none);
//              query head h reads KV head h / G (G = Hq / Hkv)
//   sinks      GPT-OSS: one more logit per query head in the softmax's denominator, with no value
//
// Per (request, KV head): the pointers to its keys, then per query and head: scores, softmax
// numerators, the weighted sum of values. Float32 throughout; the exponential is a polynomial
// (vec_exp.h, about 1 ulp), so results differ from torch's kernels in the last bits, not more.
#include <ATen/Parallel.h>

#include "kernels.h"
#include "vec_exp.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

#if defined(__AVX2__) && !defined(__AVX512F__)
inline float sum_8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
#endif

// exp(w - max) in place over w[0, n), the sink (if any) taking part in the maximum; returns the
// softmax's denominator, the sink's term included.
inline float softmax_numerators(float* w, int64_t n, const float* sink) {
  float top = sink ? *sink : -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) top = std::max(top, w[j]);
  float total = sink ? windserve::exp_clamped(*sink - top) : 0.f;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 top16 = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    const __m512 e = windserve::exp_clamped_16(_mm512_sub_ps(_mm512_loadu_ps(w + j), top16));
    _mm512_storeu_ps(w + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  total += _mm512_reduce_add_ps(sum);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 top8 = _mm256_set1_ps(top);
  __m256 sum = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = windserve::exp_clamped_8(_mm256_sub_ps(_mm256_loadu_ps(w + j), top8));
    _mm256_storeu_ps(w + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  total += sum_8(sum);
#endif
  for (; j < n; ++j) {
    w[j] = windserve::exp_clamped(w[j] - top);
    total += w[j];
  }
  return total;
}

// The pages of a request lie anywhere in the pool, so no hardware prefetcher guesses the next row:
// every key row is prefetched while the pointers are built, each value row a few keys ahead of
// its score (it is read by the weighted sum right after).
constexpr int64_t kAhead = 8;

inline void prefetch_row(const float* row, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(row + i);
}

// Any head size: scores w[j] = scale * q . key_j, and out = sum_j w[j] value_j / total.
void scores_any(const float* q, const float* const* keys, int64_t half, int64_t n, int64_t dim, float scale,
                float* w) {
  for (int64_t j = 0; j < n; ++j) {
    prefetch_row(keys[std::min(j + kAhead, n - 1)] + half, dim);  // for values_any, next
    float lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int64_t d = 0;
    for (; d + 8 <= dim; d += 8) {
      for (int l = 0; l < 8; ++l) lanes[l] += q[d + l] * keys[j][d + l];
    }
    float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for (; d < dim; ++d) sum += q[d] * keys[j][d];
    w[j] = sum * scale;
  }
}

void values_any(const float* w, const float* const* keys, int64_t half, int64_t n, int64_t dim, float total,
                float* out) {
  std::fill(out, out + dim, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const float* v = keys[j] + half;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) out[d] += w[j] * v[d];
  }
  const float inverse = 1.f / total;
  for (int64_t d = 0; d < dim; ++d) out[d] *= inverse;
}

#if defined(__AVX512F__)
// Head size 16 * C: the query (or the output) in C registers. A plain loop kept its sum in memory:
// 16 dependent scalar adds per key, and a store-to-load chain per value row.
template <int C>
void scores_16(const float* q, const float* const* keys, int64_t half, int64_t n, float scale, float* w) {
  __m512 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    prefetch_row(keys[std::min(j + kAhead, n - 1)] + half, 16 * C);  // for values_16, next
    __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(keys[j]));
    for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(keys[j] + 16 * c), acc);
    w[j] = _mm512_reduce_add_ps(acc) * scale;
  }
}

template <int C>
void values_16(const float* w, const float* const* keys, int64_t half, int64_t n, float total, float* out) {
  __m512 even[C], odd[C];  // two chains of additions, every other key each
  for (int c = 0; c < C; ++c) even[c] = odd[c] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    const __m512 w0 = _mm512_set1_ps(w[j]), w1 = _mm512_set1_ps(w[j + 1]);
    for (int c = 0; c < C; ++c) {
      even[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(keys[j] + half + 16 * c), even[c]);
      odd[c] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(keys[j + 1] + half + 16 * c), odd[c]);
    }
  }
  if (j < n) {
    const __m512 w0 = _mm512_set1_ps(w[j]);
    for (int c = 0; c < C; ++c) even[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(keys[j] + half + 16 * c), even[c]);
  }
  const __m512 inverse = _mm512_set1_ps(1.f / total);
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(_mm512_add_ps(even[c], odd[c]), inverse));
}
#elif defined(__AVX2__) && defined(__FMA__)
// Head size 8 * C on AVX2 (no AVX-512): the same as above on 8 lanes.
template <int C>
void scores_8(const float* q, const float* const* keys, int64_t half, int64_t n, float scale, float* w) {
  __m256 qv[C];
  for (int c = 0; c < C; ++c) qv[c] = _mm256_loadu_ps(q + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    prefetch_row(keys[std::min(j + kAhead, n - 1)] + half, 8 * C);  // for values_8, next
    __m256 a = _mm256_mul_ps(qv[0], _mm256_loadu_ps(keys[j])), b = _mm256_setzero_ps();
    for (int c = 1; c < C; ++c) {
      if (c % 2) b = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(keys[j] + 8 * c), b);
      else a = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(keys[j] + 8 * c), a);
    }
    w[j] = sum_8(_mm256_add_ps(a, b)) * scale;
  }
}

template <int C>
void values_8(const float* w, const float* const* keys, int64_t half, int64_t n, float total, float* out) {
  __m256 even[C], odd[C];  // two chains of additions, every other key each
  for (int c = 0; c < C; ++c) even[c] = odd[c] = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    const __m256 w0 = _mm256_set1_ps(w[j]), w1 = _mm256_set1_ps(w[j + 1]);
    for (int c = 0; c < C; ++c) {
      even[c] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(keys[j] + half + 8 * c), even[c]);
      odd[c] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(keys[j + 1] + half + 8 * c), odd[c]);
    }
  }
  if (j < n) {
    const __m256 w0 = _mm256_set1_ps(w[j]);
    for (int c = 0; c < C; ++c) even[c] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(keys[j] + half + 8 * c), even[c]);
  }
  const __m256 inverse = _mm256_set1_ps(1.f / total);
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(_mm256_add_ps(even[c], odd[c]), inverse));
}
#endif

void scores(const float* q, const float* const* keys, int64_t half, int64_t n, int64_t dim, float scale, float* w) {
#if defined(__AVX512F__)
  switch (dim) {
    case 32: return scores_16<2>(q, keys, half, n, scale, w);
    case 64: return scores_16<4>(q, keys, half, n, scale, w);
    case 128: return scores_16<8>(q, keys, half, n, scale, w);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  switch (dim) {
    case 32: return scores_8<4>(q, keys, half, n, scale, w);
    case 64: return scores_8<8>(q, keys, half, n, scale, w);
  }
#endif
  scores_any(q, keys, half, n, dim, scale, w);
}

void values(const float* w, const float* const* keys, int64_t half, int64_t n, int64_t dim, float total, float* out) {
#if defined(__AVX512F__)
  switch (dim) {
    case 32: return values_16<2>(w, keys, half, n, total, out);
    case 64: return values_16<4>(w, keys, half, n, total, out);
    case 128: return values_16<8>(w, keys, half, n, total, out);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  switch (dim) {
    case 32: return values_8<4>(w, keys, half, n, total, out);
    case 64: return values_8<8>(w, keys, half, n, total, out);
  }
#endif
  values_any(w, keys, half, n, dim, total, out);
}

}  // namespace

void paged_decode(const at::Tensor& query, const at::Tensor& cache, int64_t layer, const at::Tensor& first_rows,
                  const at::Tensor& query_lens, const at::Tensor& seq_lens, const at::Tensor& tables,
                  int64_t window, double scale, const c10::optional<at::Tensor>& sinks, at::Tensor& out) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && cache.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat, "paged_decode: float32 query, cache and out");
  TORCH_CHECK(query.device().is_cpu() && cache.device().is_cpu(), "paged_decode: CPU tensors");
  TORCH_CHECK(query.dim() == 3 && cache.dim() == 6 && out.sizes() == query.sizes(), "paged_decode: shapes");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) && cache.is_contiguous() &&
                  out.is_contiguous(), "paged_decode: contiguous heads of query, contiguous cache and out");
  for (const at::Tensor* t : {&first_rows, &query_lens, &seq_lens, &tables}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "paged_decode: int64 contiguous indices");
  }
  const int64_t num_req = first_rows.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_layers = cache.size(1), block = cache.size(3), num_kv = cache.size(4);
  TORCH_CHECK(cache.size(5) == head_dim && num_heads % num_kv == 0, "paged_decode: head shapes");
  TORCH_CHECK(0 <= layer && layer < num_layers && tables.dim() == 2 && tables.size(0) == num_req &&
                  query_lens.size(0) == num_req && seq_lens.size(0) == num_req, "paged_decode: index shapes");
  const float* sink = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == num_heads,
                "paged_decode: float32 sinks, one per query head");
    sink = sinks->data_ptr<float>();
  }
  const int64_t group = num_heads / num_kv, width = tables.size(1);
  const int64_t token_stride = num_kv * head_dim, half = block * token_stride;  // half: a page's K -> its V
  const int64_t page_stride = num_layers * 2 * half, layer_offset = layer * 2 * half;
  const int64_t query_stride = query.stride(0);
  const float* q = query.data_ptr<float>();
  const float* kv = cache.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t* rows = first_rows.data_ptr<int64_t>();
  const int64_t* qlens = query_lens.data_ptr<int64_t>();
  const int64_t* slens = seq_lens.data_ptr<int64_t>();
  const int64_t* table = tables.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);

  // Work items: (request, KV head), or (request, KV head, query head of its group) when there are too few
  // of those to keep every thread busy (a batch of one has Hkv items: SmolLM2's 3 split 2:1 over two
  // threads); claimed one at a time (work_pool.cpp). A head's result does not depend on who computes it.
  const int64_t splits = num_req * num_kv < 4 * at::get_num_threads() ? group : 1;
  windserve::parallel_chunks(num_req * num_kv * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights;
    std::vector<const float*> keys;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t unit = item / splits, part = item % splits;
      const int64_t g_first = part * group / splits, g_last = (part + 1) * group / splits;
      const int64_t r = unit / num_kv, h = unit % num_kv, seq = slens[r], num_q = qlens[r];
      const int64_t first = window > 0 ? std::max<int64_t>(0, seq - num_q - window + 1) : 0;
      keys.resize(seq - first);  // KV head h's key of every position read, in this layer
      for (int64_t p = first; p < seq; ++p) {
        keys[p - first] = kv + table[r * width + p / block] * page_stride + layer_offset +
                          (p % block) * token_stride + h * head_dim;
        prefetch_row(keys[p - first], head_dim);  // all of them in flight at once: the pages are far apart
      }
      weights.resize(seq - first);
      for (int64_t i = 0; i < num_q; ++i) {
        const int64_t pos = seq - num_q + i;
        const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) - first : 0, n = pos - first + 1 - lo;
        for (int64_t g = g_first; g < g_last; ++g) {
          const int64_t head = h * group + g;
          scores(q + (rows[r] + i) * query_stride + head * head_dim, keys.data() + lo, half, n, head_dim, fscale,
                 weights.data());
          const float total = softmax_numerators(weights.data(), n, sink ? sink + head : nullptr);
          values(weights.data(), keys.data() + lo, half, n, head_dim, total,
                 o + ((rows[r] + i) * num_heads + head) * head_dim);
        }
      }
    }
  });
}
