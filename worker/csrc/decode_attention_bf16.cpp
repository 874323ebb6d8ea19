// Paged decode attention over a bfloat16 cache with AVX512-BF16: the shapes we serve
// (head size 64, 128 or 256, at most 4 query heads per KV head); decode_attention.cpp
// takes the others. One task is one (sequence, KV head) pair, as there, or a part of its
// context where that is long (below: part_tokens).
//
// Nothing is converted on the way in. Keys are dotted with the query where they lie
// (VDPBF16PS: bfloat16 pairs multiplied exactly, summed in float32), 16 tokens a tile,
// reduced by one transpose-add tree. A bfloat16 value is a float's top half, so 32 values
// loaded at once, shifted up (the even ones) or masked (the odd ones), are 32 floats in
// two registers; every head's sums for 64 dims stay in registers across the whole context
// and are put back in order once, at the end. Against the tile-converting kernel this
// takes a third less time at 32 sequences of 128-256 tokens (docs/benchmarks.md).
//
// The keys and values come from memory (a step reads every layer's cache once, more than
// the L3 holds), so a task waits for its rows, then computes on them. While it computes,
// the rows of the task its thread runs next are prefetched, a few lines a step (NextRows):
// the memory then works through the computing instead of after it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "attention_problem.h"
#include "parallel.h"
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
// (Prefetching within a task's own rows does nothing the demand loads do not; prefetching
// the next task's during this one's computing, NextRows, does.)
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

// The tokens [begin, end) of KV head g of sequence seq that one task attends to.
struct TaskSpan {
  int64_t seq, g, begin, end;
};

// Bytes [first, last) of the cache: one block's rows of one KV head.
struct Run {
  const char* first;
  const char* last;
};

// The rows (keys, then values) of the task this thread runs next, prefetched while it runs
// this one: plan() lists them as runs and spreads their lines over this task's `steps`
// (its key tiles and value rows), issue() prefetches one step's share. A decode step reads
// every layer's cache from memory; a task's own read_ahead waits for its rows, and without
// these the memory idles while the task computes. Measured on a 2-core Zen 5, 30 layers,
// on and off alternated in one process: 32 sequences of ~96 tokens 0.70x the time, of ~160
// 0.86x, of ~600 0.96x; one of 3,000 0.87x; a 32-row SmolLM2 step 2% shorter.
// The lines go to L2 (hint T1), not L1: a task's rows (37 KiB at SmolLM2's 146 tokens)
// outgrow L1. On a 2-core Zen 4, against none at all, prefetches into L1 saved little
// (none: 0.98-1.04x the time at 8-32 x 146-600 tokens, 1.09-1.18x at 32 x 60 and one of
// 3,000); into L2 they take 0.75x the time at 32 x 146 and 32 x 600, 0.73x at one of
// 3,000, 0.86-0.89x at 8 x 146 and 32 x 60, level at one of 146; a 32-row step 0.95x
// (docs/benchmarks.md). The Zen 5's figures above were measured with T0.
class NextRows {
 public:
  void plan(const Problem<Bf16>& p, const TaskSpan& next, int64_t steps) {
    runs_.clear();
    const int64_t* blocks = p.table + next.seq * p.max_blocks;
    int64_t lines = 0;
    for (const Bf16* cache : {p.k, p.v})
      for (int64_t t = next.begin; t < next.end;) {
        const int64_t block = t / p.block_size, offset = t % p.block_size;
        const int64_t rows = std::min(next.end - t, p.block_size - offset);
        const char* first = reinterpret_cast<const char*>(cache + p.at(blocks[block], next.g, offset));
        const int64_t bytes = rows * p.dim * 2;
        runs_.push_back({first, first + bytes});
        lines += (bytes + 63) / 64;
        t += rows;
      }
    per_step_ = (lines + steps - 1) / std::max<int64_t>(1, steps);
  }

  void clear() { runs_.clear(); }

