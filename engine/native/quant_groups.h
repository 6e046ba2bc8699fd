// A row of GGUF blocks (quant_blocks.h) as groups of 32 weights, the unit that quant.cpp dequantizes and
// quant_gemv.cpp widens in registers: group g of a row holds weights [32 g, 32 g + 32) and lies in block
// g / (W / 32), as its sub-block i = g % (W / 32) (a 32-weight block is its own only group):
//
//     w[j] = d(j) * q[j] + m        q[j] an integer (-32..63), widened exactly to float32
//                                   d(j) = d0 for j < 16, d1 for j >= 16 (they differ only in Q6_K)
//                                   m = Q4_1's m, Q4_K / Q5_K's -(dmin * m_i), else 0
//
// d0, d1 and m are rounded as quant_blocks.h writes them (Q4_K: d * sc_i, one float32 product), and
// d(j) * q[j] + m is the dequantizer's order: a - b and a + (-b) are the same float32 operation, so
// Q4_K's d q - dmin m_i needs no sign of its own.
#pragma once

#include "quant_blocks.h"

namespace windserve {

template <int64_t K>
constexpr int64_t kGroupsPer = kBlockWeights<K> / kGroup;

template <int64_t K>
constexpr bool kHasOffset = K == kQ4_1 || K == kQ4_K || K == kQ5_K;

template <int64_t K>
inline const uint8_t* block_of_group(const uint8_t* row, int64_t g) {
  return row + g / kGroupsPer<K> * kBlockBytes<K>;
}

struct GroupScales {
  float d0, d1, m;
};

// Q4_K / Q5_K's 6-bit scale and min of sub-block i from scales[12] (diagram: quant_blocks.h).
inline void k_scale_min(const uint8_t* s, int i, int* sc, int* mn) {
  if (i < 4) {
    *sc = s[i] & 63, *mn = s[i + 4] & 63;
  } else {
    *sc = (s[i + 4] & 15) | ((s[i - 4] >> 6) << 4), *mn = (s[i + 4] >> 4) | ((s[i] >> 6) << 4);
  }
}

template <int64_t K>
inline GroupScales group_scales(const uint8_t* block, int i) {
  if constexpr (K == kQ4_K || K == kQ5_K) {
    int sc, mn;
    k_scale_min(block + 4, i, &sc, &mn);
    const float d = half_at(block) * static_cast<float>(sc);
    return {d, d, -(half_at(block + 2) * static_cast<float>(mn))};
  } else if constexpr (K == kQ6_K) {
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
    const float d = half_at(block + 208);
    return {d * static_cast<float>(scales[2 * i]), d * static_cast<float>(scales[2 * i + 1]), 0.0f};
  } else {
    const float d = half_at(block);
    return {d, d, K == kQ4_1 ? half_at(block + 2) : 0.0f};
  }
}

// q[j] of sub-block i, one weight at a time (the scalar paths).
template <int64_t K>
inline int q_at(const uint8_t* block, int i, int j) {
  const auto nibble = [](const uint8_t* qs, int j) { return j < 16 ? (qs[j] & 15) : (qs[j - 16] >> 4); };
  if constexpr (K == kQ8_0) return reinterpret_cast<const int8_t*>(block + 2)[j];
  if constexpr (K == kQ4_0) return nibble(block + 2, j) - 8;
  if constexpr (K == kQ4_1) return nibble(block + 4, j);
  if constexpr (K == kQ5_0) {
    uint32_t qh;
    std::memcpy(&qh, block + 2, sizeof(qh));
    return (nibble(block + 6, j) | static_cast<int>((qh >> j) & 1) << 4) - 16;
  }
  if constexpr (K == kQ4_K) return block[16 + 32 * (i / 2) + j] >> (4 * (i % 2)) & 15;
  if constexpr (K == kQ5_K) {
    return (block[48 + 32 * (i / 2) + j] >> (4 * (i % 2)) & 15) | ((block[16 + j] >> i) & 1) << 4;
  }
  if constexpr (K == kQ6_K) {
    const int h = i / 4, s = i % 4;
    const int low = block[64 * h + 32 * (s % 2) + j] >> (4 * (s / 2)) & 15;
    return (low | ((block[128 + 32 * h + j] >> (2 * s)) & 3) << 4) - 32;
  }
}

#if defined(__AVX2__)
// 8 bytes from p, each widened to an int32 lane (vpmovzxbd m64).
inline __m256i widen8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// Lanes (v >> shift) & mask, shift the same for every lane.
inline __m256i bits_of(__m256i v, int shift, int mask) {
  return _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi32(mask));
}

// Sub-block i's 32 integers q[j] as four 8-float vectors, in order of j.
template <int64_t K>
inline void load_group(const uint8_t* block, int i, __m256 q[4]) {
  __m256i w[4];
  if constexpr (K == kQ8_0) {
    for (int p = 0; p < 4; ++p)
      w[p] = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * p)));
  } else if constexpr (K == kQ4_0 || K == kQ4_1 || K == kQ5_0) {
    // a byte holds weights j and j + 16: split after widening
    const uint8_t* qs = block + (K == kQ4_0 ? 2 : (K == kQ4_1 ? 4 : 6));
    const __m256i a = widen8(qs), b = widen8(qs + 8);
    w[0] = bits_of(a, 0, 15), w[1] = bits_of(b, 0, 15), w[2] = bits_of(a, 4, 15), w[3] = bits_of(b, 4, 15);
    if constexpr (K == kQ5_0) {
      uint32_t qh;
      std::memcpy(&qh, block + 2, sizeof(qh));
      const __m256i bits = _mm256_set1_epi32(static_cast<int>(qh));
      for (int p = 0; p < 4; ++p) {  // lane l of vector p: bit 8 p + l
        const __m256i shifts = _mm256_setr_epi32(8 * p, 8 * p + 1, 8 * p + 2, 8 * p + 3, 8 * p + 4, 8 * p + 5,
                                                 8 * p + 6, 8 * p + 7);
        const __m256i high = _mm256_and_si256(_mm256_srlv_epi32(bits, shifts), _mm256_set1_epi32(1));
        w[p] = _mm256_or_si256(w[p], _mm256_slli_epi32(high, 4));
      }
    }
  } else if constexpr (K == kQ4_K || K == kQ5_K) {
    const uint8_t* qs = block + (K == kQ4_K ? 16 : 48) + 32 * (i / 2);
    for (int p = 0; p < 4; ++p) {
      w[p] = bits_of(widen8(qs + 8 * p), 4 * (i % 2), 15);
      if constexpr (K == kQ5_K) {
        w[p] = _mm256_or_si256(w[p], _mm256_slli_epi32(bits_of(widen8(block + 16 + 8 * p), i, 1), 4));
      }
    }
  } else {
    const int h = i / 4, s = i % 4;
    for (int p = 0; p < 4; ++p) {
      const __m256i low = bits_of(widen8(block + 64 * h + 32 * (s % 2) + 8 * p), 4 * (s / 2), 15);
      const __m256i high = bits_of(widen8(block + 128 + 32 * h + 8 * p), 2 * s, 3);
      w[p] = _mm256_or_si256(low, _mm256_slli_epi32(high, 4));
    }
  }
  constexpr int kZero = K == kQ4_0 ? 8 : (K == kQ5_0 ? 16 : (K == kQ6_K ? 32 : 0));
  for (int p = 0; p < 4; ++p) {
    if constexpr (kZero != 0) w[p] = _mm256_sub_epi32(w[p], _mm256_set1_epi32(kZero));
    q[p] = _mm256_cvtepi32_ps(w[p]);
  }
}
#endif

}  // namespace windserve
