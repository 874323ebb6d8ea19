// bf16_gemm's tiles for CPUs with AVX2 and FMA but no AVX512-BF16 (AMD Zen 2/3, Intel
// client parts, Xeons before Cooper Lake): the same packed weight, the same sums.
//
// VDPBF16PS adds a K pair's two products to a float32 lane, the odd input's first, each
// as an FMA (a product of two bfloat16s is exact in float32, so the FMA rounds only the
// sum). Here a pair of weights is split into two float32 vectors (the even input is the
// pair's low half shifted up, the odd its high half masked) and x's inputs, widened to
// float32 once a call, are broadcast: acc = fma(x_odd, w_odd, acc), then fma(x_even,
// w_even, acc), so every output is the AVX512-BF16 path's, bit for bit, but in the
// denormal range that path flushes to zero. A tile is up to 5 rows x one 16-output block,
// two float32 vectors per row: 10 accumulators, 4 weight vectors and 2 broadcasts fill
// AVX2's 16 registers; the group's other block is the next tile (it reads from L2 the
// half of each 128-byte K pair the first left).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>

#include "avx2.h"

namespace tandem::bf16_gemm_avx2 {

constexpr int64_t kTileRows = 5;  // rows per tile, at most: what 16 registers hold

// y[r][out0 + i] for r < R, i < 16 (x and y start at the tile's first row): x is float32
// [R][2 pairs], w the block's first K pair (16 pairs of bfloat16), `stride` uint32s from
// one K pair to the next.
template <int R>
void tile(const float* x, int64_t pairs, const uint32_t* w, int64_t stride, const uint16_t* bias,
          int64_t out0, int64_t out_features, uint16_t* y, const char* fetch, int64_t lines) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int64_t in = 2 * pairs;
  int64_t owed = 0;  // lines / pairs lines a K pair, the remainder carried
  for (int64_t kp = 0; kp < pairs; ++kp) {
    for (owed += lines; owed >= pairs; owed -= pairs, fetch += 64) _mm_prefetch(fetch, _MM_HINT_T1);
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kp * stride));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kp * stride + 8));
    const __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(lo, 16));
    const __m256 odd0 = _mm256_castsi256_ps(_mm256_and_si256(lo, high));
    const __m256 even1 = _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16));
    const __m256 odd1 = _mm256_castsi256_ps(_mm256_and_si256(hi, high));
    for (int r = 0; r < R; ++r) {
      const __m256 xo = _mm256_broadcast_ss(x + r * in + 2 * kp + 1);
      acc[r][0] = _mm256_fmadd_ps(xo, odd0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xo, odd1, acc[r][1]);
      const __m256 xe = _mm256_broadcast_ss(x + r * in + 2 * kp);
      acc[r][0] = _mm256_fmadd_ps(xe, even0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xe, even1, acc[r][1]);
    }
  }
  const int64_t valid = std::min<int64_t>(16, out_features - out0);
  float add[16] = {};
  if (bias != nullptr)
    for (int64_t i = 0; i < valid; ++i)
      add[i] = static_cast<float>(c10::BFloat16(bias[out0 + i], c10::BFloat16::from_bits()));
  for (int r = 0; r < R; ++r) {
    float sums[16];
    _mm256_storeu_ps(sums, _mm256_add_ps(acc[r][0], _mm256_loadu_ps(add)));
    _mm256_storeu_ps(sums + 8, _mm256_add_ps(acc[r][1], _mm256_loadu_ps(add + 8)));
    uint16_t* row = y + r * out_features + out0;
    for (int64_t i = 0; i < valid; ++i) row[i] = c10::BFloat16(sums[i]).x;  // nearest even
  }
}