  // Walks the runs a step's share of lines at a time. The position is the caller's, in
  // registers through the computing loops, where a member written every step would be
  // stored to memory that the compiler must then assume the loops' other reads alias.
  class Cursor {
   public:
    explicit Cursor(const NextRows& rows)
        : run_(rows.runs_.data()), end_(rows.runs_.data() + rows.runs_.size()),
          line_(rows.runs_.empty() ? nullptr : rows.runs_[0].first), per_step_(rows.per_step_) {}

    void issue() {
      for (int64_t n = 0; n < per_step_ && run_ < end_; ++n) {
        _mm_prefetch(line_, _MM_HINT_T1);
        line_ += 64;
        if (line_ >= run_->last && ++run_ < end_) line_ = run_->first;
      }
    }

   private:
    const Run* run_;
    const Run* end_;
    const char* line_;
    int64_t per_step_;
  };

 private:
  std::vector<Run> runs_;
  int64_t per_step_ = 0;
};

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

// What one part of a sequence's context gives its G query heads: the max of their scores,
// the sum of exp(score - max), and the values weighted by those numerators, not yet divided
// by the sum: per head, per 64 dims, the even and odd lanes of the first 32 and of the next.
template <int G, int D>
struct PartSums {
  float top[G];
  float total[G];
  __m512 values[G][2 * D];
};

// Steps of attend_part over `span` tokens, each issuing a share of the next task's rows:
// its key tiles and its first value pass's rows.
inline int64_t part_steps(int64_t span) { return (span + kTile - 1) / kTile + span; }

// The G query heads of KV head g of one sequence against tokens [t_begin, t_end) of its
// context; head size D * 32 (a constant: the tile's 16 x D products unroll, and their sums
// stay in registers).
template <int G, int D>
void attend_part(const Problem<Bf16>& p, const TaskSpan& task, std::vector<float>& scores,
                 PartSums<G, D>& sums, const NextRows& next) {
  const int64_t seq = task.seq, g = task.g, t_begin = task.begin, t_end = task.end;
  NextRows::Cursor next_rows(next);
  const int64_t span = t_end - t_begin;
  const int64_t* blocks = p.table + seq * p.max_blocks;
  scores.resize(G * span);
  __m512bh query[G][D];
  for (int h = 0; h < G; ++h)
    for (int c = 0; c < D; ++c) query[h][c] = pairs(p.q + (seq * p.heads + g * G + h) * p.dim + 32 * c);
  const __m512 scale = _mm512_set1_ps(p.scale);
  // Scores: q . k for every key, 16 tokens a tile.
  const Bf16* rows[kTile];
  const int64_t ahead = std::max(kTile, kAheadBytes / (p.dim * 2) / kTile * kTile);
  for (int64_t t0 = t_begin; t0 < t_end; t0 += kTile) {
    const int64_t count = std::min(kTile, t_end - t0);
    if ((t0 - t_begin) % ahead == 0) read_ahead(p, p.k, blocks, g, t0, std::min(t_end, t0 + ahead));
    int64_t block = t0 / p.block_size, offset = t0 % p.block_size;
    for (int64_t i = 0; i < count; ++i) {
      rows[i] = p.k + p.at(blocks[block], g, offset);
      if (++offset == p.block_size) offset = 0, ++block;
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << count) - 1);
    next_rows.issue();
    for (int h = 0; h < G; ++h) {
      __m512 dots[kTile];
      for (int64_t i = 0; i < kTile; ++i) {
        dots[i] = _mm512_setzero_ps();
        if (i < count)
          for (int c = 0; c < D; ++c)
            dots[i] = _mm512_dpbf16_ps(dots[i], query[h][c], pairs(rows[i] + 32 * c));
      }
      _mm512_mask_storeu_ps(scores.data() + h * span + (t0 - t_begin), keep,
                            _mm512_mul_ps(transpose_sum(dots), scale));
    }
  }
  for (int h = 0; h < G; ++h)
    sums.total[h] = tandem::softmax_numerators(scores.data() + h * span, span, &sums.top[h]);
  // Values: 64 dims a pass over the context, every head's sums in registers throughout.
  const __m512i high = _mm512_set1_epi32(~0xFFFF);
  for (int64_t c0 = 0; c0 < D * 32; c0 += kChunk) {
    __m512 acc[G][4];  // per head: dims c0 .. c0 + 32 even, odd; c0 + 32 .. c0 + 64 even, odd
    for (int h = 0; h < G; ++h)
      for (int w = 0; w < 4; ++w) acc[h][w] = _mm512_setzero_ps();
    int64_t block = t_begin / p.block_size, offset = t_begin % p.block_size;
    for (int64_t t = t_begin; t < t_end; ++t) {
      if (c0 == 0 && (t - t_begin) % ahead == 0)  // whole rows: later passes too
        read_ahead(p, p.v, blocks, g, t, std::min(t_end, t + ahead));
      if (c0 == 0) next_rows.issue();
      const Bf16* src = p.v + p.at(blocks[block], g, offset) + c0;
      if (++offset == p.block_size) offset = 0, ++block;
      const __m512i lo = _mm512_loadu_si512(src), hi = _mm512_loadu_si512(src + 32);
      const __m512 v[4] = {_mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)),
                           _mm512_castsi512_ps(_mm512_and_si512(lo, high)),
                           _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)),
                           _mm512_castsi512_ps(_mm512_and_si512(hi, high))};
      for (int h = 0; h < G; ++h) {
        const __m512 weight = _mm512_set1_ps(scores[h * span + (t - t_begin)]);
        for (int w = 0; w < 4; ++w) acc[h][w] = _mm512_fmadd_ps(weight, v[w], acc[h][w]);
      }
    }
    for (int h = 0; h < G; ++h)
      for (int w = 0; w < 4; ++w) sums.values[h][c0 / 16 + w] = acc[h][w];
  }
}

