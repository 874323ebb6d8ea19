// GGUF projections with 8-bit activations (--gguf-activations q8), as llama.cpp computes
// every quantized type: each input row quantized per block of 32 (q = round(x * 127 /
// amax), ties to even; d = amax / 127: Q8_0's scale, with Q8_1's d * sum(q) per half
// block beside it for the formats with an offset), each 32-weight sub-block of the
// weights dotted with it in integers (gguf_q8_blocks.h), and the sums scaled in float32.
//
// Why: on a CPU without a bfloat16 dot (AVX2: Zen 2/3, Intel client parts) the float path
// (gguf_linear.cpp) widens every quant to a float32 lane and multiplies it there: four
// conversions and four FMAs a 32-weight block a row. Here one VPMADDUBSW + VPMADDWD (or
// one VPDPBUSD with VNNI) multiplies the block's 32 bytes by the activations' and sums
// them; the activations are a quarter of float32's bytes. The price is the activations'
// rounding: bench.quality measures it against the float path (docs/benchmarks.md).
//
// The integer sums are exact (tests/unit/test_gguf_q8.py checks them against an integer
// reference); the epilogue's float32 sums run in 8 lanes here and in order in the
// portable build, so the two differ within float32 rounding.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "gguf_q8_blocks.h"
#include "kernels.h"
#if defined(__AVX2__)
#include "avx2.h"
#endif

namespace {

using namespace tandem::gguf_q8;

constexpr int64_t kQ8Block = 32;
constexpr int64_t kRowsPerTile = 8;      // input rows whose sums stay in registers
constexpr int64_t kOutputsPerTask = 16;  // at::parallel_for grain, in output rows
// Read ahead of a row's stream, as gguf_linear.cpp does (rows are a few hundred bytes).
constexpr int64_t kPrefetchBytes = 8192;

// x [M, K] quantized per block of 32: q, each block's d, and d * sum(q) of each half and
// of the whole block.
struct Q8Rows {
  std::vector<int8_t> q;    // [M, K]
  std::vector<float> d;     // [M, K / 32]
  std::vector<float> ds;    // [M, K / 16]
  std::vector<float> ds32;  // [M, K / 32]
  int64_t K = 0, blocks = 0;
};

// Block i's scale and its halves' d * sum(q), from the block's quants and amax.
inline void block_scales(float amax, int sum_lo, int sum_hi, float* d, float* ds) {
  const float scale = amax / 127.0f;
  *d = scale;
  ds[0] = scale * static_cast<float>(sum_lo);
  ds[1] = scale * static_cast<float>(sum_hi);
}

inline bool unquantizable(float amax, int8_t* q, float* d, float* ds) {
  if (std::isfinite(amax)) return false;
  std::fill(q, q + kQ8Block, 0);  // no integer holds it: the block's products are NaN
  *d = ds[0] = ds[1] = std::numeric_limits<float>::quiet_NaN();
  return true;
}

template <typename T>
void quantize_block(const T* x, int8_t* q, float* d, float* ds) {
#if defined(__AVX2__)
  __m256 v[4];
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, float>)
      v[i] = _mm256_loadu_ps(x + 8 * i);
    else
      v[i] = tandem::avx2::widen_bf16(reinterpret_cast<const uint16_t*>(x + 8 * i));
  }
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_and_ps(v[0], abs_mask);
  for (int i = 1; i < 4; ++i) m = _mm256_max_ps(m, _mm256_and_ps(v[i], abs_mask));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  if (unquantizable(amax, q, d, ds)) return;
  const __m256 inverse = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  __m256i r[4];
  for (int i = 0; i < 4; ++i)  // rounded to nearest, ties to even: exact integers
    r[i] = _mm256_cvtps_epi32(
        _mm256_round_ps(_mm256_mul_ps(v[i], inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // the packs interleave 128-bit lanes
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  const auto total = [](__m256i a, __m256i b) {
    const __m256i s = _mm256_add_epi32(a, b);
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
  };
  block_scales(amax, total(r[0], r[1]), total(r[2], r[3]), d, ds);
#else
  float v[kQ8Block];
  float amax = 0.0f;
  for (int64_t j = 0; j < kQ8Block; ++j) {
    v[j] = static_cast<float>(x[j]);
    amax = std::max(amax, std::fabs(v[j]));
  }
  if (unquantizable(amax, q, d, ds)) return;
  const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
  int sums[2] = {0, 0};
  for (int64_t j = 0; j < kQ8Block; ++j) {
    q[j] = static_cast<int8_t>(std::nearbyint(v[j] * inverse));  // |v * inverse| <= 127
    sums[j / 16] += q[j];
  }
  block_scales(amax, sums[0], sums[1], d, ds);
#endif
}

Q8Rows quantize_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kQ8Block == 0, "gguf_linear: 8-bit activations take rows of a multiple of ",
              kQ8Block, " inputs, got ", K);
  Q8Rows r;
  r.K = K;
  r.blocks = K / kQ8Block;
  r.q.resize(M * K);
  r.d.resize(M * r.blocks);
  r.ds.resize(2 * M * r.blocks);
  r.ds32.resize(M * r.blocks);
  const auto run = [&](auto* rows) {
    for (int64_t i = 0; i < M * r.blocks; ++i) {
      quantize_block(rows + i * kQ8Block, &r.q[i * kQ8Block], &r.d[i], &r.ds[2 * i]);
      r.ds32[i] = r.ds[2 * i] + r.ds[2 * i + 1];
    }
  };
  if (x.scalar_type() == at::kBFloat16)
    run(x.data_ptr<c10::BFloat16>());
  else
    run(x.data_ptr<float>());
  return r;
}

