// Paged decode attention for CPU: one query token per sequence attends to its context
// read in place from the block-paged KV cache (no gather copy). Work is split over
// (sequence, KV head) pairs; the query heads of a GQA group share each K/V row read.
// Scores, softmax and the weighted sum are accumulated in float32 whatever the dtype.
//
// kv_cache: [2, num_slots, kv_heads, head_dim], contiguous (slot = block * block_size +
// offset); q: [n, heads, head_dim] contiguous; block_table: [n, max_blocks] int64;
// context_lens: [n] int64 (the query is the last position). window > 0 limits each
// query to its last `window` positions (sliding-window layers).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename T>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& kv_cache,
                           const at::Tensor& block_table, const at::Tensor& context_lens,
                           at::Tensor& out, double scale, int64_t window, int64_t block_size) {
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t num_slots = kv_cache.size(1), kv_heads = kv_cache.size(2);
  const int64_t group = heads / kv_heads;
  const int64_t max_blocks = block_table.size(1);
  const T* q_data = q.data_ptr<T>();
  const T* k_data = kv_cache.data_ptr<T>();
  const T* v_data = k_data + num_slots * kv_heads * dim;
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* out_data = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries(group * dim), row(dim), acc(group * dim), scores, denom(group);
    for (int64_t work = begin; work < end; ++work) {
      const int64_t seq = work / kv_heads, head = work % kv_heads;
      const int64_t len = lens[seq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t span = len - first;
      const int64_t* blocks = table + seq * max_blocks;
      scores.resize(group * span);
      for (int64_t g = 0; g < group; ++g) {
        const T* src = q_data + (seq * heads + head * group + g) * dim;
        for (int64_t j = 0; j < dim; ++j) queries[g * dim + j] = static_cast<float>(src[j]) * fscale;
      }
      for (int64_t t = first; t < len; ++t) {
        const int64_t slot = blocks[t / block_size] * block_size + t % block_size;
        const T* key = k_data + (slot * kv_heads + head) * dim;
        for (int64_t j = 0; j < dim; ++j) row[j] = static_cast<float>(key[j]);
        for (int64_t g = 0; g < group; ++g) {
          const float* query = queries.data() + g * dim;
          float dot = 0.f;
          for (int64_t j = 0; j < dim; ++j) dot += query[j] * row[j];
          scores[g * span + (t - first)] = dot;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * span;
        const float top = *std::max_element(s, s + span);
        float sum = 0.f;
        for (int64_t t = 0; t < span; ++t) {
          s[t] = std::exp(s[t] - top);
          sum += s[t];
        }
        denom[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = first; t < len; ++t) {
        const int64_t slot = blocks[t / block_size] * block_size + t % block_size;
        const T* value = v_data + (slot * kv_heads + head) * dim;
        for (int64_t j = 0; j < dim; ++j) row[j] = static_cast<float>(value[j]);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * span + (t - first)];
          float* a = acc.data() + g * dim;
          for (int64_t j = 0; j < dim; ++j) a[j] += p * row[j];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = out_data + (seq * heads + head * group + g) * dim;
        const float inv = 1.f / denom[g];
        for (int64_t j = 0; j < dim; ++j) dst[j] = static_cast<T>(acc[g * dim + j] * inv);
      }
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                            const at::Tensor& block_table, const at::Tensor& context_lens,
                            double scale, int64_t window, int64_t block_size) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "CPU tensors only");
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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    decode_attention_impl<scalar_t>(q, kv_cache, block_table, context_lens, out, scale, window,
                                    block_size);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (CPU)");
}
