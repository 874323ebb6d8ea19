// GGUF linear layers for bfloat16 input rows (the decode steps of a bfloat16 model):
// y = x W^T (+ bias), x bfloat16 [M, K], W the file's blocks, y float32.
//
// A bfloat16 row times a small integer quant is exact in float32, so the quants of the
// 4- and 5-bit formats are turned into exact bfloat16 values by a table lookup (VPERMW:
// the nibble is the index) and dotted with the rows by VDPBF16PS, 16 pairs a register
// summed into float32 lanes, instead of widening every quant to 32 bits, converting it
// and multiplying twice (gguf_linear.cpp). At batch 1 that arithmetic, not the memory,
// bounded the pass (SmolLM2's 92 MiB took 5.3 ms where a plain read of them takes 2.9);
// a block costs 1.75 ns here against 2.09 in cache. The products are the same exact
// values, only summed in another order, and each block's sum is scaled by its float16
// scale (plus its min times the block's sum of x) as there. At one row the 4-bit formats
// look a whole block up in one 512-bit register and dot it in one instruction
// (dot_row512): over SmolLM2's Q4_1 projections 2.52-2.76 -> 2.44-2.45 ms a pass on a
// Zen 5, a one-row decode step in process 3.45-3.59 -> 3.38-3.39 ms.
//
// Up to kMaxRows rows: past that, dequantizing a block once for every row (the float32
// path) costs less than looking its quants up again per row. Q8_0 (a byte a quant: two
// lookups and two products per weight) measured slower here than the float32 path, so it
// takes that path, as do the K-quants and CPUs without AVX512-BF16 (the caller converts x).
// Where the quants were also repacked for gguf_gemm.cpp (a bfloat16 model), that GEMM
// takes Q4_0/1 from two rows, the K-quants from one and the others from three
// (gguf_gemm_min_rows).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gguf_formats.h"
#include "kernels.h"

#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define TANDEM_HAS_GGUF_BF16 1
#else
#define TANDEM_HAS_GGUF_BF16 0
#endif

namespace {

using namespace tandem::gguf;

constexpr int64_t kMaxRows = 2;

// A format's dot over one block for T rows, where the CPU and the format have one.
template <typename F>
struct Bf16Dot {
  static constexpr bool kSupported = false;
};

#if TANDEM_HAS_GGUF_BF16
constexpr int64_t kOutputsPerTask = 16;  // at::parallel_for grain, in output rows
// Prefetch distance: of 1, 4 and 8 KiB, 4 read SmolLM2's Q4_1 rows fastest.
constexpr int64_t kPrefetchBytes = 4096;

template <size_t N>
inline __m256i load_table(const std::array<uint16_t, N>& t, size_t first = 0) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.data() + first));
}

