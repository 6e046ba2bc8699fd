// The native kernels' entry points (bindings.cpp exposes them to Python as engine.native's module).
#pragma once

#include <torch/extension.h>

#include <vector>

void paged_decode(const at::Tensor& query, const at::Tensor& cache, int64_t layer, const at::Tensor& first_rows,
                  const at::Tensor& query_lens, const at::Tensor& seq_lens, const at::Tensor& tables,
                  int64_t window, double scale, const c10::optional<at::Tensor>& sinks, at::Tensor& out);

at::Tensor clamped_swiglu(const at::Tensor& gate_up, double alpha, double limit);

void add_weighted_rows(at::Tensor& out, const at::Tensor& tokens, const at::Tensor& rows, const at::Tensor& weights);

at::Tensor rotate_half(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

std::vector<at::Tensor> moe_route(const at::Tensor& logits, int64_t top_k);
