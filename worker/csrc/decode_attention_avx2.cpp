// Paged decode attention on CPUs with AVX2 and FMA but no AVX-512 (AMD Zen 2/3, Intel
// client parts): decode_attention.cpp's tiled kernel and decode_attention_bf16.cpp need
// AVX-512, and its plain loops (one task per sequence, one score at a time) left a batch of
// one on one core and read the KV cache at ~2 GB/s.
//
// One task is one (sequence, KV head) pair, so a batch of one still splits over the cores
// and a sequence's output never depends on the rest of the batch. Its keys are read once
// and serve every query head of the group: two tokens at a time, 2 x group float32 sums
// in registers (independent FMA chains), each reduced once. The softmax's exp is a
// polynomial in 8 lanes (simd.h's exp_lanes, in AVX2). Its values are read once per 16
// dimensions (two vectors, each converted once and serving every head); the rows of one
// (sequence, KV head) are a few KiB per 64 tokens, in L1 or L2 for the passes after the
// first. Sums are float32 whatever the cache's dtype.
#include "attention_problem.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "avx2.h"

#include <cmath>
#include <vector>

namespace {

using tandem::attention::Problem;
using tandem::avx2::hsum;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  return tandem::avx2::widen_bf16(reinterpret_cast<const uint16_t*>(p));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// exp(x) for x < 88 (below -87, 0), as simd.h's exp_lanes: 2^k e^r, e^r to r^7.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693147180559945309f), x);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  // 2^k for k >= -126: k + 127 in the exponent field
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// scores[0, n) := exp(scores - max); returns their sum.
float softmax8(float* scores, int64_t n) {
  __m256 tops = _mm256_set1_ps(scores[0]);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) tops = _mm256_max_ps(tops, _mm256_loadu_ps(scores + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, tops);
  float top = lanes[0];
  for (int i = 1; i < 8; ++i) top = std::max(top, lanes[i]);
  for (; t < n; ++t) top = std::max(top, scores[t]);
  const __m256 shift = _mm256_set1_ps(top);
  __m256 total = _mm256_setzero_ps();
  for (t = 0; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), shift));
    _mm256_storeu_ps(scores + t, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = hsum(total);
  for (; t < n; ++t) {
    scores[t] = std::exp(scores[t] - top);
    sum += scores[t];
  }
  return sum;
}

// Token t's row of KV head g, walking the block table a token at a time.
template <typename T>
struct Rows {
  const Problem<T>& p;
  const T* cache;
  const int64_t* blocks;
  int64_t g, block, offset;

  Rows(const Problem<T>& problem, const T* c, int64_t seq, int64_t head, int64_t t)
      : p(problem), cache(c), blocks(problem.table + seq * problem.max_blocks), g(head),
        block(t / problem.block_size), offset(t % problem.block_size) {}
  const T* next() {
    const T* row = cache + p.at(blocks[block], g, offset);
    if (++offset == p.block_size) offset = 0, ++block;
    return row;
  }
};

