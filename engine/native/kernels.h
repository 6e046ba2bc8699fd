// The native kernels' entry points (bindings.cpp exposes them to Python as engine.native's module).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <functional>
#include <vector>

void paged_decode(const at::Tensor& query, const at::Tensor& cache, int64_t layer, const at::Tensor& first_rows,
                  const at::Tensor& query_lens, const at::Tensor& seq_lens, const at::Tensor& tables,
                  int64_t window, double scale, const c10::optional<at::Tensor>& sinks, at::Tensor& out);

at::Tensor clamped_swiglu(const at::Tensor& gate_up, double alpha, double limit);

void add_weighted_rows(at::Tensor& out, const at::Tensor& tokens, const at::Tensor& rows, const at::Tensor& weights);

at::Tensor rotate_half(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

std::vector<at::Tensor> moe_route(const at::Tensor& logits, int64_t top_k);

at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& tokens, const at::Tensor& weights,
                       const at::Tensor& counts, const at::Tensor& gate_up, const at::Tensor& gate_up_bias,
                       const at::Tensor& down, const at::Tensor& down_bias, double alpha, double limit);

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

at::Tensor argmax_rows(const at::Tensor& logits);

void write_kv(at::Tensor& cache, int64_t layer, const at::Tensor& write_rows, const at::Tensor& key,
              const at::Tensor& value);

// Matmuls on GGUF quantized blocks [out, in / W * block bytes] (W = 32 or 256), kind = ggml's type id (quant.cpp).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                        const c10::optional<at::Tensor>& bias);

at::Tensor quant_rows(const at::Tensor& blocks, int64_t kind, const at::Tensor& index);

at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t kind,
                        const c10::optional<at::Tensor>& bias, int64_t tile_rows, bool bf16);

// How parallel_chunks' helpers wait between jobs (work_pool.cpp): true for decode-only steps (yield the
// core to other processes), false for prefill and mixed steps (pause, then sleep).
void set_pool_yields(bool yields);

namespace windserve {
// f(first, last) over [0, n) in chunks of `grain`, on the calling thread and work_pool.cpp's helpers
// (at::get_num_threads() in all); returns when every chunk is done. A helper the OS has not scheduled
// takes no chunk and is not waited for (at::parallel_for's barrier waits for every thread).
void parallel_chunks(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& f);
// y[t, :] = weight @ x[t, :] + bias for t < rows (gemv.cpp); weight [out, in] contiguous, bias may be null.
void linear_rows(const float* x, int64_t rows, int64_t x_stride, const float* weight, const float* bias,
                 int64_t out, int64_t in, float* y, int64_t y_stride);
// GPT-OSS's clamped SwiGLU of one interleaved gate/up row [2 * width] into y [width] (swiglu.cpp).
void swiglu_row(const float* x, float* y, int64_t width, float alpha, float limit);
// y[d] += weight * v[d], the product rounded before the sum (combine.cpp).
void add_weighted_row(float* y, const float* v, float weight, int64_t width);

// The few-row matmuls (gemv.cpp, quant_gemv.cpp) ask for each weight row's bytes kPrefetchBytes ahead
// while the row is dotted. On the 2-core Intel VM of 2026-12-05 the hardware prefetchers left those
// loops latency-bound: a one-thread Q4_1 [1536, 576] matmul over 142 MB of weights streamed 2.8-3.1
// GB/s (10 GB/s L2-hot) and 6.8-6.9 with 2-4 KiB ahead; the SmolLM2 batch-1 decode step went from 13.4
// to 8.9 ms at 2 threads; 8 KiB ahead: 10.1 ms (docs/benchmarks.md, 2026-12-05 at 7c21fbd).
constexpr int64_t kPrefetchBytes = 2048;
// The `bytes` at `row` + kPrefetchBytes, line by line, none at or past `end` (the weight's last byte + 1).
inline void prefetch_ahead(const void* row, int64_t bytes, const void* end) {
  const char* ahead = static_cast<const char*>(row) + kPrefetchBytes;
  const int64_t room = static_cast<const char*>(end) - ahead;
  for (int64_t l = 0; l < std::min(bytes, room); l += 64) __builtin_prefetch(ahead + l);
}
}  // namespace windserve
