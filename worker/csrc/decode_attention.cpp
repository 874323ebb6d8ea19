// Paged decode attention for CPU: one query token per sequence attends to its context
// read in place from the block-paged KV cache (no gather copy). Scores, softmax and the
// weighted sum are accumulated in float32 whatever the dtype.
//
// With AVX-512 and a head size that is a multiple of 16 (every model we serve), one task
// is one (sequence, KV head) pair: its keys and values are read once, 16 tokens at a
// time, converted to float once, and serve every query head of the group. Keys go through
// an L1 tile; the 16 dot products of a tile are reduced together (one transpose-add tree,
// not 16 horizontal sums). Values of groups up to 4 heads (head size a multiple of 64)
// are converted in registers, every head's accumulators held there across the tile; other
// groups go through the tile too. With AVX2 and FMA alone decode_attention_avx2.cpp's
// kernel takes them; elsewhere one task per sequence runs the plain loops.
// Bfloat16 caches of the shapes we serve go to decode_attention_bf16.cpp instead, where the
// CPU has AVX512-BF16.
//
// kv_cache: [2, num_blocks, kv_heads, block_size, head_dim], contiguous: a block holds each
// KV head's rows side by side, so one task's rows of a block are one contiguous run (the
// hardware prefetcher follows it; rows interleaved by head it did not). q: [n, heads,
// head_dim] contiguous; block_table: [n, max_blocks] int64;
// context_lens: [n] int64 (the query is the last position). window > 0 limits each
// query to its last `window` positions (sliding-window layers).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "attention_problem.h"
#include "simd.h"

namespace {

using tandem::attention::Problem;
using tandem::add_scaled;
using tandem::dot;
using tandem::softmax_numerators;

#if defined(__AVX512F__)
using tandem::attention::transpose_sum;
using tandem::kLanes;
using tandem::load_lanes;
using tandem::store_lanes;

constexpr int64_t kTile = 16;      // tokens per tile: one vector of scores
constexpr int64_t kMaxGroup = 64;  // query heads per KV head (the most we serve: 8)

// acc[h][c .. c + W) += sum over the tile's tokens i of weights[h][i] * tile[i][c ..]:
// W vectors accumulated in registers across the tile.
template <int W>
inline void accumulate_slab(float* acc, const float* weights, const float* tile, int64_t count,
                            int64_t dim, int64_t c) {
  __m512 a[W];
  for (int w = 0; w < W; ++w) a[w] = _mm512_loadu_ps(acc + (c + w) * kLanes);
  for (int64_t i = 0; i < count; ++i) {
    const __m512 weight = _mm512_set1_ps(weights[i]);
    for (int w = 0; w < W; ++w)
      a[w] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(tile + i * dim + (c + w) * kLanes), a[w]);
  }
  for (int w = 0; w < W; ++w) _mm512_storeu_ps(acc + (c + w) * kLanes, a[w]);
}

// acc[h][c0 .. c0 + 4 lanes) += sum over the tile's tokens of weights[h][i] * v[i][...]
// for every head h < G of the group at once: each value vector is converted once and
// serves G heads, and 4G independent accumulators stay in registers across the tile.
// Per lane the same fused multiply-adds in the same token order as accumulate_slab.
template <int G, typename T>
inline void accumulate_values(const Problem<T>& p, int64_t seq, int64_t g, int64_t t0,
                              int64_t count, const float* weights, int64_t span, float* acc) {
  constexpr int W = 4;
  const int64_t* blocks = p.table + seq * p.max_blocks;
  for (int64_t c0 = 0; c0 < p.dim; c0 += W * kLanes) {
    __m512 a[G][W];
    for (int h = 0; h < G; ++h)
      for (int w = 0; w < W; ++w) a[h][w] = _mm512_loadu_ps(acc + h * p.dim + c0 + w * kLanes);
    int64_t block = t0 / p.block_size, offset = t0 % p.block_size;
    for (int64_t i = 0; i < count; ++i) {
      const T* src = p.v + p.at(blocks[block], g, offset) + c0;
      __m512 v[W];
      for (int w = 0; w < W; ++w) v[w] = load_lanes(src + w * kLanes);
      for (int h = 0; h < G; ++h) {
        const __m512 weight = _mm512_set1_ps(weights[h * span + i]);
        for (int w = 0; w < W; ++w) a[h][w] = _mm512_fmadd_ps(weight, v[w], a[h][w]);
      }
      if (++offset == p.block_size) offset = 0, ++block;
    }
    for (int h = 0; h < G; ++h)
      for (int w = 0; w < W; ++w) _mm512_storeu_ps(acc + h * p.dim + c0 + w * kLanes, a[h][w]);
  }
}