// One row against a whole group of two blocks: its K pairs are read as one ascending
// stream of 128 bytes each, into four independent sums (the two-block tile above reads
// every other line and keeps two sums a row: at one row its FMA chains, not the memory,
// set its pace).
inline void row_of_two_blocks(const float* x, int64_t pairs, const uint32_t* w,
                              const uint16_t* bias, int64_t out0, int64_t out_features,
                              uint16_t* y, const char* fetch, int64_t lines) {
  __m256 acc[4];
  for (int v = 0; v < 4; ++v) acc[v] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  int64_t owed = 0;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    for (owed += lines; owed >= pairs; owed -= pairs, fetch += 64) _mm_prefetch(fetch, _MM_HINT_T1);
    const __m256 xo = _mm256_broadcast_ss(x + 2 * kp + 1);
    const __m256 xe = _mm256_broadcast_ss(x + 2 * kp);
    for (int v = 0; v < 4; ++v) {
      const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kp * 32 + 8 * v));
      acc[v] = _mm256_fmadd_ps(xo, _mm256_castsi256_ps(_mm256_and_si256(p, high)), acc[v]);
      acc[v] = _mm256_fmadd_ps(xe, _mm256_castsi256_ps(_mm256_slli_epi32(p, 16)), acc[v]);
    }
  }
  const int64_t valid = std::min<int64_t>(32, out_features - out0);
  float sums[32];
  for (int v = 0; v < 4; ++v) _mm256_storeu_ps(sums + 8 * v, acc[v]);
  for (int64_t i = 0; i < valid; ++i) {
    const float b = bias != nullptr ? static_cast<float>(c10::BFloat16(bias[out0 + i], c10::BFloat16::from_bits())) : 0.0f;
    y[out0 + i] = c10::BFloat16(sums[i] + b).x;
  }
}

inline void tile_rows(int64_t height, const float* x, int64_t pairs, const uint32_t* w,
                      int64_t stride, const uint16_t* bias, int64_t out0, int64_t out_features,
                      uint16_t* y, const char* fetch, int64_t lines) {
  switch (height) {
    case 1: return tile<1>(x, pairs, w, stride, bias, out0, out_features, y, fetch, lines);
    case 2: return tile<2>(x, pairs, w, stride, bias, out0, out_features, y, fetch, lines);
    case 3: return tile<3>(x, pairs, w, stride, bias, out0, out_features, y, fetch, lines);
    case 4: return tile<4>(x, pairs, w, stride, bias, out0, out_features, y, fetch, lines);
    case 5: return tile<5>(x, pairs, w, stride, bias, out0, out_features, y, fetch, lines);
    default: TORCH_CHECK(false, "bf16_gemm: an AVX2 tile of ", height, " rows");
  }
}

// Every row of x (float32 [rows][2 pairs]) against a group of `blocks` 16-output blocks
// (w: its first, K pairs interleaved by block), each block in as few tiles as kTileRows
// allows, the first as tall as can be and the rest even (12 rows: 5, 4, 3 -> 5, 4, 3;
// 32: 5 then 27 over 6 tiles); the group's next lines `fetch` shared evenly by every tile.
inline void group_rows(const float* x, int64_t rows, int64_t pairs, const uint32_t* w,
                       int64_t blocks, const uint16_t* bias, int64_t out0, int64_t out_features,
                       uint16_t* y, const char* fetch, int64_t lines) {
  if (rows == 1 && blocks == 2)
    return row_of_two_blocks(x, pairs, w, bias, out0, out_features, y, fetch, lines);
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  const int64_t stride = 16 * blocks, in = 2 * pairs;
  const int64_t parts = tiles * blocks;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint32_t* wb = w + 16 * b;
    const int64_t first = out0 + 16 * b;
    if (first >= out_features) return;
    const auto share = [&](int64_t part) {
      return std::pair<const char*, int64_t>{fetch + 64 * (lines * part / parts),
                                             lines * (part + 1) / parts - lines * part / parts};
    };
    auto [f0, l0] = share(b * tiles);
    const int64_t head = std::min(rows, kTileRows);
    tile_rows(head, x, pairs, wb, stride, bias, first, out_features, y, f0, l0);
    if (tiles == 1) continue;
    const int64_t rest = rows - head, others = tiles - 1;
    const int64_t base = rest / others, longer = rest % others;
    for (int64_t t = 0, r = head; t < others; r += base + (t < longer), ++t) {
      auto [f, l] = share(b * tiles + t + 1);
      tile_rows(base + (t < longer), x + r * in, pairs, wb, stride, bias, first, out_features,
                y + r * out_features, f, l);
    }
  }
}

// x's bfloat16 rows [rows][in] widened to float32 into out (exact: a bfloat16 is a
// float's top half).
inline void widen_rows(const uint16_t* x, int64_t count, float* out) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(out + i, tandem::avx2::widen_bf16(x + i));
  for (; i < count; ++i) {
    const uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
    std::memcpy(out + i, &bits, sizeof bits);
  }
}

}  // namespace tandem::bf16_gemm_avx2
