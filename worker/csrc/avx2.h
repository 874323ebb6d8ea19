// 8-lane helpers the AVX2 kernels share (bf16_gemm_avx2.h, decode_attention_avx2.cpp,
// gguf_dot_avx2.h); included only where the compiler targets AVX2.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace tandem::avx2 {

// 8 bfloat16s widened to floats (exact: a bfloat16 is a float's top half).
inline __m256 widen_bf16(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// The sum of v's 8 lanes.
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

}  // namespace tandem::avx2