inline __m256bh pairs(const uint16_t* p) {
  return (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

inline __m256i widen_bytes(const uint8_t* p) {  // 16 bytes -> 16 words
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// s[t] += sum over 16 weights of quant * x[t][0, 16): the quants as bfloat16.
template <int T>
inline void dot16(__m256 s[T], __m256i quants, const uint16_t* const x[T], int64_t at) {
  for (int t = 0; t < T; ++t) s[t] = _mm256_dpbf16_ps(s[t], (__m256bh)quants, pairs(x[t] + at));
}

// Q4_0 (q - 8), Q4_1 (q): byte j holds weight j (low nibble) and j + 16 (high nibble).
template <bool kHasMin>
struct Bf16Dot<Q4<kHasMin>> {
  static constexpr bool kSupported = true;
  static constexpr auto kTable = bf16_table<16>([](int i) { return kHasMin ? i : i - 8; });
  template <int T>
  static inline void dot(const uint8_t* b, const uint16_t* const x[T], int64_t at, __m256 s[T]) {
    const __m256i lut = load_table(kTable);
    const __m256i q = widen_bytes(b + (kHasMin ? 4 : 2));
    // VPERMW reads the low 4 bits of each index: the low nibble needs no mask.
    dot16<T>(s, _mm256_permutexvar_epi16(q, lut), x, at);
    dot16<T>(s, _mm256_permutexvar_epi16(_mm256_srli_epi16(q, 4), lut), x, at + 16);
  }

  // One row: the block's 32 quants as bfloat16 in one register, weight j in word j (the
  // low nibbles, then the high ones shifted down). VPERMW reads 5 bits of an index here:
  // the table is written twice, so the low nibble's neighbour bit does not matter.
  static constexpr auto kTable32 = bf16_table<32>([](int i) { return kHasMin ? i % 16 : i % 16 - 8; });
  static inline __m512bh quants(const uint8_t* b) {
    const __m256i q = widen_bytes(b + (kHasMin ? 4 : 2));
    const __m512i index = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1);
    return (__m512bh)_mm512_permutexvar_epi16(
        index, _mm512_loadu_si512(reinterpret_cast<const void*>(kTable32.data())));
  }
};

// Q5_0 (q - 16), Q5_1 (q): the fifth bit of weight j is bit j of qh; 32 entries, so the
// two-table VPERMT2W.
template <bool kHasMin>
struct Bf16Dot<Q5<kHasMin>> {
  static constexpr bool kSupported = true;
  static constexpr auto kTable = bf16_table<32>([](int i) { return kHasMin ? i : i - 16; });
  template <int T>
  static inline void dot(const uint8_t* b, const uint16_t* const x[T], int64_t at, __m256 s[T]) {
    const __m256i lut_lo = load_table(kTable), lut_hi = load_table(kTable, 16);
    const uint8_t* p = b + (kHasMin ? 4 : 2);
    uint32_t bits;
    std::memcpy(&bits, p, 4);
    const __m256i q = widen_bytes(p + 4), sixteen = _mm256_set1_epi16(16);
    const __m256i lo = _mm256_and_si256(q, _mm256_set1_epi16(0x0F));
    const __m256i hi = _mm256_srli_epi16(q, 4);
    const auto fifth = [&](__m256i nibbles, uint32_t mask) {
      const __m256i index = _mm256_mask_add_epi16(nibbles, static_cast<__mmask16>(mask), nibbles, sixteen);
      return _mm256_permutex2var_epi16(lut_lo, index, lut_hi);
    };
    dot16<T>(s, fifth(lo, bits), x, at);
    dot16<T>(s, fifth(hi, bits >> 16), x, at + 16);
  }
};

inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The input rows and what the formats' dots need of them.
struct Rows {
  const uint16_t* x;  // [M, K] bfloat16 bits
  const float* xsum;  // [M, blocks] each block's sum of x, for formats with a min; else null
  int64_t K, blocks;
};

// out[t * N] = dot(weight row, x[t]) for t < T: the row read once, start to end, with
// prefetches ahead of it (rows are a few hundred bytes: the hardware prefetcher alone
// fell behind).
template <typename F, int T>
void dot_row(const uint8_t* row, const Rows& in, float* out, int64_t N) {
  const uint16_t* x[T];
  for (int t = 0; t < T; ++t) x[t] = in.x + t * in.K;
  __m256 acc[T];
  float off[T][2] = {};  // two sums a row: one chain of adds would set the pace
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < in.blocks; ++b) {
    const uint8_t* block = row + b * F::kBytes;
    if (b % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(block) + kPrefetchBytes, _MM_HINT_T0);
    __m256 s[T];
    for (int t = 0; t < T; ++t) s[t] = _mm256_setzero_ps();
    Bf16Dot<F>::template dot<T>(block, x, b * F::kWeights, s);
    const __m256 d = _mm256_set1_ps(F::scale(block));
    for (int t = 0; t < T; ++t) acc[t] = _mm256_fmadd_ps(d, s[t], acc[t]);
    if constexpr (F::kHasOffset) {
      const float m = F::offset(block);
      for (int t = 0; t < T; ++t) off[t][b % 2] += m * in.xsum[t * in.blocks + b];
    }
  }
  for (int t = 0; t < T; ++t) out[t * N] = sum_lanes(acc[t]) + (off[t][0] + off[t][1]);
}

// Whether a format has a block's quants in one 512-bit register (the 4-bit formats).
template <typename F, typename = void>
struct HasQuants512 : std::false_type {};
template <typename F>
struct HasQuants512<F, std::void_t<decltype(Bf16Dot<F>::quants(nullptr))>> : std::true_type {};

// dot_row for one row of x, a block one VDPBF16PS of 32 products on 512 bits: fewer
// instructions a block than two of 16 (the pass is bound by them, not by the memory).
template <typename F>
void dot_row512(const uint8_t* row, const Rows& in, float* out) {
  __m512 acc = _mm512_setzero_ps();
  float off[2] = {};  // two sums: one chain of adds would set the pace
  for (int64_t b = 0; b < in.blocks; ++b) {
    const uint8_t* block = row + b * F::kBytes;
    if (b % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(block) + kPrefetchBytes, _MM_HINT_T0);
    const __m512bh x = (__m512bh)_mm512_loadu_si512(in.x + b * F::kWeights);
    const __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), Bf16Dot<F>::quants(block), x);
    acc = _mm512_fmadd_ps(_mm512_set1_ps(F::scale(block)), s, acc);
    if constexpr (F::kHasOffset) off[b % 2] += F::offset(block) * in.xsum[b];
  }
  *out = _mm512_reduce_add_ps(acc) + (off[0] + off[1]);
}

