// What the decode-attention kernels share: where one attention problem's tensors live
// (decode_attention.cpp's generic kernels, decode_attention_bf16.cpp's bfloat16 one) and
// the 16-way reduction of a tile's scores.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

#include "simd.h"

namespace tandem::attention {

// Where one attention problem's tensors live, read by every implementation.
template <typename T>
struct Problem {
  const T* q;  // [n, heads, dim]
  const T* k;  // [num_blocks, kv_heads, block_size, dim]
  const T* v;
  const int64_t* table;  // [n, max_blocks]
  const int64_t* lens;
  T* out;  // [n, heads, dim]
  int64_t n, heads, kv_heads, dim, max_blocks, block_size, window;
  float scale;

  int64_t group() const { return heads / kv_heads; }
  int64_t first(int64_t seq) const {
    return window > 0 ? std::max<int64_t>(0, lens[seq] - window) : 0;
  }
  // Offset of the row of KV head g at `offset` in `block`.
  int64_t at(int64_t block, int64_t g, int64_t offset) const {
    return ((block * kv_heads + g) * block_size + offset) * dim;
  }
  // Offset of token t's row of KV head g of sequence seq.
  int64_t row(int64_t seq, int64_t t, int64_t g) const {
    return at(table[seq * max_blocks + t / block_size], g, t % block_size);
  }
};

#if defined(__AVX512F__)
// sums[i] := the sum of v[i]'s 16 lanes, for i < 16: three rounds of pairwise
// shuffles and adds instead of sixteen horizontal reductions. Always inlined: GCC kept it
// a call, which stored the caller's 16 tile sums to the stack and read them back, ~15% of
// the bfloat16 kernel's time on rows in cache (docs/benchmarks.md); the bits are the same.
__attribute__((always_inline)) inline __m512 transpose_sum(const __m512 v[16]) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: (v2i: 0+2, v2i+1: 0+2, v2i: 1+3, v2i+1: 1+3)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: v4i .. v4i+3, each that lane's sum
    const __m512d lo = _mm512_castps_pd(a[2 * i]), hi = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  // Add the four 128-bit lanes: lane j of the result holds b[j]'s totals.
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88),
                                  _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88),
                                  _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

#endif

// The bfloat16 kernel (decode_attention_bf16.cpp), where this CPU and the problem's shape
// suit it: head size 64, 128 or 256, at most 4 query heads per KV head, AVX512-BF16.
// Returns whether it took the problem (out written); else another kernel must.
bool attend_bf16(const Problem<c10::BFloat16>& p);

// The AVX2 kernel (decode_attention_avx2.cpp), where this build has AVX2 and FMA but no
// AVX-512 and the head size is a multiple of 16 with at most 8 query heads per KV head.
// Returns whether it took the problem (out written); else another kernel must.
bool attend_avx2(const Problem<float>& p);
bool attend_avx2(const Problem<c10::BFloat16>& p);
bool attend_avx2(const Problem<c10::Half>& p);

}  // namespace tandem::attention
