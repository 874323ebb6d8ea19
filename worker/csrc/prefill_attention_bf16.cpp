// Causal attention of one prefill chunk in bfloat16 on AVX512-BF16 CPUs: the chunk's
// queries against every key before them (the cached prefix and the chunk's own tokens),
// or under a sliding window (Gemma 3's local layers) against the last `window` of them.
//
// PyTorch's CPU flash attention computes this at ~150-185 GFLOP/s on a 2-core Zen 5, ~75%
// of a 3,500-token prompt's prefill, while bf16_gemm's tiles reach ~900 (docs/
// benchmarks.md). Both products here are such tiles: VDPBF16PS with a pair of one row's
// bfloat16 inputs broadcast into every lane against 16 outputs x 2 inputs of a packed
// operand, 14 rows x 32 outputs in float32 accumulators.
//
//   scores = Q K^T:  rows are queries, outputs keys, K packed once per KV head;
//   out    = P V:    rows are queries, outputs head dims, V packed once per KV head.
//
// A task is a tile of up to 14 rows of one KV head, a row being (query, query head of
// that KV head's group), ordered query by query. It computes the tile's scores against
// every key up to its last query's position in float32 (from its first query's window
// start, whole key groups before it skipped), takes each row's softmax exactly (max, exp,
// sum over the keys that row sees; the others weigh 0), rounds the weights to
// bfloat16 (as PyTorch's flash kernel does for bfloat16 inputs) and divides the float32
// weighted sum by the row's sum once. Tasks run longest first from a shared counter:
// under the causal mask the last queries see the most keys. A row's result depends on its
// own query and keys only, never on the tile or thread that computed it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "simd.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TANDEM_HAS_BF16_PREFILL 1
#else
#define TANDEM_HAS_BF16_PREFILL 0
#endif

namespace {

using Bits = uint16_t;  // a bfloat16's bits

// One chunk's attention: queries [queries, heads, dim] at positions offset.., keys and
// values [kv_heads, offset + queries, dim], out [queries, heads, dim] (contiguous). With a
// window (> 0), the query at position t sees keys (t - window, t].
struct PrefillProblem {
  const Bits* q;
  const Bits* k;
  const Bits* v;
  Bits* out;
  int64_t queries, offset, heads, kv_heads, dim, window;
  int64_t q_token_stride, q_head_stride, k_head_stride, k_token_stride, v_head_stride,
      v_token_stride;
  float scale;
};

#if TANDEM_HAS_BF16_PREFILL
using tandem::bf16_bits;
using tandem::softmax_numerators;

constexpr int64_t kHalf = 16;       // outputs per vector
constexpr int64_t kGroup = 32;      // outputs per tile: two vectors
constexpr int64_t kTileRows = 14;   // rows per tile: 28 accumulators in registers

// K of one KV head: packed[g][dp][b][16][2] = K[32 g + 16 b + i][2 dp + j] (zero past the
// last key), so a group of 32 keys is one ascending run over every dim pair.
void pack_keys(const Bits* k, int64_t key_stride, int64_t keys, int64_t dim, Bits* packed) {
  const int64_t groups = (keys + kGroup - 1) / kGroup, pairs = dim / 2;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t dp = 0; dp < pairs; ++dp)
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t i = 0; i < kHalf; ++i) {
          const int64_t key = g * kGroup + b * kHalf + i;
          Bits* out = packed + (((g * pairs + dp) * 2 + b) * kHalf + i) * 2;
          out[0] = key < keys ? k[key * key_stride + 2 * dp] : 0;
          out[1] = key < keys ? k[key * key_stride + 2 * dp + 1] : 0;
        }
}

// V of one KV head: packed[g][kp][b][16][2] = V[2 kp + j][32 g + 16 b + i] (zero past the
// last key), so a group of 32 dims is one ascending run over every key pair.
void pack_values(const Bits* v, int64_t key_stride, int64_t keys, int64_t dim, Bits* packed) {
  const int64_t key_pairs = (keys + 1) / 2;
  for (int64_t g = 0; g < dim / kGroup; ++g)
    for (int64_t kp = 0; kp < key_pairs; ++kp)
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t i = 0; i < kHalf; ++i) {
          const int64_t d = g * kGroup + b * kHalf + i;
          Bits* out = packed + (((g * key_pairs + kp) * 2 + b) * kHalf + i) * 2;
          for (int64_t j = 0; j < 2; ++j) {
            const int64_t key = 2 * kp + j;
            out[j] = key < keys ? v[key * key_stride + d] : 0;
          }
        }
}

