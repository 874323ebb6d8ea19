// Linear layers over GGUF-quantized weights, kept as the file ships them:
// y = x W^T (+ bias) with W an [out, row_bytes] array of GGUF blocks.
//
// A decode step reads every weight once; held as Q4_1 a weight is 0.625 bytes instead of
// bfloat16's 2, so the step reads ~3x fewer bytes. Each output row is dequantized into a
// float32 buffer (in L1: a row is at most a few thousand weights) and dotted with every
// input row, 16 lanes at a time; the products are summed in float32 and rounded once.
//
// Dequantization follows gguf-py's (the code transformers loads GGUF files with)
// operation for operation, without fused multiply-adds (the build passes
// -ffp-contract=off), so a dequantized weight equals the reference's bit for bit:
// tests/unit/test_gguf_linear.py checks every supported type.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "simd.h"

namespace {

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

constexpr int64_t kRowsPerTile = 8;       // input rows whose sums stay in registers
constexpr int64_t kOutputsPerTask = 16;   // at::parallel_for grain, in output rows
// How far ahead of a row's stream to prefetch: of 2, 4, 8, 16 and 32 KiB, 8 read 66 MB of
// Q4_1 rows fastest at one input row (13 GB/s on 2 threads; 2 KiB: 8.5 GB/s).
constexpr int64_t kPrefetchBytes = 8192;

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
  static void dequant(const uint8_t* b, float* out) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;  // Q5_K only
    const uint8_t* qs = b + (kFiveBits ? 48 : 16);
    for (int g = 0; g < 8; ++g) {
      int sc, mn;
      scale_min_k4(g, scales, &sc, &mn);
      const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(mn);
      const uint8_t* q = qs + 32 * (g / 2);
      const int shift = 4 * (g % 2);
      for (int l = 0; l < 32; ++l) {
        int v = (q[l] >> shift) & 0x0F;
        if (kFiveBits) v |= ((qh[l] >> g) & 1) << 4;
        out[32 * g + l] = dl * static_cast<float>(v) - ml;
      }
    }
  }
};