// tile[i] := the float rows of tokens t0 + i (i < count) for KV head g, from `cache`.
// The block is found by one division per tile, then stepped (a division per token
// costs more than the token's arithmetic).
template <typename T>
inline void load_tile(const Problem<T>& p, const T* cache, int64_t seq, int64_t g, int64_t t0,
                      int64_t count, float* tile) {
  const int64_t* blocks = p.table + seq * p.max_blocks;
  int64_t block = t0 / p.block_size, offset = t0 % p.block_size;
  for (int64_t i = 0; i < count; ++i) {
    const T* src = cache + p.at(blocks[block], g, offset);
    for (int64_t j = 0; j < p.dim; j += kLanes) _mm512_storeu_ps(tile + i * p.dim + j, load_lanes(src + j));
    if (++offset == p.block_size) offset = 0, ++block;
  }
  std::fill(tile + count * p.dim, tile + kTile * p.dim, 0.f);  // a short last tile
}

// Asks for the rows of tokens t0 .. t0 + count (KV head g) to be brought into cache while
// the current tile is computed: a tile's rows are scattered over blocks, and one core
// waiting on each miss in turn reads the cache at a third of the memory's speed.
template <typename T>
inline void prefetch_tile(const Problem<T>& p, const T* cache, int64_t seq, int64_t g,
                          int64_t t0, int64_t count) {
  const int64_t* blocks = p.table + seq * p.max_blocks;
  int64_t block = t0 / p.block_size, offset = t0 % p.block_size;
  const int64_t bytes = p.dim * static_cast<int64_t>(sizeof(T));
  for (int64_t i = 0; i < count; ++i) {
    const char* src = reinterpret_cast<const char*>(
        cache + p.at(blocks[block], g, offset));
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(src + b, _MM_HINT_T0);
    if (++offset == p.block_size) offset = 0, ++block;
  }
}

// One sequence's query heads of KV head g against its context.
template <typename T>
void attend_group(const Problem<T>& p, int64_t seq, int64_t g, std::vector<float>& queries,
                  std::vector<float>& scores, std::vector<float>& tile, std::vector<float>& acc) {
  const int64_t group = p.group(), dim = p.dim, chunks = dim / kLanes;
  const int64_t len = p.lens[seq], first = p.first(seq), span = len - first;
  const T* q = p.q + (seq * p.heads + g * group) * dim;
  for (int64_t j = 0; j < group * dim; ++j) queries[j] = static_cast<float>(q[j]) * p.scale;
  scores.resize(group * span);
  for (int64_t t0 = first; t0 < len; t0 += kTile) {
    const int64_t count = std::min(kTile, len - t0);
    if (t0 + kTile < len) prefetch_tile(p, p.k, seq, g, t0 + kTile, std::min(kTile, len - t0 - kTile));
    else prefetch_tile(p, p.v, seq, g, first, std::min(kTile, span));  // the values' first tile
    load_tile(p, p.k, seq, g, t0, count, tile.data());
    const __mmask16 keep = static_cast<__mmask16>((1u << count) - 1);
    for (int64_t h = 0; h < group; ++h) {
      // Chunk by chunk over all 16 tokens: 16 independent accumulators, not one chain.
      __m512 sums[kTile];
      for (int64_t i = 0; i < kTile; ++i) sums[i] = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512 query = _mm512_loadu_ps(queries.data() + h * dim + c * kLanes);
        for (int64_t i = 0; i < kTile; ++i)
          sums[i] = _mm512_fmadd_ps(query, _mm512_loadu_ps(tile.data() + i * dim + c * kLanes), sums[i]);
      }
      _mm512_mask_storeu_ps(scores.data() + h * span + (t0 - first), keep, transpose_sum(sums));
    }
  }
  float inv[kMaxGroup];
  for (int64_t h = 0; h < group; ++h) inv[h] = 1.f / softmax_numerators(scores.data() + h * span, span);
  std::fill(acc.begin(), acc.begin() + group * dim, 0.f);
  for (int64_t t0 = first; t0 < len; t0 += kTile) {
    const int64_t count = std::min(kTile, len - t0);
    if (t0 + kTile < len) prefetch_tile(p, p.v, seq, g, t0 + kTile, std::min(kTile, len - t0 - kTile));
    const float* tile_weights = scores.data() + (t0 - first);
    if (p.dim % (4 * kLanes) == 0 && group <= 4) {
      switch (group) {
        case 1: accumulate_values<1>(p, seq, g, t0, count, tile_weights, span, acc.data()); continue;
        case 2: accumulate_values<2>(p, seq, g, t0, count, tile_weights, span, acc.data()); continue;
        case 3: accumulate_values<3>(p, seq, g, t0, count, tile_weights, span, acc.data()); continue;
        case 4: accumulate_values<4>(p, seq, g, t0, count, tile_weights, span, acc.data()); continue;
      }
    }
    load_tile(p, p.v, seq, g, t0, count, tile.data());
    for (int64_t h = 0; h < group; ++h) {
      const float* weights = scores.data() + h * span + (t0 - first);
      int64_t c = 0;
      for (; c + 4 <= chunks; c += 4) accumulate_slab<4>(acc.data() + h * dim, weights, tile.data(), count, dim, c);
      for (; c < chunks; ++c) accumulate_slab<1>(acc.data() + h * dim, weights, tile.data(), count, dim, c);
    }
  }
  T* dst = p.out + (seq * p.heads + g * group) * dim;
  for (int64_t h = 0; h < group; ++h) {
    const __m512 scale = _mm512_set1_ps(inv[h]);
    for (int64_t j = 0; j < dim; j += kLanes)
      store_lanes(dst + h * dim + j, _mm512_mul_ps(_mm512_loadu_ps(acc.data() + h * dim + j), scale));
  }
}

