// The MoE router's host work in one call: per token the k largest router logits (ties: the lower
// expert), their softmax, then the (token, choice) pairs sorted by expert, stable (as torch's
// topk, softmax, argsort(stable=True), bincount and two gathers, eight ops).
//
//   logits [N, E] float32  ->  tokens [N k] int64 (each pair's token, sorted by expert),
//                              weights [N k] float32 (its routing weight), counts [E] int64
//
// softmax(top) = exp(top - max) * (1 / sum): torch's order of operations, vec_exp.h's exp (its
// last bits differ from torch's).
#include <algorithm>
#include <numeric>
#include <vector>

#include "kernels.h"
#include "vec_exp.h"

std::vector<at::Tensor> moe_route(const at::Tensor& logits, int64_t top_k) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.device().is_cpu() && logits.dim() == 2 &&
                  logits.is_contiguous(), "moe_route: contiguous float32 CPU logits [N, E]");
  const int64_t num_tokens = logits.size(0), num_experts = logits.size(1);
  TORCH_CHECK(1 <= top_k && top_k <= num_experts, "moe_route: 1 <= k <= experts");
  const float* l = logits.data_ptr<float>();
  std::vector<int64_t> chosen(num_tokens * top_k), index(num_experts);
  std::vector<float> chosen_weights(num_tokens * top_k);
  at::Tensor counts = at::zeros({num_experts}, logits.options().dtype(at::kLong));
  int64_t* count = counts.data_ptr<int64_t>();
  for (int64_t n = 0; n < num_tokens; ++n) {
    const float* row = l + n * num_experts;
    std::iota(index.begin(), index.end(), 0);
    std::partial_sort(index.begin(), index.begin() + top_k, index.end(),
                      [row](int64_t a, int64_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
    float sum = 0.f;
    for (int64_t c = 0; c < top_k; ++c) {
      const float e = windserve::exp_clamped(row[index[c]] - row[index[0]]);
      chosen[n * top_k + c] = index[c];
      chosen_weights[n * top_k + c] = e;
      sum += e;
      ++count[index[c]];
    }
    const float inverse = 1.f / sum;
    for (int64_t c = 0; c < top_k; ++c) chosen_weights[n * top_k + c] *= inverse;
  }
  std::vector<int64_t> next(num_experts, 0);  // counting sort: expert e's pairs start after experts < e
  for (int64_t e = 1; e < num_experts; ++e) next[e] = next[e - 1] + count[e - 1];
  at::Tensor tokens = at::empty({num_tokens * top_k}, logits.options().dtype(at::kLong));
  at::Tensor weights = at::empty({num_tokens * top_k}, logits.options());
  int64_t* t = tokens.data_ptr<int64_t>();
  float* w = weights.data_ptr<float>();
  for (int64_t pair = 0; pair < num_tokens * top_k; ++pair) {  // ascending pairs: a stable sort
    const int64_t slot = next[chosen[pair]]++;
    t[slot] = pair / top_k;
    w[slot] = chosen_weights[pair];
  }
  return {tokens, weights, counts};
}
