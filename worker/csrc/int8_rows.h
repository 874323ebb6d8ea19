// The W8A8 kernels' per-row float work (int8_linear.cpp): quantizing an input row to int8,
// and the epilogue that turns a row of int32 sums back into floats. At 32 rows of SmolLM2
// these ran ~40% of the int8 projections' time on scalar code (std::nearbyint is a library
// call), more than AMX's products themselves; here they run 16 or 8 lanes at a time.
//
// Both give the scalar steps' values exactly: the quantizer's 127 / max|x| is one float32
// division, each value one product and one rounding to nearest even (CVTPS2DQ in the
// default rounding mode, as std::nearbyint); the epilogue float(acc) * (s_x * s_w) + b.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "simd.h"
#if defined(__AVX2__)
#include "avx2.h"
#endif

namespace tandem::int8 {

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t kRowLanes = 16;
inline __m512 lanes_of(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 lanes_of(const c10::BFloat16* x) { return load_lanes(x); }
#elif defined(__AVX2__)
constexpr int64_t kRowLanes = 8;
inline __m256 lanes_of(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 lanes_of(const c10::BFloat16* x) {
  return avx2::widen_bf16(reinterpret_cast<const uint16_t*>(x));
}
#else
constexpr int64_t kRowLanes = 0;
#endif

// Float32 and bfloat16 rows take the vector code; any other type the scalar loop.
template <typename T>
constexpr bool kVectorRows = kRowLanes > 0 && (std::is_same_v<T, float> ||
                                               std::is_same_v<T, c10::BFloat16>);

template <typename T>
float row_amax(const T* x, int64_t k) {
  float top = 0.f;
  int64_t i = 0;
  if constexpr (kVectorRows<T>) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 m = _mm512_setzero_ps();
    for (; i + kRowLanes <= k; i += kRowLanes) m = _mm512_max_ps(_mm512_abs_ps(lanes_of(x + i)), m);
    top = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m = _mm256_setzero_ps();
    for (; i + kRowLanes <= k; i += kRowLanes) m = _mm256_max_ps(_mm256_andnot_ps(sign, lanes_of(x + i)), m);
    alignas(32) float l[8];
    _mm256_store_ps(l, m);
    for (float v : l) top = std::max(top, v);
#endif
  }
  for (; i < k; ++i) top = std::max(top, std::fabs(static_cast<float>(x[i])));
  return top;
}

// q[0, k) := x quantized by its largest magnitude (returned), round(x * 127 / max|x|).
template <typename T>
float quantize_row(const T* x, int64_t k, int8_t* q) {
  const float top = row_amax(x, k);
  // 127 / max in float32, then one product and one rounding a value (nearest even, as
  // std::nearbyint in the default mode and torch.round).
  // (a row whose largest magnitude is under ~3.7e-37 overflows 127 / max: quantized to
  // zeros, its scale ~1e-39, on both paths alike)
  const float ratio = top > 0.f ? 127.f / top : 0.f;
  const float inv = std::isfinite(ratio) ? ratio : 0.f;
  int64_t i = 0;
  if constexpr (kVectorRows<T>) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 scale = _mm512_set1_ps(inv);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    for (; i + kRowLanes <= k; i += kRowLanes) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(lanes_of(x + i), scale));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i),
                       _mm512_cvtepi32_epi8(_mm512_min_epi32(_mm512_max_epi32(v, lo), hi)));
    }
#elif defined(__AVX2__)
    const __m256 scale = _mm256_set1_ps(inv);
    for (; i + kRowLanes <= k; i += kRowLanes) {
      const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(lanes_of(x + i), scale));
      // Saturating packs to int8 (|v| <= 127 already, but for NaN's 0x80000000: -127).
      const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
      const __m128i b = _mm_max_epi8(_mm_packs_epi16(w, w), _mm_set1_epi8(-127));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), b);
    }
#endif
  }
  for (; i < k; ++i) {
    const float v = std::nearbyint(static_cast<float>(x[i]) * inv);
    q[i] = static_cast<int8_t>(std::clamp(v, -127.f, 127.f));
  }
  return top;
}

// dst[j] := T(float(acc[j]) * (scale * sw[j]) (+ b[j])) for j < count.
template <typename T>
void dequantize_row(const int32_t* acc, int64_t count, float scale, const float* sw,
                    const float* b, T* dst) {
  int64_t j = 0;
  if constexpr (kVectorRows<T>) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 s = _mm512_set1_ps(scale);
    for (; j + kRowLanes <= count; j += kRowLanes) {
      const __m512 f = _mm512_cvtepi32_ps(_mm512_loadu_si512(acc + j));
      __m512 y = _mm512_mul_ps(f, _mm512_mul_ps(s, _mm512_loadu_ps(sw + j)));
      if (b != nullptr) y = _mm512_add_ps(y, _mm512_loadu_ps(b + j));
      store_lanes(dst + j, y);
    }
#endif
  }
  for (; j < count; ++j) {
    float y = static_cast<float>(acc[j]) * (scale * sw[j]);
    if (b != nullptr) y += b[j];
    dst[j] = static_cast<T>(y);
  }
}

}  // namespace tandem::int8
