#include <torch/extension.h>  // pybind11: only the two files that bind (the rest parse ATen alone, ~3x faster)

#include "kernels.h"

void bind_decode_stack(pybind11::module& m);  // decode_stack.cpp

// The kernels that run long enough to matter release the GIL (`nogil`): an engine steps on a thread of its
// own (actors.engine_loop) while the actor's event loop streams the last step's tokens, in Python.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("paged_decode", &paged_decode, "attention of a few new queries per request, read from the KV pages", nogil);
  m.def("clamped_swiglu", &clamped_swiglu, "GPT-OSS's clamped SwiGLU over interleaved gate/up rows, one pass");
  m.def("add_weighted_rows", &add_weighted_rows, "out[tokens[i]] += weights[i] * rows[i], in order of i");
  m.def("rotate_half", &rotate_half, "rotary embedding (rotate-half) of [N, H, D] rows, one pass");
  m.def("moe_route", &moe_route, "top-k experts, their softmax, the pairs sorted by expert");
  m.def("rows_linear", &rows_linear, "x @ weight.T + bias for a few rows, each weight row streamed once", nogil);
  m.def("moe_experts", &moe_experts, "GPT-OSS's expert layer for a few tokens (pairs sorted by expert), one call", nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows in one pass");
  m.def("argmax_rows", &argmax_rows, "each row's first index of its maximum (its first NaN if it has one)");
  m.def("quant_linear", &quant_linear, "x @ W.T + bias for a few rows, W in GGUF blocks (Q8_0 ... Q6_K)", nogil);
  m.def("quant_rows", &quant_rows, "rows of a GGUF-quantized weight, dequantized to float32", nogil);
  m.def("quant_matmul", &quant_matmul, "x @ W.T + bias for many rows, W dequantized a tile at a time", nogil);
  m.def("set_pool_yields", &set_pool_yields, "how the few-row kernels' helper threads wait between jobs");
  bind_decode_stack(m);
  m.def("write_kv", &write_kv, "a step's new K and V rows of one layer into their pages");
}