// One row of x: on 512 bits where the format has its block in one register.
template <typename F>
void dot_one_row(const uint8_t* row, const Rows& in, float* out, int64_t N) {
  if constexpr (HasQuants512<F>::value) dot_row512<F>(row, in, out);
  else dot_row<F, 1>(row, in, out, N);
}

template <typename F>
void linear_rows(const at::Tensor& x, const at::Tensor& weight, const float* bias, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const int64_t blocks = checked_blocks<F>("gguf_linear", weight, K);
  const auto* bits = reinterpret_cast<const uint16_t*>(x.data_ptr());
  std::vector<float> xsum;
  if constexpr (F::kHasOffset) xsum = bf16_block_sums(bits, M * blocks, F::kWeights);
  const Rows in{bits, xsum.empty() ? nullptr : xsum.data(), K, blocks};
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const int64_t row_bytes = weight.size(1);
  float* y = out.data_ptr<float>();
  at::parallel_for(0, N, kOutputsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      if (M == 1) dot_one_row<F>(w + n * row_bytes, in, y + n, N);
      else dot_row<F, 2>(w + n * row_bytes, in, y + n, N);
    }
    if (bias != nullptr)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = begin; n < end; ++n) y[m * N + n] += bias[n];
  });
}
#endif

}  // namespace

bool gguf_has_bf16_rows(int64_t type, int64_t rows) {
  bool supported = false;
  with_format(type, [&](auto format) { supported = Bf16Dot<decltype(format)>::kSupported; });
#if TANDEM_HAS_GGUF_BF16
  return supported && rows >= 1 && rows <= kMaxRows;
#else
  return supported;  // false: only the CPUs with the instructions have one
#endif
}

at::Tensor gguf_linear_bf16_rows(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                                 const float* bias) {
  TORCH_CHECK(gguf_has_bf16_rows(type, x.size(0)), "gguf_linear: no bfloat16-row kernel for ",
              x.size(0), " rows of type ", type);
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options().dtype(at::kFloat));
#if TANDEM_HAS_GGUF_BF16
  with_format(type, [&](auto format) {
    using F = decltype(format);
    if constexpr (Bf16Dot<F>::kSupported) linear_rows<F>(x, weight, bias, out);
  });
#endif
  return out;
}