#if defined(__AVX2__)
// Eight int32 lanes, lane i the sum of bytes 4 i .. 4 i + 3 of u (unsigned) times s (signed).
// Never saturates here: |s| <= 127 and u <= 128, so VPMADDUBSW's pair sums stay in int16.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

using Lanes = __m256;
inline Lanes zero_lanes() { return _mm256_setzero_ps(); }
inline float lanes_sum(Lanes a, Lanes b) { return tandem::avx2::hsum(_mm256_add_ps(a, b)); }
inline void prefetch(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
}
#else
using Lanes = float;
inline Lanes zero_lanes() { return 0.0f; }
inline float lanes_sum(Lanes a, Lanes b) { return a + b; }
inline void prefetch(const uint8_t*) {}
#endif

// Adds sub-block g of `block` dotted with rows m0 .. m0 + T - 1 of x (their block j of 32)
// to acc[t] (lanes) and off[t] (the offsets' terms).
template <typename F, int T>
inline void sub_block_dot(const uint8_t* block, int g, int64_t j, const Q8Rows& x, int64_t m0,
                          Lanes* acc, float* off) {
  using R = Reader<F>;
  const SubScales s = R::scales(block, g);
#if defined(__AVX2__)
  const __m256i q = R::quants(block, g);
  const __m256i u = R::kSigned ? _mm256_sign_epi8(q, q) : q;  // |q|: Q8_0's sign trick
#else
  uint8_t q[kQ8Block];
  R::quants(block, g, q);
#endif
  for (int t = 0; t < T; ++t) {
    const int64_t i = (m0 + t) * x.blocks + j;
    const int8_t* a = &x.q[i * kQ8Block];
    const float dx = x.d[i];
#if defined(__AVX2__)
    __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
    if constexpr (R::kSigned) av = _mm256_sign_epi8(av, q);
    const __m256 sums = _mm256_cvtepi32_ps(dot_u8s8(u, av));
    const __m256 scale = R::kTwoScales
                             ? _mm256_set_m128(_mm_set1_ps(s.s_hi * dx), _mm_set1_ps(s.s_lo * dx))
                             : _mm256_set1_ps(s.s_lo * dx);
    acc[t] = _mm256_fmadd_ps(sums, scale, acc[t]);
#else
    int32_t lo = 0, hi = 0;
    for (int l = 0; l < 16; ++l) {
      lo += (R::kSigned ? static_cast<int8_t>(q[l]) : q[l]) * a[l];
      hi += (R::kSigned ? static_cast<int8_t>(q[l + 16]) : q[l + 16]) * a[l + 16];
    }
    acc[t] += s.s_lo * dx * static_cast<float>(lo) + s.s_hi * dx * static_cast<float>(hi);
#endif
    if constexpr (R::kTwoScales)
      off[t] += s.o_lo * x.ds[2 * i] + s.o_hi * x.ds[2 * i + 1];
    else if constexpr (!R::kSigned)
      off[t] += s.o_lo * x.ds32[i];
  }
}