// out := the G heads' attention: their value sums divided by their totals.
template <int G, int D>
void store_heads(const Problem<Bf16>& p, int64_t seq, int64_t g, const PartSums<G, D>& sums) {
  Bf16* out = p.out + (seq * p.heads + g * G) * p.dim;
  for (int h = 0; h < G; ++h) {
    const __m512 norm = _mm512_set1_ps(1.f / sums.total[h]);
    for (int64_t c0 = 0; c0 < D * 32; c0 += kChunk) {
      const __m512* v = sums.values[h] + c0 / 16;
      store_pairs(out + h * p.dim + c0, v[0], v[1], norm);
      store_pairs(out + h * p.dim + c0 + 32, v[2], v[3], norm);
    }
  }
}

// Tokens of a context of `span` tokens that one task takes: a multiple of kPartTokens, at
// most kMaxParts tasks a context. One sequence alone has only as many tasks as KV heads (3
// for SmolLM2: 2 + 1 on two cores); split, one stream's attention at 2,000-8,000 tokens
// takes a fifth less time. Parts start on the grid the passes read ahead on (kPartTokens is
// a multiple of every head size's `ahead`), so the rows are read in the same runs, split or
// not. The split depends on the sequence alone, never on the batch, so a sequence's output
// is the same in any batch. Contexts up to kPartTokens stay one part, bit for bit what they
// were before there were parts.
constexpr int64_t kPartTokens = 512;
constexpr int64_t kMaxParts = 8;  // bounds the sums kept: 8 x 4 KiB per (sequence, KV head)

int64_t part_tokens(int64_t span) {
  const int64_t share = (span + kMaxParts - 1) / kMaxParts;
  return std::max(kPartTokens, (share + kPartTokens - 1) / kPartTokens * kPartTokens);
}

