// gguf_linear's dot products on CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2/3, Intel
// client parts), which ran them in scalar loops: the 32-weight formats' quants widened
// straight into four 8-lane float registers (dequant's operations, in lanes), the other
// formats dequantized a block at a time into L1 and multiplied there; float32 sums, as the
// AVX-512 path computes them (in 8 lanes rather than 16: another order of the same sums).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "avx2.h"
#include "gguf_formats.h"

namespace tandem::gguf_avx2 {

using tandem::gguf::Q4;
using tandem::gguf::Q5;
using tandem::gguf::Q8_0;

// The 32 quants of a block as whole floats (less the centre for the formats without a min),
// weights 8 i .. 8 i + 7 in q[i].
template <bool kHasMin>
inline void quants(const Q4<kHasMin>*, const uint8_t* b, __m256 q[4]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (kHasMin ? 4 : 2)));
  const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
  const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
  for (int i = 0; i < 4; ++i) {
    __m256i v = _mm256_cvtepu8_epi32(parts[i]);
    if (!kHasMin) v = _mm256_sub_epi32(v, _mm256_set1_epi32(8));
    q[i] = _mm256_cvtepi32_ps(v);
  }
}

template <bool kHasMin>
inline void quants(const Q5<kHasMin>*, const uint8_t* b, __m256 q[4]) {
  const uint8_t* p = b + (kHasMin ? 4 : 2);
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4));
  const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
  const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int i = 0; i < 4; ++i) {
    // the fifth bit of weight 8 i + l is bit 8 i + l of qh
    const __m256i set = _mm256_cmpeq_epi32(
        _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits >> (8 * i))), lane_bit), lane_bit);
    __m256i v = _mm256_or_si256(_mm256_cvtepu8_epi32(parts[i]),
                                _mm256_and_si256(set, _mm256_set1_epi32(16)));
    if (!kHasMin) v = _mm256_sub_epi32(v, _mm256_set1_epi32(16));
    q[i] = _mm256_cvtepi32_ps(v);
  }
}

inline void quants(const Q8_0*, const uint8_t* b, __m256 q[4]) {
  for (int i = 0; i < 4; ++i)
    q[i] = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * i))));
}

// gguf_linear.cpp's dot_rows on AVX2: out[t * N + r] = dot(weight row r, x[t * K]) for T
// input rows and R weight rows. `factored` (32-weight formats, a row or two): each block's
// quants dotted with x, then scaled once (and the offset's term from xsum); else every
// block's weights dequantized once for all T rows.
template <typename F, int T, int R, bool kFactored>
void dot_rows(const uint8_t* rows, int64_t row_bytes, int64_t blocks, const float* x, int64_t K,
              const float* xsum, float* out, int64_t N, int64_t prefetch_bytes) {
  __m256 acc[T][R];
  float off[T][R] = {};
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = rows + b * F::kBytes;
    const float* xb = x + b * F::kWeights;
    for (int r = 0; r < R; ++r) _mm_prefetch(block + r * row_bytes + prefetch_bytes, _MM_HINT_T0);
    if constexpr (kFactored) {
      for (int r = 0; r < R; ++r) {
        const uint8_t* wb = block + r * row_bytes;
        __m256 q[4];
        quants(static_cast<const F*>(nullptr), wb, q);
        const __m256 d = _mm256_set1_ps(F::scale(wb));
        for (int t = 0; t < T; ++t) {
          __m256 dot = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb + t * K));
          for (int i = 1; i < 4; ++i) dot = _mm256_fmadd_ps(q[i], _mm256_loadu_ps(xb + t * K + 8 * i), dot);
          acc[t][r] = _mm256_fmadd_ps(d, dot, acc[t][r]);
          if constexpr (F::kHasOffset) off[t][r] += F::offset(wb) * xsum[t * blocks + b];
        }
      }
    } else {
      alignas(32) float w[R][F::kWeights];
      for (int r = 0; r < R; ++r) {
        const uint8_t* wb = block + r * row_bytes;
        if constexpr (F::kWeights == 32) {  // dequant's d q (+ m), in lanes
          __m256 q[4];
          quants(static_cast<const F*>(nullptr), wb, q);
          const __m256 d = _mm256_set1_ps(F::scale(wb));
          for (int i = 0; i < 4; ++i) {
            __m256 v = _mm256_mul_ps(d, q[i]);
            if constexpr (F::kHasOffset) v = _mm256_add_ps(v, _mm256_set1_ps(F::offset(wb)));
            _mm256_store_ps(w[r] + 8 * i, v);
          }
        } else {
          F::dequant(wb, w[r]);
        }
      }
      for (int64_t j = 0; j < F::kWeights; j += 8) {
        for (int t = 0; t < T; ++t) {
          const __m256 xv = _mm256_loadu_ps(xb + t * K + j);
          for (int r = 0; r < R; ++r)
            acc[t][r] = _mm256_fmadd_ps(_mm256_load_ps(w[r] + j), xv, acc[t][r]);
        }
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) out[t * N + r] = tandem::avx2::hsum(acc[t][r]) + off[t][r];
}

}  // namespace tandem::gguf_avx2