// out[t * N] = dot(weight row, x row m0 + t) for T rows of x: each sub-block's quants read
// once and dotted with every row. For one or two rows, even and odd sub-blocks in two sets
// of sums, so one block's multiply-adds need not wait for the last one's (more rows have
// as many independent sums already).
template <typename F, int T>
void dot_row(const uint8_t* row, int64_t blocks, const Q8Rows& x, int64_t m0, float* out,
             int64_t N) {
  constexpr int kSub = Reader<F>::kSubBlocks;
  constexpr int P = T <= 2 ? 2 : 1;  // sets of sums
  Lanes acc[2][T];
  float off[2][T] = {};
  for (int p = 0; p < 2; ++p)
    for (int t = 0; t < T; ++t) acc[p][t] = zero_lanes();
  int64_t b = 0;
  if constexpr (kSub == 1 && P == 2) {
    for (; b + 2 <= blocks; b += 2) {
      const uint8_t* block = row + b * F::kBytes;
      prefetch(block + kPrefetchBytes);
      sub_block_dot<F, T>(block, 0, b, x, m0, acc[0], off[0]);
      sub_block_dot<F, T>(block + F::kBytes, 0, b + 1, x, m0, acc[1], off[1]);
    }
  }
  for (; b < blocks; ++b) {
    const uint8_t* block = row + b * F::kBytes;
    prefetch(block + kPrefetchBytes);
    for (int g = 0; g < kSub; ++g)
      sub_block_dot<F, T>(block, g, b * kSub + g, x, m0, acc[g % P], off[g % P]);
  }
  for (int t = 0; t < T; ++t) out[t * N] = lanes_sum(acc[0][t], acc[1][t]) + off[0][t] + off[1][t];
}

// Output rows [begin, end) for the T rows of x from m0.
template <typename F, int T>
void tile(const uint8_t* w, int64_t row_bytes, int64_t blocks, const Q8Rows& x, int64_t m0,
          float* y, int64_t N, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n)
    dot_row<F, T>(w + n * row_bytes, blocks, x, m0, y + m0 * N + n, N);
}

template <typename F>
void tile_any(int64_t T, const uint8_t* w, int64_t row_bytes, int64_t blocks, const Q8Rows& x,
              int64_t m0, float* y, int64_t N, int64_t begin, int64_t end) {
  switch (T) {
    case 1: return tile<F, 1>(w, row_bytes, blocks, x, m0, y, N, begin, end);
    case 2: return tile<F, 2>(w, row_bytes, blocks, x, m0, y, N, begin, end);
    case 3: return tile<F, 3>(w, row_bytes, blocks, x, m0, y, N, begin, end);
    case 4: return tile<F, 4>(w, row_bytes, blocks, x, m0, y, N, begin, end);
    case 5: return tile<F, 5>(w, row_bytes, blocks, x, m0, y, N, begin, end);
    case 6: return tile<F, 6>(w, row_bytes, blocks, x, m0, y, N, begin, end);
    case 7: return tile<F, 7>(w, row_bytes, blocks, x, m0, y, N, begin, end);
    default: return tile<F, 8>(w, row_bytes, blocks, x, m0, y, N, begin, end);
  }
}

}  // namespace

at::Tensor gguf_linear_q8(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                          const float* bias, bool bf16_out) {
  const int64_t M = x.size(0), N = weight.size(0);
  const Q8Rows xq = quantize_rows(x);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  with_format(type, [&](auto format) {
    using F = decltype(format);
    const int64_t blocks = checked_blocks<F>("gguf_linear", weight, xq.K);
    const uint8_t* w = weight.data_ptr<uint8_t>();
    const int64_t row_bytes = weight.size(1);
    float* y = out.data_ptr<float>();
    at::parallel_for(0, N, kOutputsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t m0 = 0; m0 < M; m0 += kRowsPerTile)
        tile_any<F>(std::min(kRowsPerTile, M - m0), w, row_bytes, blocks, xq, m0, y, N, begin,
                    end);
      if (bias != nullptr)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = begin; n < end; ++n) y[m * N + n] += bias[n];
    });
  });
  return bf16_out ? out.to(at::kBFloat16) : out;
}

std::tuple<at::Tensor, at::Tensor> gguf_quantize_q8(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2 && x.is_contiguous(),
              "gguf_quantize_q8: x is a contiguous CPU float32 or bfloat16 [rows, in] tensor");
  const Q8Rows r = quantize_rows(x);
  const int64_t M = x.size(0);
  at::Tensor q = at::empty({M, r.K}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({M, r.blocks}, x.options().dtype(at::kFloat));
  std::copy(r.q.begin(), r.q.end(), q.data_ptr<int8_t>());
  std::copy(r.d.begin(), r.d.end(), d.data_ptr<float>());
  return {q, d};
}
