// The GGUF weight formats as gguf_q8.cpp's integer dot products read them: every block cut
// into sub-blocks of 32 weights, each 32 small integers q (unsigned, or signed for Q8_0)
// with, for its two halves of 16, a scale s and an offset o such that weight i of the half
// is s * q_i + o (the centre of the formats without a min is folded into o: Q4_0's
// d * (q - 8) is s = d, o = -8 d). A sub-block dotted with 32 int8 activations a of scale
// dx is then dx * (s_lo * sum_lo(q a) + s_hi * sum_hi(q a) + o_lo * sum_lo(a) + o_hi *
// sum_hi(a)): integer sums and a float epilogue, as llama.cpp's vec_dot computes them.
//
// Two readers: scalar (q into a byte array; the portable build and the tests' reference
// order) and, where the compiler targets AVX2, the 32 bytes in one register.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "gguf_formats.h"

namespace tandem::gguf_q8 {

using namespace tandem::gguf;

// A sub-block's scales and offsets, per half of 16 weights.
struct SubScales {
  float s_lo, s_hi, o_lo, o_hi;
};

// The two float16s at p and p + 2 (a block's d and m, or d and dmin): one conversion with
// F16C (exact either way).
inline void two_halves(const uint8_t* p, float* first, float* second) {
#if defined(__F16C__)
  int32_t bits;
  std::memcpy(&bits, p, 4);
  const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
  *first = _mm_cvtss_f32(v);
  *second = _mm_cvtss_f32(_mm_movehdup_ps(v));
#else
  *first = half_at(p);
  *second = half_at(p + 2);
#endif
}

template <typename F>
struct Reader;

#if defined(__AVX2__)
// 16 bytes of nibbles as 32 bytes: the low nibbles (weights 0-15), then the high ones.
inline __m256i nibbles(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask));
}

// Byte i is 0xFF where bit i of `bits` is set, else 0.
inline __m256i bytes_of_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}
#endif

template <bool kHasMin>
struct Reader<Q4<kHasMin>> {
  static constexpr int kSubBlocks = 1;
  static constexpr bool kSigned = false, kTwoScales = false;
  static SubScales scales(const uint8_t* b, int) {
    if constexpr (kHasMin) {
      float d, m;
      two_halves(b, &d, &m);
      return {d, d, m, m};
    }
    const float d = half_at(b);
    return {d, d, -8.0f * d, -8.0f * d};
  }
  static void quants(const uint8_t* b, int, uint8_t* q) {
    const uint8_t* qs = b + (kHasMin ? 4 : 2);
    for (int j = 0; j < 16; ++j) {
      q[j] = qs[j] & 0x0F;
      q[j + 16] = qs[j] >> 4;
    }
  }
#if defined(__AVX2__)
  static __m256i quants(const uint8_t* b, int) { return nibbles(b + (kHasMin ? 4 : 2)); }
#endif
};

template <bool kHasMin>
struct Reader<Q5<kHasMin>> {
  static constexpr int kSubBlocks = 1;
  static constexpr bool kSigned = false, kTwoScales = false;
  static SubScales scales(const uint8_t* b, int) {
    if constexpr (kHasMin) {
      float d, m;
      two_halves(b, &d, &m);
      return {d, d, m, m};
    }
    const float d = half_at(b);
    return {d, d, -16.0f * d, -16.0f * d};
  }
  static void quants(const uint8_t* b, int, uint8_t* q) {
    const uint8_t* p = b + (kHasMin ? 4 : 2);
    uint32_t qh;
    std::memcpy(&qh, p, 4);
    for (int j = 0; j < 16; ++j) {
      q[j] = static_cast<uint8_t>((p[4 + j] & 0x0F) | (((qh >> j) & 1) << 4));
      q[j + 16] = static_cast<uint8_t>((p[4 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
  }
#if defined(__AVX2__)
  static __m256i quants(const uint8_t* b, int) {
    const uint8_t* p = b + (kHasMin ? 4 : 2);
    uint32_t qh;
    std::memcpy(&qh, p, 4);
    return _mm256_or_si256(nibbles(p + 4),
                           _mm256_and_si256(bytes_of_bits(qh), _mm256_set1_epi8(0x10)));
  }
#endif
};

template <>
struct Reader<Q8_0> {
  static constexpr int kSubBlocks = 1;
  static constexpr bool kSigned = true, kTwoScales = false;
  static SubScales scales(const uint8_t* b, int) {
    const float d = half_at(b);
    return {d, d, 0.0f, 0.0f};
  }
  static void quants(const uint8_t* b, int, uint8_t* q) { std::memcpy(q, b + 2, 32); }
#if defined(__AVX2__)
  static __m256i quants(const uint8_t* b, int) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  }
#endif
};

template <bool kFiveBits>
struct Reader<QK45<kFiveBits>> {
  static constexpr int kSubBlocks = 8;
  static constexpr bool kSigned = false, kTwoScales = false;
  static SubScales scales(const uint8_t* b, int g) {
    int sc, mn;
    scale_min_k4(g, b + 4, &sc, &mn);
    float d, dmin;
    two_halves(b, &d, &dmin);
    const float s = d * static_cast<float>(sc), o = -(dmin * static_cast<float>(mn));
    return {s, s, o, o};
  }
  static void quants(const uint8_t* b, int g, uint8_t* q) {
    int wide[32];
    float scale, min;
    QK45<kFiveBits>::sub_block(b, g, wide, &scale, &min);
    for (int l = 0; l < 32; ++l) q[l] = static_cast<uint8_t>(wide[l]);
  }
#if defined(__AVX2__)
  static __m256i quants(const uint8_t* b, int g) {
    const __m256i qs = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(b + (kFiveBits ? 48 : 16) + 32 * (g / 2)));
    __m256i q = _mm256_and_si256(_mm256_srli_epi16(qs, 4 * (g % 2)), _mm256_set1_epi8(0x0F));
    if constexpr (kFiveBits) {
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh, g), _mm256_set1_epi8(0x01));
      q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
    }
    return q;
  }
#endif
};

template <>
struct Reader<Q6_K> {
  static constexpr int kSubBlocks = 8;
  static constexpr bool kSigned = false, kTwoScales = true;
  static SubScales scales(const uint8_t* b, int g) {
    const float lo = Q6_K::scale(b, 2 * g), hi = Q6_K::scale(b, 2 * g + 1);
    return {lo, hi, -32.0f * lo, -32.0f * hi};
  }
  static void quants(const uint8_t* b, int g, uint8_t* q) {
    int centred[32];
    Q6_K::group(b, g, centred);
    for (int l = 0; l < 32; ++l) q[l] = static_cast<uint8_t>(centred[l] + 32);
  }
#if defined(__AVX2__)
  static __m256i quants(const uint8_t* b, int g) {
    const int half = g / 4;
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half + 32 * (g % 2)));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
    const __m256i low4 = _mm256_and_si256(_mm256_srli_epi16(lo, 4 * ((g % 4) / 2)), _mm256_set1_epi8(0x0F));
    const __m256i high2 = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * (g % 4)), _mm256_set1_epi8(0x03));
    return _mm256_or_si256(low4, _mm256_slli_epi16(high2, 4));
  }
#endif
};

}  // namespace tandem::gguf_q8
