// Linear layers over GGUF-quantized weights, kept as the file ships them:
// y = x W^T (+ bias) with W an [out, row_bytes] array of GGUF blocks.
//
// A decode step reads every weight once; held as Q4_1 a weight is 0.625 bytes instead of
// bfloat16's 2, so the step reads ~3x fewer bytes. Each output row is dequantized into a
// float32 buffer (in L1: a row is at most a few thousand weights) and dotted with every
// input row, 16 lanes at a time; the products are summed in float32 and rounded once.
// Bfloat16 rows go to gguf_bf16_dot.cpp (one or two rows of the 32-weight formats, the
// file's blocks) or gguf_gemm.cpp (from gguf_gemm_min_rows, a repacked copy; every format)
// instead, where the CPU has AVX512-BF16; others are converted to float32 and come here.
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

#include "gguf_formats.h"
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include "gguf_dot_avx2.h"
#endif
#include "kernels.h"

namespace {

using namespace tandem::gguf;

constexpr int64_t kRowsPerTile = 8;       // input rows whose sums stay in registers
constexpr int64_t kOutputsPerTask = 16;   // at::parallel_for grain, in output rows
// How far ahead of a row's stream to prefetch: of 2, 4, 8, 16 and 32 KiB, 8 read 66 MB of
// Q4_1 rows fastest at one input row (13 GB/s on 2 threads; 2 KiB: 8.5 GB/s).
constexpr int64_t kPrefetchBytes = 8192;

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
#elif defined(__AVX2__) && defined(__FMA__)
  tandem::gguf_avx2::dot_rows<F, T, R, factored<F>(T)>(rows, row_bytes, blocks, x, K, xsum, out, N,
                                                       kPrefetchBytes);
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

// Weight rows per call for T input rows. The factored dot reads one row at a time: each
// thread's reads are then one ascending stream (4 rows side by side, 4 streams, read
// SmolLM2's Q4_1 and Q8_0 rows 10-15% slower); else as many sums as registers allow.
constexpr int rows_for(int T) { return T <= kFactoredRows ? 1 : 2; }

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
      c10::BFloat16* y = out.data_ptr<c10::BFloat16>();
      for (int64_t i = begin; i < end; ++i) dequant_bf16<F>(w + i * F::kBytes, y + i * F::kWeights);
    });
  });
  return out;
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                       const std::optional<at::Tensor>& bias,
                       const std::optional<at::Tensor>& packed, bool bf16_out,
                       bool q8_activations) {
  TORCH_CHECK(x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2 && x.is_contiguous(),
              "gguf_linear: x is a contiguous CPU float32 or bfloat16 [rows, in] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "gguf_linear: the bias is a contiguous float32 [out] tensor");
    b = bias->data_ptr<float>();
  }
  if (q8_activations) return gguf_linear_q8(x, weight, type, b, bf16_out);
  if (x.scalar_type() == at::kBFloat16) {
    if (packed.has_value() && packed->numel() > 0 && M >= gguf_gemm_min_rows(type))
      return gguf_gemm(x, *packed, type, N, b, bf16_out);
    const at::Tensor y = gguf_has_bf16_rows(type, M)
                             ? gguf_linear_bf16_rows(x, weight, type, b)
                             : gguf_linear(x.to(at::kFloat), weight, type, bias);
    return bf16_out ? y.to(at::kBFloat16) : y;
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
  return bf16_out ? out.to(at::kBFloat16) : out;
}