// acc[r][*] = sum over `pairs` of x[r][pair] . w[pair][*]: R rows against one packed group.
template <int R>
inline void dot_group(const uint32_t* x, int64_t x_pairs, const __m512bh* w, int64_t pairs,
                      __m512 (&acc)[R][2]) {
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + 2 * p);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 2 * p + 1);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[r * x_pairs + p]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
    }
  }
}

struct Head {
  const __m512bh* keys;    // pack_keys
  const __m512bh* values;  // pack_values
  int64_t key_pairs;       // (keys + 1) / 2, the pairs each V group holds
};

struct Scratch {
  std::vector<uint32_t> q;     // the tile's query rows, dim / 2 pairs each
  std::vector<float> scores;   // R x (keys rounded up to a group)
  std::vector<uint32_t> probs; // R x key pairs: the softmax weights in bfloat16
};

// The first key the query at `position` sees (its last is `position` itself).
inline int64_t first_key(const PrefillProblem& p, int64_t position) {
  return p.window > 0 ? std::max<int64_t>(0, position - p.window + 1) : 0;
}

// One tile: rows [row0, row0 + R) of KV head `h` (row = query * group + head in group).
// Its scores cover key groups [g0, key_groups): from the group of the first key its first
// row sees to the group of the last key its last row sees.
template <int R>
void tile(const PrefillProblem& p, const Head& head, int64_t h, int64_t row0, Scratch& s) {
  const int64_t dim = p.dim, pairs = dim / 2, group = p.heads / p.kv_heads;
  const int64_t keys = p.offset + (row0 + R - 1) / group + 1;  // the most a row sees
  const int64_t g0 = first_key(p, p.offset + row0 / group) / kGroup;
  const int64_t key_groups = (keys + kGroup - 1) / kGroup, width = (key_groups - g0) * kGroup;
  const int64_t kp0 = g0 * kGroup / 2, key_pairs = (keys + 1) / 2 - kp0;  // from key 2 kp0
  s.q.resize(R * pairs);
  s.scores.resize(R * width);
  s.probs.resize(R * key_pairs);
  for (int r = 0; r < R; ++r) {
    const int64_t query = (row0 + r) / group, qh = h * group + (row0 + r) % group;
    const Bits* src = p.q + query * p.q_token_stride + qh * p.q_head_stride;
    std::memcpy(s.q.data() + r * pairs, src, pairs * sizeof(uint32_t));
  }
  __m512 acc[R][2];
  const __m512 scale = _mm512_set1_ps(p.scale);
  for (int64_t g = g0; g < key_groups; ++g) {
    dot_group<R>(s.q.data(), pairs, head.keys + g * pairs * 2, pairs, acc);
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < 2; ++b)
        _mm512_storeu_ps(s.scores.data() + r * width + (g - g0) * kGroup + b * kHalf,
                         _mm512_mul_ps(acc[r][b], scale));
  }
  float inv_sum[R];
  for (int r = 0; r < R; ++r) {
    const int64_t position = p.offset + (row0 + r) / group;
    const int64_t first = first_key(p, position) - g0 * kGroup, end = position + 1 - g0 * kGroup;
    float* row = s.scores.data() + r * width;  // key g0 * kGroup + i at row[i]
    inv_sum[r] = 1.f / softmax_numerators(row + first, end - first);
    std::fill(row, row + first, 0.f);  // before the window: weight 0
    std::fill(row + end, row + 2 * key_pairs, 0.f);
    Bits* out = reinterpret_cast<Bits*>(s.probs.data() + r * key_pairs);
    int64_t t = 0;
    for (; t + kHalf <= 2 * key_pairs; t += kHalf)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + t), bf16_bits(_mm512_loadu_ps(row + t)));
    for (; t < 2 * key_pairs; ++t) out[t] = c10::BFloat16(row[t]).x;
  }
  for (int64_t g = 0; g < dim / kGroup; ++g) {
    const __m512bh* values = head.values + (g * head.key_pairs + kp0) * 2;
    dot_group<R>(s.probs.data(), key_pairs, values, key_pairs, acc);
    for (int r = 0; r < R; ++r) {
      const int64_t query = (row0 + r) / group, qh = h * group + (row0 + r) % group;
      Bits* out = p.out + (query * p.heads + qh) * dim + g * kGroup;
      const __m512 inv = _mm512_set1_ps(inv_sum[r]);
      for (int b = 0; b < 2; ++b)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * kHalf),
                            bf16_bits(_mm512_mul_ps(acc[r][b], inv)));
    }
  }
}