template <typename T>
void attend_tiled(const Problem<T>& p) {
  at::parallel_for(0, p.n * p.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(p.group() * p.dim), scores, tile(kTile * p.dim), acc(p.group() * p.dim);
    for (int64_t task = begin; task < end; ++task)
      attend_group(p, task / p.kv_heads, task % p.kv_heads, queries, scores, tile, acc);
  });
}
#endif

// One task per sequence: each KV head's row is read once and serves its query heads.
template <typename T>
void attend_plain(const Problem<T>& p) {
  const int64_t heads = p.heads, dim = p.dim, group = p.group();
  at::parallel_for(0, p.n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(heads * dim), acc(heads * dim), scores, inv(heads);
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t len = p.lens[seq], first = p.first(seq), span = len - first;
      scores.resize(heads * span);
      const T* q_seq = p.q + seq * heads * dim;
      for (int64_t j = 0; j < heads * dim; ++j) queries[j] = static_cast<float>(q_seq[j]) * p.scale;
      for (int64_t t = first; t < len; ++t)
        for (int64_t h = 0; h < heads; ++h)
          scores[h * span + (t - first)] = dot(queries.data() + h * dim, p.k + p.row(seq, t, h / group), dim);
      for (int64_t h = 0; h < heads; ++h) inv[h] = 1.f / softmax_numerators(scores.data() + h * span, span);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = first; t < len; ++t)
        for (int64_t h = 0; h < heads; ++h)
          add_scaled(acc.data() + h * dim, scores[h * span + (t - first)], p.v + p.row(seq, t, h / group), dim);
      T* dst = p.out + seq * heads * dim;
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t j = 0; j < dim; ++j) dst[h * dim + j] = static_cast<T>(acc[h * dim + j] * inv[h]);
    }
  });
}

template <typename T>
void attend_problem(const Problem<T>& p) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (tandem::attention::attend_bf16(p)) return;
  }
#if defined(__AVX512F__)
  if (p.dim % kLanes == 0 && p.group() <= kMaxGroup) return attend_tiled(p);
#endif
  if (tandem::attention::attend_avx2(p)) return;
  attend_plain(p);
}

template <typename T>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& kv_cache,
                           const at::Tensor& block_table, const at::Tensor& context_lens,
                           at::Tensor& out, double scale, int64_t window, int64_t block_size) {
  const int64_t num_blocks = kv_cache.size(1), kv_heads = kv_cache.size(2), dim = q.size(2);
  const T* k = kv_cache.data_ptr<T>();
  attend_problem(Problem<T>{q.data_ptr<T>(), k, k + num_blocks * kv_heads * block_size * dim,
                            block_table.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                            out.data_ptr<T>(), q.size(0), q.size(1), kv_heads, dim,
                            block_table.size(1), block_size, window, static_cast<float>(scale)});
}

}  // namespace

void check_decode_metadata(const at::Tensor& block_table, const at::Tensor& context_lens,
                           int64_t n, int64_t num_blocks, int64_t block_size) {
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.is_contiguous() &&
                  block_table.dim() == 2 && block_table.size(0) == n,
              "block_table must be contiguous int64 [n, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
                  context_lens.numel() == n,
              "context_lens must be contiguous int64 [n]");
  // Indices come from the runner's own metadata; checked anyway, since a bad one would
  // read outside the cache.
  const int64_t max_blocks = block_table.size(1);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  for (int64_t i = 0; i < block_table.size(0); ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= max_blocks * block_size, "context length out of range");
    for (int64_t b = 0; b < (lens[i] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(table[i * max_blocks + b] >= 0 && table[i * max_blocks + b] < num_blocks,
                  "block id out of range");
  }
}

void decode_attention_bf16_rows(const tandem::attention::Problem<c10::BFloat16>& p) {
  attend_problem(p);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_table, const at::Tensor& context_lens,
                            double scale, int64_t window, int64_t block_size) {
  tandem::check_cpu("decode_attention", q, kv_cache, block_table, context_lens);
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [n, heads, dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be contiguous [2, num_blocks, kv_heads, block_size, dim]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache dtypes differ");
  TORCH_CHECK(q.size(2) == kv_cache.size(4) && q.size(1) % kv_cache.size(2) == 0,
              "head shapes of q and kv_cache do not match");
  TORCH_CHECK(block_size == kv_cache.size(3), "block_size does not match kv_cache's");
  check_decode_metadata(block_table, context_lens, q.size(0), kv_cache.size(1), block_size);
  auto out = at::empty_like(q);
  tandem::dispatch_float_types(q.scalar_type(), "decode_attention", [&](auto tag) {
    decode_attention_impl<decltype(tag)>(q, kv_cache, block_table, context_lens, out, scale,
                                         window, block_size);
  });
  return out;
}

