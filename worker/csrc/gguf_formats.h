// GGUF block formats, as the file ships them: each format's size, its exact float32
// dequantization (gguf-py's, operation for operation) and, for the 32-weight formats with
// AVX-512, its quants in registers. Shared by the float32-row kernels (gguf_linear.cpp)
// and the bfloat16-row kernels (gguf_bf16_dot.cpp, gguf_gemm.cpp, gguf_matmul.cpp).
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

namespace tandem::gguf {

// ggml's type ids (GGMLQuantizationType in gguf-py) of the block formats supported here.
enum GgmlType : int64_t {
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
};

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// The bfloat16 bits of a small integer (|v| < 256, so exact).
constexpr uint16_t bf16_of(int v) {
  if (v == 0) return 0;
  const int a = v < 0 ? -v : v;
  int e = 0;
  while ((a >> (e + 1)) != 0) ++e;
  const int mantissa = (a << (7 - e)) & 0x7F;
  return static_cast<uint16_t>((v < 0 ? 0x8000 : 0) | ((127 + e) << 7) | mantissa);
}

// A lookup table of N bfloat16 bits for VPERMW: entry i is the bfloat16 of value(i).
template <int N, typename Value>
constexpr std::array<uint16_t, N> bf16_table(Value value) {
  std::array<uint16_t, N> out{};
  for (int i = 0; i < N; ++i) out[i] = bf16_of(value(i));
  return out;
}

// Each block's sum of bfloat16 rows x (count blocks of `weights` values, one after
// another), in float32 in order: the term a format's min multiplies.
inline std::vector<float> bf16_block_sums(const uint16_t* x, int64_t count, int64_t weights) {
  std::vector<float> sums(count);
  for (int64_t i = 0; i < count; ++i) {
    float sum = 0.0f;
    for (int64_t j = 0; j < weights; ++j)
      sum += static_cast<float>(c10::BFloat16(x[i * weights + j], c10::BFloat16::from_bits()));
    sums[i] = sum;
  }
  return sums;
}

// --- the block formats ------------------------------------------------------------------
// Each has kWeights and kBytes per block and dequant(block, out): float32 exactly as
// gguf-py's dequantize_blocks computes it. The 32-weight formats also have, with
// AVX-512, quants(block, lo, hi): the 32 quants as whole floats in two registers (less
// the centre for the formats without a min), beside scale(block) and, where kHasOffset,
// offset(block): weight j = scale * quant j (+ offset), as dequant computes it.

// Q4_0 (d * (q - 8)), Q4_1 (d * q + m): byte j holds weight j (low nibble) and j + 16.
template <bool kHasMin>
struct Q4 {
  static constexpr int64_t kWeights = 32, kBytes = kHasMin ? 20 : 18;
  static constexpr bool kHasOffset = kHasMin;
  static float scale(const uint8_t* b) { return half_at(b); }
  static float offset(const uint8_t* b) { return kHasMin ? half_at(b + 2) : 0.0f; }
#if defined(__AVX512F__)
  static inline void quants(const uint8_t* b, __m512& lo, __m512& hi) {
    const __m512i q = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (kHasMin ? 4 : 2))));
    __m512i ql = _mm512_and_si512(q, _mm512_set1_epi32(0x0F)), qh = _mm512_srli_epi32(q, 4);
    if (!kHasMin) {
      ql = _mm512_sub_epi32(ql, _mm512_set1_epi32(8));
      qh = _mm512_sub_epi32(qh, _mm512_set1_epi32(8));
    }
    lo = _mm512_cvtepi32_ps(ql);
    hi = _mm512_cvtepi32_ps(qh);
  }
#endif
  static void dequant(const uint8_t* b, float* out) {
    const float d = half_at(b), m = kHasMin ? half_at(b + 2) : 0.0f;
    const uint8_t* qs = b + (kHasMin ? 4 : 2);
    for (int j = 0; j < 16; ++j) {
      const int lo = qs[j] & 0x0F, hi = qs[j] >> 4;
      out[j] = kHasMin ? d * static_cast<float>(lo) + m : d * static_cast<float>(lo - 8);
      out[j + 16] = kHasMin ? d * static_cast<float>(hi) + m : d * static_cast<float>(hi - 8);
    }
  }
};