void tile_rows(int64_t rows, const PrefillProblem& p, const Head& head,
               int64_t h, int64_t row0, Scratch& s) {
  switch (rows) {
#define TANDEM_TILE(R) \
  case R:              \
    return tile<R>(p, head, h, row0, s);
    TANDEM_TILE(1) TANDEM_TILE(2) TANDEM_TILE(3) TANDEM_TILE(4) TANDEM_TILE(5)
    TANDEM_TILE(6) TANDEM_TILE(7) TANDEM_TILE(8) TANDEM_TILE(9) TANDEM_TILE(10)
    TANDEM_TILE(11) TANDEM_TILE(12) TANDEM_TILE(13) TANDEM_TILE(14)
#undef TANDEM_TILE
    default:
      TORCH_CHECK(false, "prefill_attention: a tile of ", rows, " rows");
  }
}
#endif

// Every chunk's attention in two parallel regions: both of K and V packed per (chunk, KV
// head), then every tile of every chunk from one shared counter, the tiles that see the
// most keys first. A tile is the same rows of the same chunk however many chunks share
// the call, so each chunk's result is the one it gets alone.
void attend(const std::vector<PrefillProblem>& problems) {
#if TANDEM_HAS_BF16_PREFILL
  struct Sizes {
    int64_t keys, k_size, v_size, first;  // first: the chunk's packed heads' offset
  };
  std::vector<Sizes> sizes;
  std::vector<int64_t> first_pack{0};  // chunk c's packing tasks: [first_pack[c], [c + 1])
  int64_t total = 0;
  for (const PrefillProblem& p : problems) {
    const int64_t keys = p.offset + p.queries;
    const int64_t k_size = (keys + kGroup - 1) / kGroup * kGroup * p.dim;
    const int64_t v_size = (keys + 1) / 2 * 2 * p.dim;
    sizes.push_back({keys, k_size, v_size, total});
    total += p.kv_heads * (k_size + v_size);
    first_pack.push_back(first_pack.back() + p.kv_heads * 2);
  }
  // Both packed per KV head once, read by every tile of its chunk's queries.
  std::vector<Bits> packed(total);
  const auto packed_head = [&](size_t c, int64_t h) {
    return packed.data() + sizes[c].first + h * (sizes[c].k_size + sizes[c].v_size);
  };
  at::parallel_for(0, first_pack.back(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const size_t c = std::upper_bound(first_pack.begin(), first_pack.end(), task) -
                       first_pack.begin() - 1;
      const PrefillProblem& p = problems[c];
      const int64_t local = task - first_pack[c], h = local / 2;
      Bits* k_out = packed_head(c, h);
      if (local % 2 == 0)
        pack_keys(p.k + h * p.k_head_stride, p.k_token_stride, sizes[c].keys, p.dim, k_out);
      else
        pack_values(p.v + h * p.v_head_stride, p.v_token_stride, sizes[c].keys, p.dim,
                    k_out + sizes[c].k_size);
    }
  });
  struct Task {
    int64_t keys, chunk, row0, h;  // keys: the most its rows see, its cost's measure
  };
  std::vector<Task> tasks;
  for (size_t c = 0; c < problems.size(); ++c) {
    const PrefillProblem& p = problems[c];
    const int64_t group = p.heads / p.kv_heads, rows = p.queries * group;
    for (int64_t row0 = 0; row0 < rows; row0 += kTileRows)
      for (int64_t h = 0; h < p.kv_heads; ++h) {
        const int64_t last = std::min(rows, row0 + kTileRows) - 1;
        const int64_t seen = p.offset + last / group + 1 - first_key(p, p.offset + row0 / group);
        tasks.push_back({seen, static_cast<int64_t>(c), row0, h});
      }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.keys > b.keys; });
  std::atomic<int64_t> next{0};
  const int64_t count = static_cast<int64_t>(tasks.size());
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch scratch;  // every task this thread takes, whatever range it was handed
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < count;) {
      const Task& t = tasks[i];
      const PrefillProblem& p = problems[t.chunk];
      const Bits* base = packed_head(t.chunk, t.h);
      const Head head{reinterpret_cast<const __m512bh*>(base),
                      reinterpret_cast<const __m512bh*>(base + sizes[t.chunk].k_size),
                      (sizes[t.chunk].keys + 1) / 2};
      const int64_t rows = p.queries * (p.heads / p.kv_heads);
      tile_rows(std::min(kTileRows, rows - t.row0), p, head, t.h, t.row0, scratch);
    }
  });