// Part sums merged, in part order: each rescaled to the largest max. Fills what
// store_heads reads, the totals and the values.
template <int G, int D>
void merge_parts(const PartSums<G, D>* parts, int64_t count, PartSums<G, D>& merged) {
  for (int h = 0; h < G; ++h) {
    float top = parts[0].top[h];
    for (int64_t i = 1; i < count; ++i) top = std::max(top, parts[i].top[h]);
    merged.total[h] = 0.f;
    for (int w = 0; w < 2 * D; ++w) merged.values[h][w] = _mm512_setzero_ps();
    for (int64_t i = 0; i < count; ++i) {
      const float weight = std::exp(parts[i].top[h] - top);
      merged.total[h] += weight * parts[i].total[h];
      const __m512 scale = _mm512_set1_ps(weight);
      for (int w = 0; w < 2 * D; ++w)
        merged.values[h][w] = _mm512_fmadd_ps(scale, parts[i].values[h][w], merged.values[h][w]);
    }
  }
}

template <int G, int D>
void attend_all(const Problem<Bf16>& p) {
  // One task per part of each (sequence, KV head): sequence s's from first_task[s], KV
  // head by KV head, each head's parts in order.
  std::vector<int64_t> first_task(p.n + 1, 0), parts(p.n), part_len(p.n);
  for (int64_t s = 0; s < p.n; ++s) {
    const int64_t span = p.lens[s] - p.first(s);
    part_len[s] = part_tokens(span);
    parts[s] = std::max<int64_t>(1, (span + part_len[s] - 1) / part_len[s]);
    first_task[s + 1] = first_task[s] + p.kv_heads * parts[s];
  }
  const int64_t tasks = first_task[p.n];
  // The parts' sums wait in `kept` (a buffer kept across calls, which all come from the
  // step's thread) until the task that finishes a head's last part, whichever thread runs
  // it, merges them in part order: the same result either way.
  static thread_local std::vector<PartSums<G, D>> buffer;
  std::unique_ptr<std::atomic<int64_t>[]> done;
  if (tasks > p.n * p.kv_heads) {
    if (buffer.size() < static_cast<size_t>(tasks)) buffer.resize(tasks);
    done.reset(new std::atomic<int64_t>[p.n * p.kv_heads]);
    for (int64_t k = 0; k < p.n * p.kv_heads; ++k) done[k].store(0, std::memory_order_relaxed);
  }
  PartSums<G, D>* const kept = buffer.data();  // the caller's, not each thread's own
  // The sequences' contexts differ, so equal shares of tasks are not equal shares of work:
  // a thread that finishes first takes the other's last tasks.
  const auto span_of = [&](int64_t task) {
    const int64_t seq =
        std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1;
    const int64_t local = task - first_task[seq];
    const int64_t begin = p.first(seq) + local % parts[seq] * part_len[seq];
    return TaskSpan{seq, local / parts[seq], begin, std::min(p.lens[seq], begin + part_len[seq])};
  };
  // `next`: the task this thread takes after this one (parallel_steal's guess), or -1.
  tandem::parallel_steal(tasks, [&](int64_t task, int64_t next) {
    static thread_local std::vector<float> scores;
    static thread_local NextRows next_rows;
    PartSums<G, D> merged;
    const TaskSpan span = span_of(task);
    const int64_t seq = span.seq, g = span.g;
    if (next >= 0)
      next_rows.plan(p, span_of(next), part_steps(span.end - span.begin));
    else
      next_rows.clear();
    if (parts[seq] == 1) {
      attend_part<G, D>(p, span, scores, merged, next_rows);
      store_heads<G, D>(p, seq, g, merged);
      return;
    }
    attend_part<G, D>(p, span, scores, kept[task], next_rows);
    if (done[seq * p.kv_heads + g].fetch_add(1, std::memory_order_acq_rel) + 1 < parts[seq])
      return;
    merge_parts<G, D>(kept + first_task[seq] + g * parts[seq], parts[seq], merged);
    store_heads<G, D>(p, seq, g, merged);
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