// Q6_K: 16 sub-blocks of 16, (d * scale) * (q - 32).
struct Q6_K {
  static constexpr int64_t kWeights = 256, kBytes = 210;
  static void dequant(const uint8_t* b, float* out) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int g = 0; g < 8; ++g) {  // 8 groups of 32 weights
      const int half = g / 4;
      const uint8_t* lo = ql + 64 * half + 32 * (g % 2);
      const int lo_shift = 4 * ((g % 4) / 2);
      const uint8_t* hi = qh + 32 * half;
      const int hi_shift = 2 * (g % 4);
      for (int l = 0; l < 32; ++l) {
        const int q = (((lo[l] >> lo_shift) & 0x0F) | (((hi[l] >> hi_shift) & 3) << 4)) - 32;
        const int e = 32 * g + l;
        out[e] = (d * static_cast<float>(scales[e / 16])) * static_cast<float>(q);
      }
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

// Up to this many input rows a 32-weight block is dotted as scale * (quants . x) (+ offset
// * sum(x)): the quants are converted and the scale applied once per row of the block, not
// per weight, which is most of the work when one or two rows share a weight (batch-1
// decode). Past it, dequantizing a block once for all the rows costs less.
constexpr int kFactoredRows = 2;

template <typename F>
constexpr bool factored(int T) {
  return F::kWeights == 32 && T <= kFactoredRows;
}

// out[t * N + r] = dot(weight row r, x[t * K]) for T input rows and R consecutive weight
// rows (independent sums, so FMA latency overlaps), each row dequantized block by block
// (32-weight formats straight into registers), float32 lanes summed once. Reads ahead of
// the stream with prefetches: rows are short (a few hundred bytes), too short for the
// hardware prefetcher to ramp up on its own.
template <typename F, int T, int R>
void dot_rows(const uint8_t* rows, int64_t row_bytes, int64_t blocks, const float* x, int64_t K,
              const float* xsum, float* out, int64_t N) {
#if defined(__AVX512F__)
  __m512 acc[T][R];
  float off[T][R] = {};
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = rows + b * F::kBytes;
    const float* xb = x + b * F::kWeights;
    for (int r = 0; r < R; ++r) _mm_prefetch(block + r * row_bytes + kPrefetchBytes, _MM_HINT_T0);
    if constexpr (factored<F>(T)) {
      for (int r = 0; r < R; ++r) {
        const uint8_t* wb = block + r * row_bytes;
        __m512 lo, hi;
        F::quants(wb, lo, hi);
        const __m512 d = _mm512_set1_ps(F::scale(wb));
        for (int t = 0; t < T; ++t) {
          __m512 dot = _mm512_mul_ps(lo, _mm512_loadu_ps(xb + t * K));
          dot = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + t * K + 16), dot);
          acc[t][r] = _mm512_fmadd_ps(d, dot, acc[t][r]);
          if constexpr (F::kHasOffset) off[t][r] += F::offset(wb) * xsum[t * blocks + b];
        }
      }
    } else if constexpr (F::kWeights == 32) {
      __m512 lo[R], hi[R];
      for (int r = 0; r < R; ++r) lanes<F>(block + r * row_bytes, lo[r], hi[r]);
      for (int t = 0; t < T; ++t) {
        const __m512 xl = _mm512_loadu_ps(xb + t * K), xh = _mm512_loadu_ps(xb + t * K + 16);
        for (int r = 0; r < R; ++r) {
          acc[t][r] = _mm512_fmadd_ps(lo[r], xl, acc[t][r]);
          acc[t][r] = _mm512_fmadd_ps(hi[r], xh, acc[t][r]);
        }
      }
    } else {
      alignas(64) float w[R][F::kWeights];
      for (int r = 0; r < R; ++r) F::dequant(block + r * row_bytes, w[r]);
      for (int64_t j = 0; j < F::kWeights; j += 16) {
        for (int t = 0; t < T; ++t) {
          const __m512 xv = _mm512_loadu_ps(xb + t * K + j);
          for (int r = 0; r < R; ++r)
            acc[t][r] = _mm512_fmadd_ps(_mm512_load_ps(w[r] + j), xv, acc[t][r]);
        }
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) out[t * N + r] = _mm512_reduce_add_ps(acc[t][r]) + off[t][r];
#else
  float sum[T][R] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    for (int r = 0; r < R; ++r) {
      float w[F::kWeights];
      F::dequant(rows + r * row_bytes + b * F::kBytes, w);
      for (int t = 0; t < T; ++t)
        for (int64_t j = 0; j < F::kWeights; ++j)
          sum[t][r] += w[j] * x[t * K + b * F::kWeights + j];
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) out[t * N + r] = sum[t][r];
#endif
}

// Weight rows per call for T input rows: as many independent sums as registers allow.
constexpr int rows_for(int T) { return T <= 2 ? 4 : 2; }

// Output rows [begin, end) for input rows [m0, m0 + T), R weight rows at a time.
template <typename F, int T>
void tile(const uint8_t* w, int64_t row_bytes, int64_t blocks, const float* x, int64_t K,
          const float* xsum, float* y, int64_t N, int64_t begin, int64_t end) {
  constexpr int R = rows_for(T);
  int64_t n = begin;
  for (; n + R <= end; n += R)
    dot_rows<F, T, R>(w + n * row_bytes, row_bytes, blocks, x, K, xsum, y + n, N);
  for (; n < end; ++n) dot_rows<F, T, 1>(w + n * row_bytes, row_bytes, blocks, x, K, xsum, y + n, N);
}

template <typename F>
void tile_any(int64_t T, const uint8_t* w, int64_t row_bytes, int64_t blocks, const float* x,
              int64_t K, const float* xsum, float* y, int64_t N, int64_t begin, int64_t end) {
  switch (T) {
    case 1: return tile<F, 1>(w, row_bytes, blocks, x, K, xsum, y, N, begin, end);
    case 2: return tile<F, 2>(w, row_bytes, blocks, x, K, xsum, y, N, begin, end);
    case 3: return tile<F, 3>(w, row_bytes, blocks, x, K, xsum, y, N, begin, end);
    case 4: return tile<F, 4>(w, row_bytes, blocks, x, K, xsum, y, N, begin, end);
    case 5: return tile<F, 5>(w, row_bytes, blocks, x, K, xsum, y, N, begin, end);
    case 6: return tile<F, 6>(w, row_bytes, blocks, x, K, xsum, y, N, begin, end);
    case 7: return tile<F, 7>(w, row_bytes, blocks, x, K, xsum, y, N, begin, end);
    default: return tile<F, 8>(w, row_bytes, blocks, x, K, xsum, y, N, begin, end);
  }
}

}  // namespace

