// A step's new K and V rows into their pages in one call: what paged_attention did with two
// index_copy_ (and the row arithmetic, reshapes and casts around them, ~8 torch ops a layer).
//
//   cache [pages, layers, 2, B, Hkv, D] float32 contiguous; write_rows [N]: token n's row in the flat
//   [pages * layers * 2 * B, Hkv * D] view for layer 0's K (engine.attention_plan); layer l's K row is
//   write_rows[n] + 2 l B, its V row B further. key, value [N, Hkv, D], each token's Hkv x D contiguous.
#include <algorithm>

#include "kernels.h"

void write_kv(at::Tensor& cache, int64_t layer, const at::Tensor& write_rows, const at::Tensor& key,
              const at::Tensor& value) {
  TORCH_CHECK(cache.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat && write_rows.scalar_type() == at::kLong &&
                  cache.device().is_cpu() && cache.dim() == 6 && cache.is_contiguous() && write_rows.is_contiguous(),
              "write_kv: a contiguous float32 CPU cache [pages, layers, 2, B, Hkv, D] and int64 write_rows");
  const int64_t block = cache.size(3), width = cache.size(4) * cache.size(5), num_tokens = write_rows.numel();
  TORCH_CHECK(0 <= layer && layer < cache.size(1), "write_kv: layer out of range");
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == num_tokens && t->size(1) == cache.size(4) &&
                    t->size(2) == cache.size(5) && t->stride(2) == 1 && t->stride(1) == t->size(2),
                "write_kv: key and value [N, Hkv, D], each token's rows contiguous");
  }
  const int64_t total_rows = cache.numel() / width, k_shift = 2 * layer * block;
  const int64_t* rows = write_rows.data_ptr<int64_t>();
  for (int64_t n = 0; n < num_tokens; ++n) {
    TORCH_CHECK(0 <= rows[n] && rows[n] + k_shift + block < total_rows, "write_kv: write row out of range");
  }
  float* base = cache.data_ptr<float>();
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  for (int64_t n = 0; n < num_tokens; ++n) {
    std::copy_n(k + n * key.stride(0), width, base + (rows[n] + k_shift) * width);
    std::copy_n(v + n * value.stride(0), width, base + (rows[n] + k_shift + block) * width);
  }
}