// One sequence's G query heads of KV head g against its context.
template <int G, typename T>
void attend_group(const Problem<T>& p, int64_t seq, int64_t g, std::vector<float>& queries,
                  std::vector<float>& scores) {
  const int64_t dim = p.dim, len = p.lens[seq], first = p.first(seq), span = len - first;
  const T* q = p.q + (seq * p.heads + g * G) * dim;
  for (int64_t j = 0; j < G * dim; ++j) queries[j] = static_cast<float>(q[j]) * p.scale;
  scores.resize(G * span);
  const float* qs = queries.data();
  Rows<T> keys(p, p.k, seq, g, first);
  int64_t t = 0;
  for (; t + 2 <= span; t += 2) {
    const T* k0 = keys.next();
    const T* k1 = keys.next();
    __m256 s0[G], s1[G];
    for (int h = 0; h < G; ++h) s0[h] = s1[h] = _mm256_setzero_ps();
    for (int64_t c = 0; c < dim; c += 8) {
      const __m256 a = load8(k0 + c), b = load8(k1 + c);
      for (int h = 0; h < G; ++h) {
        const __m256 qv = _mm256_loadu_ps(qs + h * dim + c);
        s0[h] = _mm256_fmadd_ps(qv, a, s0[h]);
        s1[h] = _mm256_fmadd_ps(qv, b, s1[h]);
      }
    }
    for (int h = 0; h < G; ++h) {
      scores[h * span + t] = hsum(s0[h]);
      scores[h * span + t + 1] = hsum(s1[h]);
    }
  }
  if (t < span) {
    const T* k0 = keys.next();
    for (int h = 0; h < G; ++h) {
      __m256 s = _mm256_setzero_ps();
      for (int64_t c = 0; c < dim; c += 8)
        s = _mm256_fmadd_ps(_mm256_loadu_ps(qs + h * dim + c), load8(k0 + c), s);
      scores[h * span + t] = hsum(s);
    }
  }
  float inv[G];
  for (int h = 0; h < G; ++h) inv[h] = 1.f / softmax8(scores.data() + h * span, span);
  T* dst = p.out + (seq * p.heads + g * G) * dim;
  for (int64_t c = 0; c < dim; c += 16) {
    __m256 acc[G][2];
    for (int h = 0; h < G; ++h) acc[h][0] = acc[h][1] = _mm256_setzero_ps();
    Rows<T> values(p, p.v, seq, g, first);
    for (int64_t i = 0; i < span; ++i) {
      const T* row = values.next() + c;
      const __m256 v0 = load8(row), v1 = load8(row + 8);
      for (int h = 0; h < G; ++h) {
        const __m256 w = _mm256_set1_ps(scores[h * span + i]);
        acc[h][0] = _mm256_fmadd_ps(w, v0, acc[h][0]);
        acc[h][1] = _mm256_fmadd_ps(w, v1, acc[h][1]);
      }
    }
    for (int h = 0; h < G; ++h) {
      alignas(32) float out[16];
      const __m256 scale = _mm256_set1_ps(inv[h]);
      _mm256_store_ps(out, _mm256_mul_ps(acc[h][0], scale));
      _mm256_store_ps(out + 8, _mm256_mul_ps(acc[h][1], scale));
      for (int j = 0; j < 16; ++j) dst[h * dim + c + j] = static_cast<T>(out[j]);
    }
  }
}

template <int G, typename T>
void attend_all(const Problem<T>& p) {
  at::parallel_for(0, p.n * p.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(G * p.dim), scores;
    for (int64_t task = begin; task < end; ++task)
      attend_group<G>(p, task / p.kv_heads, task % p.kv_heads, queries, scores);
  });
}

template <typename T>
bool attend(const Problem<T>& p) {
  if (p.dim % 16 != 0) return false;
  switch (p.group()) {
    case 1: attend_all<1>(p); return true;
    case 2: attend_all<2>(p); return true;
    case 3: attend_all<3>(p); return true;
    case 4: attend_all<4>(p); return true;
    case 5: attend_all<5>(p); return true;
    case 6: attend_all<6>(p); return true;
    case 7: attend_all<7>(p); return true;
    case 8: attend_all<8>(p); return true;
    default: return false;
  }
}

}  // namespace

namespace tandem::attention {
bool attend_avx2(const Problem<float>& p) { return attend(p); }
bool attend_avx2(const Problem<c10::BFloat16>& p) { return attend(p); }
bool attend_avx2(const Problem<c10::Half>& p) { return attend(p); }
}  // namespace tandem::attention

#else

namespace tandem::attention {
bool attend_avx2(const Problem<float>&) { return false; }
bool attend_avx2(const Problem<c10::BFloat16>&) { return false; }
bool attend_avx2(const Problem<c10::Half>&) { return false; }
}  // namespace tandem::attention

#endif