// Q5_0 (d * (q - 16)), Q5_1 (d * q + m): the fifth bit of weight j is bit j of qh.
template <bool kHasMin>
struct Q5 {
  static constexpr int64_t kWeights = 32, kBytes = kHasMin ? 24 : 22;
  static constexpr bool kHasOffset = kHasMin;
  static float scale(const uint8_t* b) { return half_at(b); }
  static float offset(const uint8_t* b) { return kHasMin ? half_at(b + 2) : 0.0f; }
#if defined(__AVX512F__)
  static inline void quants(const uint8_t* b, __m512& lo, __m512& hi) {
    const uint8_t* p = b + (kHasMin ? 4 : 2);
    uint32_t bits;
    std::memcpy(&bits, p, 4);
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4)));
    const __m512i sixteen = _mm512_set1_epi32(16);
    __m512i ql = _mm512_or_si512(_mm512_and_si512(q, _mm512_set1_epi32(0x0F)),
                                 _mm512_maskz_mov_epi32(static_cast<__mmask16>(bits), sixteen));
    __m512i qh = _mm512_or_si512(_mm512_srli_epi32(q, 4),
                                 _mm512_maskz_mov_epi32(static_cast<__mmask16>(bits >> 16), sixteen));
    if (!kHasMin) {
      ql = _mm512_sub_epi32(ql, sixteen);
      qh = _mm512_sub_epi32(qh, sixteen);
    }
    lo = _mm512_cvtepi32_ps(ql);
    hi = _mm512_cvtepi32_ps(qh);
  }
#endif
  static void dequant(const uint8_t* b, float* out) {
    const float d = half_at(b), m = kHasMin ? half_at(b + 2) : 0.0f;
    const uint8_t* p = b + (kHasMin ? 4 : 2);
    uint32_t qh;
    std::memcpy(&qh, p, 4);
    const uint8_t* qs = p + 4;
    for (int j = 0; j < 16; ++j) {
      const int lo = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
      const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      out[j] = kHasMin ? d * static_cast<float>(lo) + m : d * static_cast<float>(lo - 16);
      out[j + 16] = kHasMin ? d * static_cast<float>(hi) + m : d * static_cast<float>(hi - 16);
    }
  }
};

// Q8_0: q * d.
struct Q8_0 {
  static constexpr int64_t kWeights = 32, kBytes = 34;
  static constexpr bool kHasOffset = false;
  static float scale(const uint8_t* b) { return half_at(b); }
#if defined(__AVX512F__)
  static inline void quants(const uint8_t* b, __m512& lo, __m512& hi) {
    const __m128i* q = reinterpret_cast<const __m128i*>(b + 2);
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
  }
#endif
  static void dequant(const uint8_t* b, float* out) {
    const float d = half_at(b);
    const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(qs[j]) * d;
  }
};

