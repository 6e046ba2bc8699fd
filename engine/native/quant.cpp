// Matmuls on GGUF weights kept in their quantized blocks (llama.cpp's Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K,
// Q6_K), with float32 activations: a decode step reads 4.5-8.5 bits per weight instead of 32.
//
// Block layouts: quant_blocks.h; a row as groups of 32 weights: quant_groups.h.
//
// Each weight is rounded as the gguf package's dequantize rounds it (product, then sum, in float32), so
// the dequantized values equal the float32 weights the GGUF converter wrote bit for bit.
//
// Few rows: quant_gemv.cpp.
//
// Many rows (``quant_matmul``, a prefill): tiles of output rows are dequantized into a float32 buffer
// and multiplied by torch's GEMM, one tile at a time: in float32, or (``bf16``) in bfloat16.
#include <ATen/Parallel.h>

#include <vector>

#include "kernels.h"
#include "quant_groups.h"

namespace {

using windserve::GroupScales;
using windserve::kGroup;
using windserve::kGroupsPer;
using windserve::kHasOffset;

// Sub-block i's 32 weights: d(j) * q[j] + m (quant_groups.h), 8 at a time where AVX2 is, else one by one.
template <int64_t K>
void dequantize_group(const uint8_t* block, int i, float* w) {
  const GroupScales scales = windserve::group_scales<K>(block, i);
#if defined(__AVX2__) && defined(__F16C__)
  __m256 q[4];
  windserve::load_group<K>(block, i, q);
  const __m256 m = _mm256_set1_ps(scales.m);
  for (int p = 0; p < 4; ++p) {
    const __m256 v = _mm256_mul_ps(_mm256_set1_ps(p < 2 ? scales.d0 : scales.d1), q[p]);
    _mm256_storeu_ps(w + 8 * p, kHasOffset<K> ? _mm256_add_ps(v, m) : v);
  }
#else
  for (int j = 0; j < kGroup; ++j) {
    const float v = (j < 16 ? scales.d0 : scales.d1) * static_cast<float>(windserve::q_at<K>(block, i, j));
    w[j] = kHasOffset<K> ? v + scales.m : v;
  }
#endif
}

template <int64_t K>
void dequantize_row_of(const uint8_t* row, int64_t in, float* w) {
  for (int64_t g = 0; g < in / kGroup; ++g) {
    dequantize_group<K>(windserve::block_of_group<K>(row, g), static_cast<int>(g % kGroupsPer<K>), w + g * kGroup);
  }
}

void dequantize_row(int64_t kind, const uint8_t* row, int64_t in, float* w) {
  windserve::dispatch_kind(kind, [&](auto k) { dequantize_row_of<decltype(k)::value>(row, in, w); });
}

}  // namespace

namespace windserve {

// The weight's in-features, checked against its blocks [out, in / W * block_bytes] (W weights a block).
int64_t check_quant_blocks(const at::Tensor& blocks, int64_t kind, const char* name) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.device().is_cpu() && blocks.dim() == 2 &&
                  blocks.is_contiguous(),
              name, ": blocks must be a contiguous uint8 CPU tensor [out, row bytes]");
  const int64_t bytes = block_bytes(kind);
  TORCH_CHECK(blocks.size(1) % bytes == 0, name, ": a row of ", blocks.size(1), " bytes is not whole blocks of ",
              bytes);
  return blocks.size(1) / bytes * block_weights(kind);
}

const float* optional_bias(const c10::optional<at::Tensor>& bias, int64_t out, const char* name) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == out, name,
              ": a contiguous float32 bias [out]");
  return bias->data_ptr<float>();
}

}  // namespace windserve

at::Tensor quant_rows(const at::Tensor& blocks, int64_t kind, const at::Tensor& index) {
  const int64_t in = windserve::check_quant_blocks(blocks, kind, "quant_rows");
  TORCH_CHECK(index.scalar_type() == at::kLong && index.device().is_cpu() && index.dim() == 1 &&
                  index.is_contiguous(),
              "quant_rows: a contiguous int64 CPU index [n]");
  const int64_t n = index.size(0), out = blocks.size(0), row_bytes = blocks.size(1);
  const int64_t* rows = index.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(rows[r] >= 0 && rows[r] < out, "quant_rows: index ", rows[r], " out of range for ", out, " rows");
  }
  at::Tensor w = at::empty({n, in}, blocks.options().dtype(at::kFloat));
  const uint8_t* data = blocks.data_ptr<uint8_t>();
  float* ws = w.data_ptr<float>();
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / in), [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) dequantize_row(kind, data + rows[r] * row_bytes, in, ws + r * in);
  });
  return w;
}

at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                        const c10::optional<at::Tensor>& bias, int64_t tile_rows, bool bf16) {
  const int64_t in = windserve::check_quant_blocks(blocks, kind, "quant_matmul");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() == 2 && x.size(1) == in,
              "quant_matmul: a float32 CPU x [N, in] with in = ", in);
  TORCH_CHECK(tile_rows >= 1, "quant_matmul: tile_rows must be at least 1");
  const int64_t out = blocks.size(0), row_bytes = blocks.size(1);
  windserve::optional_bias(bias, out, "quant_matmul");
  at::Tensor y = at::empty({x.size(0), out}, x.options());
  // bf16: x and each tile's weights rounded to bf16 (to nearest even), their products summed in float32 by
  // torch's bf16 GEMM (oneDNN: AMX or AVX512-BF16), its output rounded to bf16, the bias added in float32.
  // A row is dequantized to float32 in a buffer that stays in L1, then rounded into the bf16 tile.
  const at::Tensor xs = bf16 ? x.to(at::kBFloat16) : x;
  at::Tensor tile = at::empty({std::min(tile_rows, out), in}, xs.options());
  const uint8_t* data = blocks.data_ptr<uint8_t>();
  for (int64_t first = 0; first < out; first += tile_rows) {
    const int64_t n = std::min(tile_rows, out - first);
    at::parallel_for(first, first + n, std::max<int64_t>(1, 16384 / in), [&](int64_t lo, int64_t hi) {
      if (!bf16) {
        float* ws = tile.data_ptr<float>();
        for (int64_t o = lo; o < hi; ++o) dequantize_row(kind, data + o * row_bytes, in, ws + (o - first) * in);
        return;
      }
      std::vector<float> row(static_cast<size_t>(in));
      c10::BFloat16* ws = tile.data_ptr<c10::BFloat16>();
      for (int64_t o = lo; o < hi; ++o) {
        dequantize_row(kind, data + o * row_bytes, in, row.data());
        c10::BFloat16* w = ws + (o - first) * in;
        for (int64_t j = 0; j < in; ++j) w[j] = c10::BFloat16(row[j]);
      }
    });
    at::Tensor part = y.narrow(1, first, n);
    const at::Tensor w = tile.narrow(0, 0, n);
    if (bf16) {
      part.copy_(at::mm(xs, w.t()));
      if (bias.has_value() && bias->defined()) part.add_(bias->narrow(0, first, n));
    } else if (bias.has_value() && bias->defined()) {
      part.copy_(at::addmm(bias->narrow(0, first, n), x, w.t()));
    } else {
      part.copy_(at::mm(x, w.t()));
    }
  }
  return y;
}
