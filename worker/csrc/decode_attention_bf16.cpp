// Paged decode attention over a bfloat16 cache with AVX512-BF16: the shapes we serve
// (head size 64, 128 or 256, at most 4 query heads per KV head); decode_attention.cpp
// takes the others. One task is one (sequence, KV head) pair, as there.
//
// Nothing is converted on the way in. Keys are dotted with the query where they lie
// (VDPBF16PS: bfloat16 pairs multiplied exactly, summed in float32), 16 tokens a tile,
// reduced by one transpose-add tree. A bfloat16 value is a float's top half, so 32 values
// loaded at once, shifted up (the even ones) or masked (the odd ones), are 32 floats in
// two registers; every head's sums for 64 dims stay in registers across the whole context
// and are put back in order once, at the end. Against the tile-converting kernel this
// takes a third less time at 32 sequences of 128-256 tokens (docs/benchmarks.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention_problem.h"
#include "simd.h"

#if defined(__AVX512BF16__)
#define TANDEM_HAS_BF16_ATTENTION 1
#else
#define TANDEM_HAS_BF16_ATTENTION 0
#endif

namespace {

using tandem::attention::Problem;

#if TANDEM_HAS_BF16_ATTENTION
using tandem::attention::transpose_sum;
using Bf16 = c10::BFloat16;

constexpr int64_t kTile = 16;  // tokens per tile: one vector of scores
constexpr int64_t kChunk = 64;  // dims whose value sums one pass keeps in registers

// Rows of the cache a pass reads ahead of computing on them (32 KiB at head size 64),
// so they are in cache when the computing reaches them.
constexpr int64_t kAheadBytes = 32 << 10;

// Loads the rows of KV head g for tokens [t0, t1), block by block, each block's rows as
// the one run they are, in a loop that does nothing else. The computing loops spend a few
// hundred instructions on a tile, so the CPU's window holds the misses of about one block
// at a time; this loop keeps some 150 lines on their way. Software prefetches, at any
// distance and hint, changed nothing on the Zen 5 host where this was measured; demand
// loads do: at 32 sequences x 256 tokens, 30 layers took 7.5 ms instead of 9.9, 8 x 256
// 1.76 instead of 2.17. Where the rows are in cache already (a prefix that many sequences
// share) this is a second read: 2.8 ms instead of 2.2 in that test (docs/benchmarks.md).
inline void read_ahead(const Problem<Bf16>& p, const Bf16* cache, const int64_t* blocks,
                       int64_t g, int64_t t0, int64_t t1) {
  __m512i any = _mm512_setzero_si512();
  for (int64_t t = t0; t < t1;) {
    const int64_t block = t / p.block_size, offset = t % p.block_size;
    const int64_t rows = std::min(t1 - t, p.block_size - offset);
    const char* run = reinterpret_cast<const char*>(cache + p.at(blocks[block], g, offset));
    for (int64_t b = 0; b < rows * p.dim * 2; b += 64)
      any = _mm512_or_si512(any, _mm512_loadu_si512(run + b));
    t += rows;
  }
  asm volatile("" : : "v"(any));  // the loads are the point: keep them
}

inline __m512bh pairs(const Bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }

// dst[0, 32) := the sums of 32 dims held as their 16 even and 16 odd lanes, times scale.
inline void store_pairs(Bf16* dst, __m512 even, __m512 odd, __m512 scale) {
  const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  even = _mm512_mul_ps(even, scale);
  odd = _mm512_mul_ps(odd, scale);
  tandem::store_lanes(dst, _mm512_permutex2var_ps(even, first, odd));
  tandem::store_lanes(dst + 16, _mm512_permutex2var_ps(even, second, odd));
}

// The G query heads of KV head g of one sequence against its context; head size D * 32 (a
// constant: the tile's 16 x D products unroll, and their sums stay in registers).
template <int G, int D>
void attend(const Problem<Bf16>& p, int64_t seq, int64_t g, std::vector<float>& scores) {
  const int64_t first = p.first(seq), len = p.lens[seq], span = len - first;
  const int64_t* blocks = p.table + seq * p.max_blocks;
  scores.resize(G * span);
  __m512bh query[G][D];
  for (int h = 0; h < G; ++h)
    for (int c = 0; c < D; ++c) query[h][c] = pairs(p.q + (seq * p.heads + g * G + h) * p.dim + 32 * c);
  const __m512 scale = _mm512_set1_ps(p.scale);
  // Scores: q . k for every key, 16 tokens a tile.
  const Bf16* rows[kTile];
  const int64_t ahead = std::max(kTile, kAheadBytes / (p.dim * 2) / kTile * kTile);
  for (int64_t t0 = first; t0 < len; t0 += kTile) {
    const int64_t count = std::min(kTile, len - t0);
    if ((t0 - first) % ahead == 0) read_ahead(p, p.k, blocks, g, t0, std::min(len, t0 + ahead));
    int64_t block = t0 / p.block_size, offset = t0 % p.block_size;
    for (int64_t i = 0; i < count; ++i) {
      rows[i] = p.k + p.at(blocks[block], g, offset);
      if (++offset == p.block_size) offset = 0, ++block;
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << count) - 1);
    for (int h = 0; h < G; ++h) {
      __m512 sums[kTile];
      for (int64_t i = 0; i < kTile; ++i) {
        sums[i] = _mm512_setzero_ps();
        if (i < count)
          for (int c = 0; c < D; ++c)
            sums[i] = _mm512_dpbf16_ps(sums[i], query[h][c], pairs(rows[i] + 32 * c));
      }
      _mm512_mask_storeu_ps(scores.data() + h * span + (t0 - first), keep,
                            _mm512_mul_ps(transpose_sum(sums), scale));
    }
  }
  float inv[G];
  for (int h = 0; h < G; ++h) inv[h] = 1.f / tandem::softmax_numerators(scores.data() + h * span, span);
  // Values: 64 dims a pass over the context, every head's sums in registers throughout.
  const __m512i high = _mm512_set1_epi32(~0xFFFF);
  Bf16* out = p.out + (seq * p.heads + g * G) * p.dim;
  for (int64_t c0 = 0; c0 < D * 32; c0 += kChunk) {
    __m512 acc[G][4];  // per head: dims c0 .. c0 + 32 even, odd; c0 + 32 .. c0 + 64 even, odd
    for (int h = 0; h < G; ++h)
      for (int w = 0; w < 4; ++w) acc[h][w] = _mm512_setzero_ps();
    int64_t block = first / p.block_size, offset = first % p.block_size;
    for (int64_t t = first; t < len; ++t) {
      if (c0 == 0 && (t - first) % ahead == 0)  // whole rows: later passes too
        read_ahead(p, p.v, blocks, g, t, std::min(len, t + ahead));
      const Bf16* src = p.v + p.at(blocks[block], g, offset) + c0;
      if (++offset == p.block_size) offset = 0, ++block;
      const __m512i lo = _mm512_loadu_si512(src), hi = _mm512_loadu_si512(src + 32);
      const __m512 v[4] = {_mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)),
                           _mm512_castsi512_ps(_mm512_and_si512(lo, high)),
                           _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)),
                           _mm512_castsi512_ps(_mm512_and_si512(hi, high))};
      for (int h = 0; h < G; ++h) {
        const __m512 weight = _mm512_set1_ps(scores[h * span + (t - first)]);
        for (int w = 0; w < 4; ++w) acc[h][w] = _mm512_fmadd_ps(weight, v[w], acc[h][w]);
      }
    }
    for (int h = 0; h < G; ++h) {
      const __m512 norm = _mm512_set1_ps(inv[h]);
      store_pairs(out + h * p.dim + c0, acc[h][0], acc[h][1], norm);
      store_pairs(out + h * p.dim + c0 + 32, acc[h][2], acc[h][3], norm);
    }
  }
}

template <int G, int D>
void attend_all(const Problem<Bf16>& p) {
  at::parallel_for(0, p.n * p.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task)
      attend<G, D>(p, task / p.kv_heads, task % p.kv_heads, scores);
  });
}
#endif

}  // namespace

namespace tandem::attention {

bool attend_bf16(const Problem<c10::BFloat16>& p) {
#if TANDEM_HAS_BF16_ATTENTION
  const auto with_dim = [&](auto group) {
    constexpr int G = decltype(group)::value;
    switch (p.dim) {
      case 64: attend_all<G, 2>(p); return true;
      case 128: attend_all<G, 4>(p); return true;
      case 256: attend_all<G, 8>(p); return true;
      default: return false;
    }
  };
  switch (p.group()) {
    case 1: return with_dim(std::integral_constant<int, 1>{});
    case 2: return with_dim(std::integral_constant<int, 2>{});
    case 3: return with_dim(std::integral_constant<int, 3>{});
    case 4: return with_dim(std::integral_constant<int, 4>{});
    default: return false;
  }
#else
  (void)p;
  return false;
#endif
}

}  // namespace tandem::attention
