// Small AVX-512 helpers shared by the native kernels, with scalar fallbacks where the
// compiler targets a CPU without AVX-512 (the kernels are compiled with -march=native).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tandem {

// Calls body(T{}) with T the element type of `type` (float, c10::BFloat16 or c10::Half):
// the one dtype switch every kernel uses (vLLM's VLLM_DISPATCH_FLOATING_TYPES, as a
// template instead of a macro).
template <typename F>
void dispatch_float_types(at::ScalarType type, const char* name, F&& body) {
  switch (type) {
    case at::kFloat:
      body(float{});
      break;
    case at::kBFloat16:
      body(c10::BFloat16{});
      break;
    case at::kHalf:
      body(c10::Half{});
      break;
    default:
      TORCH_CHECK(false, name, " supports float32, bfloat16 and float16, not ", type);
  }
}

// Every kernel reads raw CPU pointers: tensors elsewhere are refused before they are touched.
template <typename... Tensors>
inline void check_cpu(const char* kernel, const Tensors&... tensors) {
  const auto check = [kernel](const at::Tensor& t) {
    TORCH_CHECK(t.device().is_cpu(), kernel, " takes CPU tensors, got one on ", t.device());
  };
  (check(tensors), ...);
}


#if defined(__AVX512F__)
constexpr int kLanes = 16;

inline __m512 load_lanes(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_lanes(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load_lanes(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Stores float lanes as T, rounding to nearest even as c10's conversions do.
inline void store_lanes(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline __m256i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}
inline void store_lanes(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(v));
}
inline void store_lanes(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// v rounded to T and back: the value a T tensor would hold.
template <typename T>
inline __m512 round_lanes(__m512 v);
template <>
inline __m512 round_lanes<float>(__m512 v) { return v; }
template <>
inline __m512 round_lanes<c10::BFloat16>(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(v)), 16));
}
template <>
inline __m512 round_lanes<c10::Half>(__m512 v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// exp(x) for x < 88 (below -87, 0): 2^k * e^r with |r| <= ln2/2, e^r by its Taylor series to r^7
// (relative error ~1e-8, below float32 rounding of the sums it feeds).
inline __m512 exp_lanes(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693147180559945309f), x);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, k);
}
#endif

template <typename T>
inline float dot(const float* query, const T* key, int64_t dim) {
#if defined(__AVX512F__)
  if (dim % kLanes == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < dim; j += kLanes)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(query + j), load_lanes(key + j), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float acc = 0.f;
  for (int64_t j = 0; j < dim; ++j) acc += query[j] * static_cast<float>(key[j]);
  return acc;
}

template <typename T>
inline void add_scaled(float* acc, float weight, const T* value, int64_t dim) {
#if defined(__AVX512F__)
  if (dim % kLanes == 0) {
    const __m512 w = _mm512_set1_ps(weight);
    for (int64_t j = 0; j < dim; j += kLanes)
      _mm512_storeu_ps(acc + j, _mm512_fmadd_ps(w, load_lanes(value + j), _mm512_loadu_ps(acc + j)));
    return;
  }
#endif
  for (int64_t j = 0; j < dim; ++j) acc[j] += weight * static_cast<float>(value[j]);
}

// scores[0, n) := exp(scores - max); returns their sum (and the max, where asked).
inline float softmax_numerators(float* scores, int64_t n, float* max_out = nullptr) {
  float top = scores[0];
  int64_t t = 0;
#if defined(__AVX512F__)
  // The max in vectors: a scalar max is one long dependency chain.
  __m512 tops = _mm512_set1_ps(top);
  for (; t + kLanes <= n; t += kLanes) tops = _mm512_max_ps(tops, _mm512_loadu_ps(scores + t));
  top = _mm512_reduce_max_ps(tops);
#endif
  for (; t < n; ++t) top = std::max(top, scores[t]);
  if (max_out != nullptr) *max_out = top;
  float sum = 0.f;
  t = 0;
#if defined(__AVX512F__)
  const __m512 shift = _mm512_set1_ps(top);
  __m512 total = _mm512_setzero_ps();
  for (; t + kLanes <= n; t += kLanes) {
    const __m512 e = exp_lanes(_mm512_sub_ps(_mm512_loadu_ps(scores + t), shift));
    _mm512_storeu_ps(scores + t, e);
    total = _mm512_add_ps(total, e);
  }
  sum = _mm512_reduce_add_ps(total);
#endif
  for (; t < n; ++t) {
    scores[t] = std::exp(scores[t] - top);
    sum += scores[t];
  }
  return sum;
}

}  // namespace tandem
