// Paged decode attention for CPU: one query token per sequence attends to its context
// read in place from the block-paged KV cache (no gather copy). One task per sequence:
// each K/V row (all KV heads, contiguous) is read once and serves every query head.
// Scores, softmax and the weighted sum are accumulated in float32 whatever the dtype.
//
// kv_cache: [2, num_slots, kv_heads, head_dim], contiguous (slot = block * block_size +
// offset); q: [n, heads, head_dim] contiguous; block_table: [n, max_blocks] int64;
// context_lens: [n] int64 (the query is the last position). window > 0 limits each
// query to its last `window` positions (sliding-window layers).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "simd.h"

namespace {

using tandem::add_scaled;
using tandem::dot;
using tandem::softmax_numerators;

template <typename T>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& kv_cache,
                           const at::Tensor& block_table, const at::Tensor& context_lens,
                           at::Tensor& out, double scale, int64_t window, int64_t block_size) {
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t num_slots = kv_cache.size(1), kv_heads = kv_cache.size(2);
  const int64_t group = heads / kv_heads, row_len = kv_heads * dim;
  const int64_t max_blocks = block_table.size(1);
  const T* q_data = q.data_ptr<T>();
  const T* k_data = kv_cache.data_ptr<T>();
  const T* v_data = k_data + num_slots * row_len;
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* out_data = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(heads * dim), acc(heads * dim), scores, inv(heads);
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t len = lens[seq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t span = len - first;
      const int64_t* blocks = table + seq * max_blocks;
      scores.resize(heads * span);
      const T* q_seq = q_data + seq * heads * dim;
      for (int64_t j = 0; j < heads * dim; ++j) queries[j] = static_cast<float>(q_seq[j]) * fscale;
      for (int64_t t = first; t < len; ++t) {
        const T* key = k_data + (blocks[t / block_size] * block_size + t % block_size) * row_len;
        for (int64_t h = 0; h < heads; ++h)
          scores[h * span + (t - first)] = dot(queries.data() + h * dim, key + (h / group) * dim, dim);
      }
      for (int64_t h = 0; h < heads; ++h) inv[h] = 1.f / softmax_numerators(scores.data() + h * span, span);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = first; t < len; ++t) {
        const T* value = v_data + (blocks[t / block_size] * block_size + t % block_size) * row_len;
        for (int64_t h = 0; h < heads; ++h)
          add_scaled(acc.data() + h * dim, scores[h * span + (t - first)], value + (h / group) * dim, dim);
      }
      T* dst = out_data + seq * heads * dim;
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t j = 0; j < dim; ++j) dst[h * dim + j] = static_cast<T>(acc[h * dim + j] * inv[h]);
    }
  });
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_table, const at::Tensor& context_lens,
                            double scale, int64_t window, int64_t block_size) {
  tandem::check_cpu("decode_attention", q, kv_cache, block_table, context_lens);
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [n, heads, dim]");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be contiguous [2, slots, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache dtypes differ");
  TORCH_CHECK(q.size(2) == kv_cache.size(3) && q.size(1) % kv_cache.size(2) == 0,
              "head shapes of q and kv_cache do not match");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.is_contiguous() &&
                  block_table.dim() == 2 && block_table.size(0) == q.size(0),
              "block_table must be contiguous int64 [n, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
                  context_lens.numel() == q.size(0),
              "context_lens must be contiguous int64 [n]");
  TORCH_CHECK(block_size > 0 && kv_cache.size(1) % block_size == 0, "bad block_size");
  // Indices come from the runner's own metadata; checked anyway, since a bad one would
  // read outside the cache.
  const int64_t num_blocks = kv_cache.size(1) / block_size, max_blocks = block_table.size(1);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  for (int64_t i = 0; i < q.size(0); ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= max_blocks * block_size, "context length out of range");
    for (int64_t b = 0; b < (lens[i] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(table[i * max_blocks + b] >= 0 && table[i * max_blocks + b] < num_blocks,
                  "block id out of range");
  }
  auto out = at::empty_like(q);
  tandem::dispatch_float_types(q.scalar_type(), "decode_attention", [&](auto tag) {
    decode_attention_impl<decltype(tag)>(q, kv_cache, block_table, context_lens, out, scale,
                                         window, block_size);
  });
  return out;
}

