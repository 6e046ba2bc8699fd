// Rotary embedding (rotate-half layout) of q and k in one pass, the arithmetic of transformers'
// apply_rotary_pos_emb element for element (a product, a product, their difference or sum, each
// rounded; the build turns off fused multiply-adds): bit-identical to the torch formula, where
// torch runs chunk, four products, a difference, a sum and a concatenation.
//
//   x [N, H, D] (rows may be strided, heads contiguous), cos / sin [N, D / 2]
//   out[n, h, :D/2] = x1 * cos - x2 * sin;   out[n, h, D/2:] = x2 * cos + x1 * sin
#include <ATen/Parallel.h>

#include "kernels.h"

at::Tensor rotate_half(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rotate_half: float32 tensors");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) &&
                  x.size(2) % 2 == 0, "rotate_half: x [N, H, D] on the CPU, heads contiguous, D even");
  const int64_t num = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == num &&
                  cos.size(1) == half && sin.sizes() == cos.sizes(), "rotate_half: cos, sin [N, D / 2] contiguous");
  at::Tensor out = at::empty({num, heads, dim}, x.options());
  const float* in = x.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t row_stride = x.stride(0);
  at::parallel_for(0, num, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* cn = c + n * half;
      const float* sn = s + n * half;
      for (int64_t h = 0; h < heads; ++h) {
        const float* x1 = in + n * row_stride + h * dim;
        const float* x2 = x1 + half;
        float* y1 = o + (n * heads + h) * dim;
        float* y2 = y1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i] * cn[i], b = x2[i] * sn[i], d = x2[i] * cn[i], e = x1[i] * sn[i];
          y1[i] = a - b;
          y2[i] = d + e;
        }
      }
    }
  });
  return out;
}
