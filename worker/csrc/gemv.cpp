// bfloat16 matrix-vector products for decode steps of a few rows: y = x W^T (+ bias).
// (3-32 rows go to the AMX kernel where there is one: amx_linear.cpp.)
//
// At batch 1-4 a projection is one pass over its weight, so its speed is the memory's.
// oneDNN's prepacked matmul spends ~20-30 us a call in setup and reaches ~14 GB/s over a
// model's projections here; this kernel streams the plain [out, in] weight with
// AVX512-BF16 dot products (VDPBF16PS: bf16 pairs into float32 lanes), one output row
// after another, and reaches the machine's read bandwidth. It needs AVX512-BF16 (Intel
// Cooper Lake / Sapphire Rapids and later, AMD Zen 4 and later); where the compiler
// targets a CPU without it, has_bf16_gemv() is false and the worker keeps oneDNN for
// every batch size.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "kernels.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TANDEM_HAS_BF16_GEMV 1
#else
#define TANDEM_HAS_BF16_GEMV 0
#endif

namespace {

// The most input rows the AVX512-BF16 path takes: past 4 rows its products are
// compute-bound and AMX (ours, or oneDNN's) is faster (bench/results/gemv.json).
constexpr int64_t kMaxRows = 4;
// From 3 rows the AMX kernel, where a weight's shape fits its tiles, is faster still
// (12.6 against 13.2 ms over SmolLM2's projections at 3 rows, 12.3 against 11.9 at 2).
constexpr int64_t kAmxFromRows = 3;

#if TANDEM_HAS_BF16_GEMV
constexpr int64_t kUnroll = 4;          // independent sums per input row, so FMA latency overlaps
constexpr int64_t kRowsPerTask = 64;    // at::parallel_for grain, in output rows

inline __m512bh load_pairs(const uint16_t* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// y[m, r] for m < M (a compile-time 1..kMaxRows): one weight row read start to end.
// Rows are read one after another, so each thread's reads are one ascending stream, which
// the hardware prefetchers follow at the memory's speed. Reading 4 rows side by side
// (4 streams a row apart) reached 20-22 GB/s on an AMD EPYC where this reaches 27-42;
// software prefetches did not close that gap (docs/benchmarks.md).
template <int M>
void one_row(const uint16_t* x, const uint16_t* w_row, int64_t K, int64_t r, int64_t N,
             const uint16_t* bias, uint16_t* y) {
  __m512 acc[M][kUnroll];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < kUnroll; ++u) acc[m][u] = _mm512_setzero_ps();
  constexpr __mmask32 all = ~__mmask32{0};
  int64_t k = 0;
  for (; k + 32 * kUnroll <= K; k += 32 * kUnroll) {
    for (int u = 0; u < kUnroll; ++u) {
      const __m512bh wv = load_pairs(w_row + k + 32 * u, all);
      for (int m = 0; m < M; ++m)
        acc[m][u] = _mm512_dpbf16_ps(acc[m][u], load_pairs(x + m * K + k + 32 * u, all), wv);
    }
  }
  for (int u = 0; k < K; k += 32, ++u) {  // fewer than kUnroll vectors are left
    const __mmask32 mask = K - k >= 32 ? all : (__mmask32{1} << (K - k)) - 1;
    const __m512bh wv = load_pairs(w_row + k, mask);
    for (int m = 0; m < M; ++m)
      acc[m][u] = _mm512_dpbf16_ps(acc[m][u], load_pairs(x + m * K + k, mask), wv);
  }
  const float b = bias != nullptr
                      ? static_cast<float>(c10::BFloat16(bias[r], c10::BFloat16::from_bits()))
                      : 0.0f;
  for (int m = 0; m < M; ++m) {
    static_assert(kUnroll == 4, "the sums below add exactly four accumulators");
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]),
                                     _mm512_add_ps(acc[m][2], acc[m][3]));
    y[m * N + r] = c10::BFloat16(_mm512_reduce_add_ps(sum) + b).x;
  }
}

template <int M>
void gemv_rows(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
               int64_t N, int64_t K) {
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) one_row<M>(x, w + r * K, K, r, N, bias, y);
  });
}
#endif

}  // namespace

bool has_bf16_gemv() { return TANDEM_HAS_BF16_GEMV; }

int64_t bf16_gemv_max_rows(int64_t out_features, int64_t in_features) {
  if (!TANDEM_HAS_BF16_GEMV) return 0;
  return std::max(kMaxRows, amx_linear_max_rows(out_features, in_features));
}

int64_t bf16_gemv_rows_on_every_host() { return TANDEM_HAS_BF16_GEMV ? kAmxFromRows - 1 : 0; }

void bf16_gemv_rows(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                    int64_t M, int64_t N, int64_t K) {
  TORCH_CHECK(TANDEM_HAS_BF16_GEMV, "bf16_gemv: built for a CPU without AVX512-BF16");
#if TANDEM_HAS_BF16_GEMV
  switch (M) {
    case 1: gemv_rows<1>(x, w, bias, y, N, K); break;
    case 2: gemv_rows<2>(x, w, bias, y, N, K); break;
    case 3: gemv_rows<3>(x, w, bias, y, N, K); break;
    default: gemv_rows<4>(x, w, bias, y, N, K); break;
  }
#else
  (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K;
#endif
}

// x [M, K] (M <= bf16_gemv_max_rows(N, K)), weight [N, K], bias [N] or none, all
// bfloat16 and contiguous: returns x weight^T + bias [M, N], each sum in float32, rounded
// once to bfloat16.
at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& weight,
                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(TANDEM_HAS_BF16_GEMV, "bf16_gemv: built for a CPU without AVX512-BF16");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "bf16_gemv takes CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "bf16_gemv takes bfloat16 tensors");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "bf16_gemv: x must be [M, K] and weight [N, K]");
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  const int64_t max_rows = bf16_gemv_max_rows(N, K);
  TORCH_CHECK(M >= 1 && M <= max_rows, "bf16_gemv takes 1 to ", max_rows, " rows of a [", N,
              ", ", K, "] weight, got ", M);
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "bf16_gemv: contiguous tensors only");
  const uint16_t* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() &&
                    bias->dim() == 1 && bias->size(0) == N,
                "bf16_gemv: bias must be contiguous bfloat16 [N]");
    bias_data = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
  if (M >= kAmxFromRows && M <= amx_linear_max_rows(N, K)) return amx_linear(x, weight, bias);
  at::Tensor y = at::empty({M, N}, x.options());
  bf16_gemv_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()),
                 reinterpret_cast<const uint16_t*>(weight.data_ptr()), bias_data,
                 reinterpret_cast<uint16_t*>(y.data_ptr()), M, N, K);
  return y;
}