// The 6-bit scale and min of sub-block j (of 8) packed in a K-quant's 12 scale bytes.
inline void scale_min_k4(int j, const uint8_t* s, int* scale, int* min) {
  if (j < 4) {
    *scale = s[j] & 63;
    *min = s[j + 4] & 63;
  } else {
    *scale = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K and Q5_K: 8 sub-blocks of 32, (d * scale) * q - (dmin * min).
template <bool kFiveBits>
struct QK45 {
  static constexpr int64_t kWeights = 256, kBytes = kFiveBits ? 176 : 144;
  // Sub-block g's 32 quants (0..15, or 0..31 with the fifth bit), its d * scale and its
  // dmin * min: weight l is scale * q[l] - min.
  static void sub_block(const uint8_t* b, int g, int* q, float* scale, float* min) {
    int sc, mn;
    scale_min_k4(g, b + 4, &sc, &mn);
    *scale = half_at(b) * static_cast<float>(sc);
    *min = half_at(b + 2) * static_cast<float>(mn);
    const uint8_t* qh = b + 16;  // Q5_K only
    const uint8_t* qs = b + (kFiveBits ? 48 : 16) + 32 * (g / 2);
    const int shift = 4 * (g % 2);
    for (int l = 0; l < 32; ++l) {
      q[l] = (qs[l] >> shift) & 0x0F;
      if (kFiveBits) q[l] |= ((qh[l] >> g) & 1) << 4;
    }
  }
  static void dequant(const uint8_t* b, float* out) {
    for (int g = 0; g < 8; ++g) {
      int q[32];
      float dl, ml;
      sub_block(b, g, q, &dl, &ml);
      for (int l = 0; l < 32; ++l) out[32 * g + l] = dl * static_cast<float>(q[l]) - ml;
    }
  }
};

// Q6_K: 16 sub-blocks of 16, (d * scale) * (q - 32).
struct Q6_K {
  static constexpr int64_t kWeights = 256, kBytes = 210;
  // The 32 quants (q - 32: -32..31) of weights 32 g to 32 g + 31 (g of 8).
  static void group(const uint8_t* b, int g, int* q) {
    const int half = g / 4;
    const uint8_t* lo = b + 64 * half + 32 * (g % 2);
    const int lo_shift = 4 * ((g % 4) / 2);
    const uint8_t* hi = b + 128 + 32 * half;
    const int hi_shift = 2 * (g % 4);
    for (int l = 0; l < 32; ++l)
      q[l] = (((lo[l] >> lo_shift) & 0x0F) | (((hi[l] >> hi_shift) & 3) << 4)) - 32;
  }
  // d * scale of sub-block s (of 16): weights 16 s to 16 s + 15.
  static float scale(const uint8_t* b, int s) {
    return half_at(b + 208) * static_cast<float>(reinterpret_cast<const int8_t*>(b + 192)[s]);
  }
  static void dequant(const uint8_t* b, float* out) {
    for (int g = 0; g < 8; ++g) {
      int q[32];
      group(b, g, q);
      for (int l = 0; l < 32; ++l)
        out[32 * g + l] = scale(b, (32 * g + l) / 16) * static_cast<float>(q[l]);
    }
  }
};

#if defined(__AVX512F__)
// A 32-weight block's weights in two registers, not stored: dequant's operations.
template <typename F>
inline void lanes(const uint8_t* b, __m512& lo, __m512& hi) {
  F::quants(b, lo, hi);
  const __m512 d = _mm512_set1_ps(F::scale(b));
  lo = _mm512_mul_ps(d, lo);
  hi = _mm512_mul_ps(d, hi);
  if constexpr (F::kHasOffset) {
    const __m512 m = _mm512_set1_ps(F::offset(b));
    lo = _mm512_add_ps(lo, m);
    hi = _mm512_add_ps(hi, m);
  }
}
#endif

// One block's weights as gguf_dequantize's bfloat16 holds them: dequant's float32 rounded
// once to nearest even, as Tensor.to(torch.bfloat16) rounds it.
template <typename F>
inline void dequant_bf16(const uint8_t* block, c10::BFloat16* out) {
#if defined(__AVX512F__)
  if constexpr (F::kWeights == 32) {
    __m512 lo, hi;
    lanes<F>(block, lo, hi);
    tandem::store_lanes(out, lo);
    tandem::store_lanes(out + 16, hi);
    return;
  }
#endif
  alignas(64) float weights[F::kWeights];
  F::dequant(block, weights);
  for (int64_t j = 0; j < F::kWeights; ++j) out[j] = c10::BFloat16(weights[j]);
}

// Calls body(Format{}) for a ggml type id: the one switch over block formats.
template <typename Body>
void with_format(int64_t type, Body&& body) {
  switch (type) {
    case kQ4_0: return body(Q4<false>{});
    case kQ4_1: return body(Q4<true>{});
    case kQ5_0: return body(Q5<false>{});
    case kQ5_1: return body(Q5<true>{});
    case kQ8_0: return body(Q8_0{});
    case kQ4_K: return body(QK45<false>{});
    case kQ5_K: return body(QK45<true>{});
    case kQ6_K: return body(Q6_K{});
    default: TORCH_CHECK(false, "GGUF tensor type ", type, " has no kernel here");
  }
}

// The row length in blocks, after checking the weight's shape against the format.
template <typename F>
int64_t checked_blocks(const char* kernel, const at::Tensor& weight, int64_t in) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kByte && weight.dim() == 2 &&
                  weight.is_contiguous(),
              kernel, ": the weight is a contiguous CPU uint8 [out, row_bytes] tensor");
  TORCH_CHECK(in > 0 && in % F::kWeights == 0, kernel, ": in_features ", in,
              " is not a multiple of the block's ", F::kWeights, " weights");
  const int64_t blocks = in / F::kWeights;
  TORCH_CHECK(weight.size(1) == blocks * F::kBytes, kernel, ": a row of ", in, " weights takes ",
              blocks * F::kBytes, " bytes, got ", weight.size(1));
  return blocks;
}

}  // namespace tandem::gguf