#else
  (void)problems;
#endif
}

}  // namespace

bool has_bf16_prefill_attention() { return TANDEM_HAS_BF16_PREFILL != 0; }

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             int64_t offset, double scale, int64_t window) {
  TORCH_CHECK(has_bf16_prefill_attention(), "prefill_attention: this build has no AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "prefill_attention: q [queries, heads, dim], k and v [kv_heads, keys, dim]");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->device().is_cpu() && t->stride(2) == 1,
                "prefill_attention: CPU bfloat16 tensors, each row's dims contiguous");
  const int64_t queries = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(0);
  TORCH_CHECK(k.sizes() == v.sizes(), "prefill_attention: k and v must match in shape");
  TORCH_CHECK(k.size(2) == dim && dim % 32 == 0, "prefill_attention: head dim a multiple of 32");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "prefill_attention: heads by KV head");
  TORCH_CHECK(offset >= 0 && k.size(1) == offset + queries,
              "prefill_attention: keys must be the offset's and the queries' own");
  TORCH_CHECK(window >= 0, "prefill_attention: window must be 0 (none) or positive");
  at::Tensor out = at::empty({queries, heads, dim}, q.options());
  if (queries == 0) return out;
  const auto bits = [](const at::Tensor& t) {
    return reinterpret_cast<const Bits*>(t.data_ptr<at::BFloat16>());
  };
  const PrefillProblem p{bits(q), bits(k), bits(v),
                         reinterpret_cast<Bits*>(out.data_ptr<at::BFloat16>()),
                         queries, offset, heads, kv_heads, dim, window,
                         q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                         v.stride(0), v.stride(1), static_cast<float>(scale)};
  attend({p});
  return out;
}

void prefill_attention_chunks_(at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const std::vector<int64_t>& starts,
                               const std::vector<int64_t>& ends, double scale,
                               int64_t window) {
  TORCH_CHECK(has_bf16_prefill_attention(),
              "prefill_attention_chunks_: this build has no AVX512-BF16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3,
              "prefill_attention_chunks_: out and q [tokens, heads, dim], k and v [tokens, "
              "kv_heads, dim]");
  const at::Tensor& written = out;
  for (const at::Tensor* t : {&written, &q, &k, &v})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->device().is_cpu() && t->stride(2) == 1,
                "prefill_attention_chunks_: CPU bfloat16 tensors, each row's dims contiguous");
  const int64_t tokens = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(1);
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(),
              "prefill_attention_chunks_: out must be contiguous and shaped like q");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == tokens && k.size(2) == dim,
              "prefill_attention_chunks_: k and v must be q's tokens' [tokens, kv_heads, dim]");
  TORCH_CHECK(dim % 32 == 0, "prefill_attention_chunks_: head dim a multiple of 32");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0,
              "prefill_attention_chunks_: heads by KV head");
  TORCH_CHECK(window >= 0, "prefill_attention_chunks_: window must be 0 (none) or positive");
  TORCH_CHECK(starts.size() == ends.size(), "prefill_attention_chunks_: a start and an end a chunk");
  const auto bits = [](const at::Tensor& t) {
    return reinterpret_cast<const Bits*>(t.data_ptr<at::BFloat16>());
  };
  Bits* out_rows = reinterpret_cast<Bits*>(out.data_ptr<at::BFloat16>());
  std::vector<PrefillProblem> problems;
  for (size_t c = 0; c < starts.size(); ++c) {
    const int64_t first = starts[c], last = ends[c];
    TORCH_CHECK(0 <= first && first < last && last <= tokens,
                "prefill_attention_chunks_: chunk ", c, " is tokens [", first, ", ", last,
                ") of ", tokens);
    problems.push_back({bits(q) + first * q.stride(0), bits(k) + first * k.stride(0),
                        bits(v) + first * v.stride(0), out_rows + first * heads * dim,
                        last - first, 0, heads, kv_heads, dim, window,
                        q.stride(0), q.stride(1), k.stride(1), k.stride(0),
                        v.stride(1), v.stride(0), static_cast<float>(scale)});
  }
  if (!problems.empty()) attend(problems);
}
