// The layers of a Llama-family decoder (Llama, Mistral, Qwen2: engine.models.llama) for a step of a few
// rows (decode, speculative verify), in one call from Python: the same kernels and ATen ops, in the same
// order and on the same views, as the Python modules (engine.models.decoder), so the hidden states come
// out bit for bit the same. What goes is Python's module calls, views and dispatch around each kernel:
// ~200 us a layer, 6 of the 15 ms of SmolLM2's batch-1 step on the 2-core box.
//
// Per layer, h the hidden rows [N, hidden]:
//
//     qkv = linear(rms_norm(h), W_qkv).view(N, -1, D)
//     qk  = rotate_half(qkv[:, :Hq + Hkv], cos, sin);  q = qk[:, :Hq],  k = qk[:, Hq:],  v = qkv[:, Hq + Hkv:]
//     write_kv(cache, k, v);  a = paged_decode(q)                  (every request in place: the caller checks)
//     h   = h + linear(a.reshape(N, -1), W_o)
//     x   = rms_norm(h)
//     h   = h + linear(silu(gate) * up, W_down)    gate, up = linear(x, W_gate_up).chunk(2), or two linears
//
// A linear is quant_linear on GGUF blocks (kind 2, 3 or 8) or rows_linear on a float32 [out, in] weight
// (kind 0). The Python side (engine.models.native_stack) builds a stack only where every layer's modules
// would call exactly these, and runs it only for steps whose every group attends in place.
#include <torch/extension.h>  // pybind11: only the two files that bind (the rest parse ATen alone, ~3x faster)

#include "kernels.h"

#include <vector>

namespace {

struct Linear {
  at::Tensor weight;
  int64_t kind = 0;
  c10::optional<at::Tensor> bias;

  at::Tensor operator()(const at::Tensor& x) const {
    return kind == 0 ? rows_linear(x, weight, bias) : quant_linear(x, weight, kind, bias);
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;
  Linear qkv, o, gate, up, down;  // up.weight undefined: gate is gate and up fused
  int64_t group = 0, index = 0;
};

}  // namespace

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {}

  // weights / kinds / biases: qkv, o, gate (or gate and up fused), up (an empty tensor when fused), down
  void add_layer(const at::Tensor& input_norm, const at::Tensor& post_norm, const std::vector<at::Tensor>& weights,
                 const std::vector<int64_t>& kinds, const std::vector<c10::optional<at::Tensor>>& biases,
                 int64_t group, int64_t index) {
    TORCH_CHECK(weights.size() == 5 && kinds.size() == 5 && biases.size() == 5,
                "DecodeStack.add_layer: qkv, o, gate, up, down");
    Linear* linears[5];
    Layer layer;
    linears[0] = &layer.qkv, linears[1] = &layer.o, linears[2] = &layer.gate, linears[3] = &layer.up;
    linears[4] = &layer.down;
    for (int i = 0; i < 5; ++i) *linears[i] = Linear{weights[i], kinds[i], biases[i]};
    layer.input_norm = input_norm, layer.post_norm = post_norm, layer.group = group, layer.index = index;
    layers_.push_back(std::move(layer));
  }

  // Per layer group g (the ordinal each layer was added with): its KV pages, the step's write rows,
  // its in-place queries (first rows, query lengths, sequence lengths, page tables) and window (0: none).
  at::Tensor run(at::Tensor hidden, const at::Tensor& cos, const at::Tensor& sin, std::vector<at::Tensor> caches,
                 const std::vector<at::Tensor>& write_rows, const std::vector<at::Tensor>& first_rows,
                 const std::vector<at::Tensor>& query_lens, const std::vector<at::Tensor>& seq_lens,
                 const std::vector<at::Tensor>& tables, const std::vector<int64_t>& windows) const {
    const int64_t rows = hidden.size(0), qk_heads = num_heads_ + num_kv_heads_;
    for (const Layer& layer : layers_) {
      const int64_t g = layer.group;
      TORCH_CHECK(g < static_cast<int64_t>(caches.size()), "DecodeStack.run: no pages for group ", g);
      const at::Tensor qkv = layer.qkv(norm(hidden, layer.input_norm)).view({rows, -1, head_dim_});
      const at::Tensor qk = rotate_half(qkv.slice(1, 0, qk_heads), cos, sin);
      const at::Tensor q = qk.slice(1, 0, num_heads_);
      write_kv(caches[g], layer.index, write_rows[g], qk.slice(1, num_heads_), qkv.slice(1, qk_heads));
      at::Tensor attn = at::empty(q.sizes(), q.options());
      paged_decode(q, caches[g], layer.index, first_rows[g], query_lens[g], seq_lens[g], tables[g], windows[g],
                   scale_, c10::nullopt, attn);
      hidden = hidden + layer.o(attn.reshape({rows, -1}));
      const at::Tensor x = norm(hidden, layer.post_norm);
      at::Tensor gated;
      if (layer.up.weight.defined() && layer.up.weight.numel() > 0) {
        gated = at::silu(layer.gate(x)) * layer.up(x);
      } else {
        const std::vector<at::Tensor> parts = layer.gate(x).chunk(2, -1);
        gated = at::silu(parts[0]) * parts[1];
      }
      hidden = hidden + layer.down(gated.contiguous());
    }
    return hidden;
  }

 private:
  at::Tensor norm(const at::Tensor& x, const at::Tensor& weight) const {
    return rms_norm(x.reshape({-1, x.size(-1)}).contiguous(), weight, eps_).view(x.sizes());
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  std::vector<Layer> layers_;
};

void bind_decode_stack(pybind11::module& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("run", &DecodeStack::run, pybind11::call_guard<pybind11::gil_scoped_release>());  // see bindings.cpp
}
