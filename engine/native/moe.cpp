// GPT-OSS's expert layer for a decode step's few tokens in one call: for each expert with rows (in
// ascending order), its rows' gate_up matmul, the clamped SwiGLU, the down matmul, and each weighted
// row added to its token. The same arithmetic as the layer's one-call-per-step path
// (engine.models.gpt_oss: rows_linear, clamped_swiglu, add_weighted_rows), so the same bits; what
// goes is ~10 Python-level calls per expert.
//
//   x [N, H]; tokens, weights [M] (the (token, choice) pairs sorted by expert, moe_route's order);
//   counts [E]; gate_up [E, 2I, H] and down [E, H, I], each expert's weight [out, in] contiguous;
//   biases [E, 2I] and [E, H]  ->  out [N, H]
#include <vector>

#include "kernels.h"

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& tokens, const at::Tensor& weights,
                       const at::Tensor& counts, const at::Tensor& gate_up, const at::Tensor& gate_up_bias,
                       const at::Tensor& down, const at::Tensor& down_bias, double alpha, double limit) {
  for (const at::Tensor* t : {&x, &weights, &gate_up, &gate_up_bias, &down, &down_bias}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->is_contiguous(),
                "moe_experts: contiguous float32 CPU tensors");
  }
  TORCH_CHECK(tokens.scalar_type() == at::kLong && counts.scalar_type() == at::kLong && tokens.is_contiguous() &&
                  counts.is_contiguous(), "moe_experts: contiguous int64 tokens and counts");
  const int64_t num_tokens = x.size(0), hidden = x.size(1), experts = gate_up.size(0);
  const int64_t inter2 = gate_up.size(1), inter = inter2 / 2, rows = tokens.numel();
  TORCH_CHECK(x.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(2) == hidden &&
                  inter2 % 2 == 0 && down.size(0) == experts && down.size(1) == hidden && down.size(2) == inter &&
                  gate_up_bias.numel() == experts * inter2 && down_bias.numel() == experts * hidden &&
                  counts.numel() == experts && weights.numel() == rows,
              "moe_experts: x [N, H], gate_up [E, 2I, H], down [E, H, I], biases [E, 2I] and [E, H], counts [E]");
  const int64_t* t = tokens.data_ptr<int64_t>();
  const int64_t* count = counts.data_ptr<int64_t>();
  int64_t total = 0, most = 0;
  for (int64_t e = 0; e < experts; ++e) {
    TORCH_CHECK(count[e] >= 0, "moe_experts: negative count");
    total += count[e];
    most = std::max(most, count[e]);
  }
  TORCH_CHECK(total == rows, "moe_experts: counts must add up to the rows");
  for (int64_t i = 0; i < rows; ++i) TORCH_CHECK(0 <= t[i] && t[i] < num_tokens, "moe_experts: token out of range");

  at::Tensor out = at::zeros_like(x);
  const float* xs = x.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  float* o = out.data_ptr<float>();
  std::vector<float> routed(most * hidden), gate_out(most * inter2), activated(most * inter), down_out(most * hidden);
  const float a = static_cast<float>(alpha), lim = static_cast<float>(limit);
  int64_t first = 0;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = count[e];
    if (n == 0) continue;
    for (int64_t j = 0; j < n; ++j) std::copy_n(xs + t[first + j] * hidden, hidden, routed.data() + j * hidden);
    windserve::linear_rows(routed.data(), n, hidden, gate_up.data_ptr<float>() + e * inter2 * hidden,
                           gate_up_bias.data_ptr<float>() + e * inter2, inter2, hidden, gate_out.data(), inter2);
    for (int64_t j = 0; j < n; ++j) {
      windserve::swiglu_row(gate_out.data() + j * inter2, activated.data() + j * inter, inter, a, lim);
    }
    windserve::linear_rows(activated.data(), n, inter, down.data_ptr<float>() + e * hidden * inter,
                           down_bias.data_ptr<float>() + e * hidden, hidden, inter, down_out.data(), hidden);
    for (int64_t j = 0; j < n; ++j) {
      windserve::add_weighted_row(o + t[first + j] * hidden, down_out.data() + j * hidden, w[first + j], hidden);
    }
    first += n;
  }
  return out;
}
