// GGUF's quantized blocks (llama.cpp's Q8_0, Q4_0, Q4_1) as quant.cpp and quant_gemv.cpp read them.
//
// A weight [out, in] is stored as out rows of in / 32 blocks, each block 32 weights of one row:
//
//     Q8_0  34 bytes  | d f16 | q[0..31] int8 |              w[j] = q[j] * d
//     Q4_0  18 bytes  | d f16 | qs[0..15] |                  w[j] = (nibble(j) - 8) * d
//     Q4_1  20 bytes  | d f16 | m f16 | qs[0..15] |          w[j] = d * nibble(j) + m
//
//     nibble(j) = qs[j] & 15 for j < 16, qs[j - 16] >> 4 for j >= 16 (low halves first)
#pragma once

#include <torch/extension.h>

#include <cstring>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace windserve {

constexpr int64_t kBlock = 32;  // weights per block, every format here
// ggml's type ids, as GGUF files store them
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;

template <int64_t K>
constexpr int64_t kBlockBytes = K == kQ8_0 ? 34 : (K == kQ4_0 ? 18 : 20);

inline int64_t block_bytes(int64_t kind) {
  switch (kind) {
    case kQ8_0: return kBlockBytes<kQ8_0>;
    case kQ4_0: return kBlockBytes<kQ4_0>;
    case kQ4_1: return kBlockBytes<kQ4_1>;
    default: TORCH_CHECK(false, "quantized weights: unsupported kind ", kind, " (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8)");
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// The weight's in-features, checked against its blocks [out, in / 32 * block bytes] (quant.cpp).
int64_t check_quant_blocks(const at::Tensor& blocks, int64_t kind, const char* name);

// The bias's data, or null when there is none; checked to be float32 [out] (quant.cpp).
const float* optional_bias(const c10::optional<at::Tensor>& bias, int64_t out, const char* name);

}  // namespace windserve
