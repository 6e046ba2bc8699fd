// GGUF's quantized blocks (llama.cpp's Q8_0, Q4_0, Q4_1, Q5_0 and K-quants Q4_K, Q5_K, Q6_K) as quant.cpp
// and quant_gemv.cpp read them. A weight [out, in] is stored as out rows of in / W blocks, each block W
// weights of one row (W = 32, or 256 for a K-quant's super-block):
//
//     Q8_0  34 bytes  | d f16 | q[0..31] int8 |              w[j] = q[j] * d
//     Q4_0  18 bytes  | d f16 | qs[0..15] |                  w[j] = (nibble(j) - 8) * d
//     Q4_1  20 bytes  | d f16 | m f16 | qs[0..15] |          w[j] = d * nibble(j) + m
//     Q5_0  22 bytes  | d f16 | qh u32 | qs[0..15] |         w[j] = (nibble(j) + 16 * bit j of qh - 16) * d
//
//     nibble(j) = qs[j] & 15 for j < 16, qs[j - 16] >> 4 for j >= 16 (low halves first)
//
// K-quants, 256 weights in 8 sub-blocks of 32 (i < 8, weight l < 32 of the sub-block):
//
//     Q4_K 144 bytes  | d f16 | dmin f16 | scales[12] | qs[128] |
//     Q5_K 176 bytes  | d f16 | dmin f16 | scales[12] | qh[32] | qs[128] |
//
//         w = (d * sc_i) * q - dmin * m_i          (sc_i, m_i: 6 bits each, packed in scales[12] below)
//         Q4_K: q = qs[32 (i / 2) + l] >> 4 (i % 2) & 15   (sub-blocks 2c, 2c + 1 share 32 bytes: low, high)
//         Q5_K: q = the same | (qh[l] >> i & 1) << 4
//
//         scales[12]   bytes 0-3: sc_0..3 in bits 0-5, sc_4..7's bits 4-5 in bits 6-7
//                      bytes 4-7: m_0..3  in bits 0-5, m_4..7's  bits 4-5 in bits 6-7
//                      bytes 8-11: sc_4..7's bits 0-3 in bits 0-3, m_4..7's bits 0-3 in bits 4-7
//
//     Q6_K 210 bytes  | ql[128] | qh[64] | scales[16] int8 | d f16 |     16 sub-blocks of 16 weights
//
//         weight j = 128 h + 32 s + l  (h < 2, s < 4, l < 32):
//         q = (ql[64 h + 32 (s % 2) + l] >> 4 (s / 2) & 15 | (qh[32 h + l] >> 2 s & 3) << 4) - 32
//         w = (d * scales[j / 16]) * q
//
// Every product and sum above is one float32 operation, rounded, in the order written (gguf's numpy
// dequantizer's order), so a dequantized weight equals the GGUF converter's float32 weight bit for bit.
#pragma once

#include <ATen/ATen.h>

#include <cstring>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace windserve {

// ggml's type ids, as GGUF files store them
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
constexpr int64_t kGroup = 32;  // weights the kernels widen and scale at a time: a block, or a sub-block

template <int64_t K>
constexpr bool kIsKQuant = K == kQ4_K || K == kQ5_K || K == kQ6_K;

template <int64_t K>
constexpr int64_t kBlockWeights = kIsKQuant<K> ? 256 : 32;

template <int64_t K>
constexpr int64_t kBlockBytes = K == kQ8_0   ? 34
                                : K == kQ4_0 ? 18
                                : K == kQ4_1 ? 20
                                : K == kQ5_0 ? 22
                                : K == kQ4_K ? 144
                                : K == kQ5_K ? 176
                                             : 210;

// f(std::integral_constant<int64_t, K>) for the kind's K; an unknown kind fails the call.
template <typename F>
inline auto dispatch_kind(int64_t kind, F&& f) {
  switch (kind) {
    case kQ4_0: return f(std::integral_constant<int64_t, kQ4_0>());
    case kQ4_1: return f(std::integral_constant<int64_t, kQ4_1>());
    case kQ5_0: return f(std::integral_constant<int64_t, kQ5_0>());
    case kQ8_0: return f(std::integral_constant<int64_t, kQ8_0>());
    case kQ4_K: return f(std::integral_constant<int64_t, kQ4_K>());
    case kQ5_K: return f(std::integral_constant<int64_t, kQ5_K>());
    case kQ6_K: return f(std::integral_constant<int64_t, kQ6_K>());
    default:
      TORCH_CHECK(false, "quantized weights: unsupported kind ", kind,
                  " (Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14)");
  }
}

inline int64_t block_bytes(int64_t kind) {
  return dispatch_kind(kind, [](auto k) { return kBlockBytes<decltype(k)::value>; });
}

inline int64_t block_weights(int64_t kind) {
  return dispatch_kind(kind, [](auto k) { return kBlockWeights<decltype(k)::value>; });
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

// The weight's in-features, checked against its blocks [out, in / W * block bytes] (quant.cpp).
int64_t check_quant_blocks(const at::Tensor& blocks, int64_t kind, const char* name);

// The bias's data, or null when there is none; checked to be float32 [out] (quant.cpp).
const float* optional_bias(const c10::optional<at::Tensor>& bias, int64_t out, const char* name);

}  // namespace windserve