at::Tensor gguf_dequantize(const at::Tensor& weight, int64_t type, int64_t in_features,
                           bool bfloat16) {
  const int64_t N = weight.size(0);
  at::Tensor out =
      at::empty({N, in_features}, weight.options().dtype(bfloat16 ? at::kBFloat16 : at::kFloat));
  with_format(type, [&](auto format) {
    using F = decltype(format);
    const int64_t blocks = checked_blocks<F>("gguf_dequantize", weight, in_features);
    const uint8_t* w = weight.data_ptr<uint8_t>();
    at::parallel_for(0, N * blocks, kOutputsPerTask * blocks, [&](int64_t begin, int64_t end) {
      if (!bfloat16) {
        float* y = out.data_ptr<float>();
        for (int64_t i = begin; i < end; ++i) F::dequant(w + i * F::kBytes, y + i * F::kWeights);
        return;
      }
      // Rounded once to nearest even, as Tensor.to(torch.bfloat16) rounds the float32.
      c10::BFloat16* y = out.data_ptr<c10::BFloat16>();
      for (int64_t i = begin; i < end; ++i) {
        c10::BFloat16* dst = y + i * F::kWeights;
#if defined(__AVX512F__)
        if constexpr (F::kWeights == 32) {
          __m512 lo, hi;
          lanes<F>(w + i * F::kBytes, lo, hi);
          tandem::store_lanes(dst, lo);
          tandem::store_lanes(dst + 16, hi);
          continue;
        }
#endif
        alignas(64) float block[F::kWeights];
        F::dequant(w + i * F::kBytes, block);
        for (int64_t j = 0; j < F::kWeights; ++j) dst[j] = c10::BFloat16(block[j]);
      }
    });
  });
  return out;
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(),
              "gguf_linear: x is a contiguous CPU float32 [rows, in] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "gguf_linear: the bias is a contiguous float32 [out] tensor");
    b = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  with_format(type, [&](auto format) {
    using F = decltype(format);
    const int64_t blocks = checked_blocks<F>("gguf_linear", weight, K);
    const uint8_t* w = weight.data_ptr<uint8_t>();
    const int64_t row_bytes = weight.size(1);
    const float* xp = x.data_ptr<float>();
    float* y = out.data_ptr<float>();
    // Only the last tile can have as few rows as the factored dot takes (the others have
    // kRowsPerTile); where it does and the format has an offset, its rows' sum of x over
    // each block, for the offset's term.
    const int64_t last = (M - 1) / kRowsPerTile * kRowsPerTile;  // the last tile's first row
    std::vector<float> xsum;
    if constexpr (F::kWeights == 32) {
      if (F::kHasOffset && M - last <= kFactoredRows) {
        xsum.resize((M - last) * blocks);
        const float* rows = xp + last * K;
        for (size_t i = 0; i < xsum.size(); ++i) {
          float sum = 0.0f;
          for (int64_t j = 0; j < F::kWeights; ++j) sum += rows[i * F::kWeights + j];
          xsum[i] = sum;
        }
      }
    }
    at::parallel_for(0, N, kOutputsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t m0 = 0; m0 < M; m0 += kRowsPerTile)
        tile_any<F>(std::min(kRowsPerTile, M - m0), w, row_bytes, blocks, xp + m0 * K, K,
                    m0 == last && !xsum.empty() ? xsum.data() : nullptr, y + m0 * N, N, begin,
                    end);
      if (b != nullptr)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = begin; n < end; ++n) y[m * N + n] += b[n];
    });
  });
  return out;
}
