// bfloat16 projections past the GEMV's rows on AVX512-BF16 CPUs without AMX: y = x W^T (+ b).
//
// At 32 rows a projection is compute-bound (32 FLOP per weight byte), and oneDNN's
// prepacked matmul reaches ~0.27 TFLOP/s over SmolLM2's projections on an AMD EPYC
// whose large GEMMs reach 0.44 (bench.floor); this kernel reaches ~0.36-0.39 there, and
// 0.38-0.39 on prefills of 128-1,024 rows, where oneDNN's reach 0.30-0.38. It keeps the
// weight in the layout VDPBF16PS wants as its right operand, 16 outputs x 2 inputs a
// vector, and broadcasts a pair of x's bfloat16 inputs at a time into every lane, so
// there is no horizontal sum and no repack of x:
//
//   packed[g][kp][b][16][2] = W[16 (2 g + b) + i][2 kp + j]   (zero past out/in)
//
// Groups g of two 16-output blocks (the last may hold one) lie one after another,
// each group's K pairs in order, so a thread reads every group as one ascending stream
// (several streams a row apart read slower on AMD: gemv.cpp). A tile is up to 14 rows x
// 32 outputs: 28 float32 accumulators in registers, 2 weight vectors and 14 broadcasts
// per K pair for 28 products. A group (32 x in x 2 bytes: 36 KiB at in = 576) is read
// from memory by the first tile and from cache by the others, and those later passes
// are what a tile's height saves: the rows are split into as few tiles as fit, the first
// as tall as can be (group_rows). Against 10-row tiles and a short last one (32 rows:
// 10 + 10 + 10 + 2), tiles of even heights took 12-15% off 12-14, 24-40 and 64 rows and
// 7% off 128 on a Zen 5 (bench.gemv's projections); the tallest first took another 9% off
// 16 rows, 4-6% off 24-32 and 1-3% off 40-64. Of the other tiles tried (8 x 48, 9 x 48,
// and 16 outputs by up to 28 rows, which read each group in halves) none was faster.
//
// While a group's tiles compute, they fetch the thread's next group into L2, its lines
// spread evenly over every tile's K pairs; a thread's last group fetches its first group of
// the projection the caller runs next (Bf16GemmNext), which would otherwise start from
// memory. Against fetching the next group in the first tile alone and nothing of the next
// projection, a 32-row SmolLM2 step's projections took 7.08-8.11 ms instead of 8.26-8.45
// (bench.step_profile, builds alternated), and 32 clients 3-5% more tokens a second (the
// medians of two 5-round bench.paired runs; docs/benchmarks.md). Below kFetchFromRows rows
// nothing is fetched: a tile of a few rows computes no longer than its group takes to
// arrive, the one ascending stream the hardware prefetchers follow is as fast as the
// memory, and the software fetches only compete with it.
//
// Every sum is float32, in K order, and rounded once to bfloat16 after the bias, as the
// GEMV does; an output depends only on its own row of x, never on how many rows the call
// has. Where the CPU has AVX2 and FMA but no AVX512-BF16, the same layout goes to
// bf16_gemm_avx2.h's tiles, which give the same sums; below AVX2 has_bf16_gemm() is
// false and oneDNN (or nn.Linear) keeps those rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "kernels.h"
#include "parallel.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TANDEM_BF16_GEMM_AVX512 1
#define TANDEM_BF16_GEMM_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__)
#include "bf16_gemm_avx2.h"
#define TANDEM_BF16_GEMM_AVX512 0
#define TANDEM_BF16_GEMM_AVX2 1
#else
#define TANDEM_BF16_GEMM_AVX512 0
#define TANDEM_BF16_GEMM_AVX2 0
#endif
#define TANDEM_HAS_BF16_GEMM (TANDEM_BF16_GEMM_AVX512 || TANDEM_BF16_GEMM_AVX2)

namespace {

constexpr int64_t kBlock = 16;          // outputs per vector
constexpr int64_t kGroupBlocks = 2;     // blocks per group: 32 outputs a tile
constexpr int64_t kTileRows = 14;       // rows of x per tile, at most
// The fewest rows at which fetching the next group (and projection) ahead pays. On a Zen 4
// (bench.forward's decode step, fetching on and off alternated in one process), without
// the fetches 1 row took 0.93x the time, 2 rows 0.92-0.95x, 4 rows 0.86x, 5 rows 0.94x;
// 6 rows 0.97-1.05x, 7 rows 1.04-1.09x, 8 rows 1.09x, 32 rows 1.03x (docs/benchmarks.md).
constexpr int64_t kFetchFromRows = TANDEM_BF16_GEMM_AVX2 ? 1 : 6;
static_assert(kTileRows <= 14, "tile_rows has a tile for each height up to 14, the most registers hold");

constexpr const char* kNoGemm = "bf16_gemm: this build has no bf16 GEMM (AVX512-BF16, or AVX2 and FMA)";

int64_t padded_pairs(int64_t in_features) { return (in_features + 1) / 2; }
int64_t blocks_of(int64_t out_features) { return (out_features + kBlock - 1) / kBlock; }

#if TANDEM_HAS_BF16_GEMM
// Cache lines [first, first + lines) of weights a later tile reads, fetched into L2 while
// this tile computes.
struct Ahead {
  const char* first = nullptr;
  int64_t lines = 0;

  // Share `part` of `parts`, as even as whole lines allow.
  Ahead share(int64_t part, int64_t parts) const {
    const int64_t begin = lines * part / parts, end = lines * (part + 1) / parts;
    return {first + 64 * begin, end - begin};
  }
};

// Group g of a packed weight of `blocks` 16-output blocks and `pairs` K pairs: its lines
// (a block's K pair, 16 pairs of bfloat16, is one line).
Ahead group_lines(const uint16_t* packed, int64_t blocks, int64_t pairs, int64_t g) {
  const int64_t first_block = g * kGroupBlocks;
  return {reinterpret_cast<const char*>(packed) + 64 * first_block * pairs,
          std::min(kGroupBlocks, blocks - first_block) * pairs};
}
#endif

#if TANDEM_BF16_GEMM_AVX512
// A bfloat16 is a float's top half: 16 of them widened to floats (masked lanes zero).
inline __m512 load_bf16(const uint16_t* p, __mmask16 mask) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// y[r][out0 + 16 b + i] for r < R, b < B (x and y start at the tile's first row): one
// tile over every K pair of x's rows (pairs each) and the group's weights w.
template <int R, int B>
void tile(const uint32_t* x, int64_t pairs, const __m512bh* w, const uint16_t* bias,
          int64_t out0, int64_t out_features, uint16_t* y, Ahead ahead) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  // ahead.lines / pairs lines a K pair, the remainder carried (no division in the loop).
  const char* line = ahead.first;
  int64_t owed = 0;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    __m512bh wv[B];
    for (owed += ahead.lines; owed >= pairs; owed -= pairs, line += 64)
      _mm_prefetch(line, _MM_HINT_T1);
    for (int b = 0; b < B; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(w + kp * B + b);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[r * pairs + kp]);
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
    }
  }
  for (int b = 0; b < B; ++b) {
    const int64_t first = out0 + b * kBlock;
    const int64_t valid = std::min<int64_t>(kBlock, out_features - first);
    const __mmask16 mask = valid >= kBlock ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    const __m512 add = bias ? load_bf16(bias + first, mask) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][b], add));
      _mm256_mask_storeu_epi16(y + r * out_features + first, mask, (__m256i)out);
    }
  }
}

// One tile of `height` rows (1 to kTileRows): the height is a template argument, so
// a switch picks the instance.
template <int B>
void tile_rows(int64_t height, const uint32_t* x, int64_t pairs, const __m512bh* w,
               const uint16_t* bias, int64_t out0, int64_t out_features, uint16_t* y,
               Ahead ahead) {
  switch (height) {
#define TANDEM_TILE(R)                                                 \
  case R:                                                              \
    return tile<R, B>(x, pairs, w, bias, out0, out_features, y, ahead);
    TANDEM_TILE(1) TANDEM_TILE(2) TANDEM_TILE(3) TANDEM_TILE(4) TANDEM_TILE(5)
    TANDEM_TILE(6) TANDEM_TILE(7) TANDEM_TILE(8) TANDEM_TILE(9) TANDEM_TILE(10)
    TANDEM_TILE(11) TANDEM_TILE(12) TANDEM_TILE(13) TANDEM_TILE(14)
#undef TANDEM_TILE
    default:
      TORCH_CHECK(false, "bf16_gemm: a tile of ", height, " rows");
  }
}

// Every row of x against one group, in as few tiles as kTileRows allows. Each tile
// reads the group again, so the count of tiles is what costs; the first reads it from
// memory, which takes about as long as its sums however many rows it has, so it takes the
// most rows and the others share the rest evenly (32 rows: 14, 9, 9). The lines `ahead`
// are shared between the tiles: fetched in the first alone (its K pairs are a third of the
// group's time, and the memory then serves both threads' fetches at once), a step's
// projections took 2-4% longer.
template <int B>
void group_rows(const uint32_t* x, int64_t rows, int64_t pairs, const __m512bh* w,
                const uint16_t* bias, int64_t out0, int64_t out_features, uint16_t* y,
                Ahead ahead) {
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  if (tiles == 1) return tile_rows<B>(rows, x, pairs, w, bias, out0, out_features, y, ahead);
  tile_rows<B>(kTileRows, x, pairs, w, bias, out0, out_features, y, ahead.share(0, tiles));
  const int64_t rest = rows - kTileRows, others = tiles - 1;
  const int64_t base = rest / others, longer = rest % others;  // the first `longer` get one more
  for (int64_t t = 0, r = kTileRows; t < others; r += base + (t < longer), ++t)
    tile_rows<B>(base + (t < longer), x + r * pairs, pairs, w, bias, out0, out_features,
                 y + r * out_features, ahead.share(t + 1, tiles));
}

#endif

#if TANDEM_HAS_BF16_GEMM
// x's rows as a path's tiles read them: the bfloat16 pairs themselves (AVX512-BF16), or
// widened to float32 once a call (AVX2), in a buffer of the calling thread's.
struct Rows {
  const uint32_t* pairs = nullptr;
  const float* floats = nullptr;
};

Rows rows_of(const uint16_t* x, int64_t count) {
#if TANDEM_BF16_GEMM_AVX2
  thread_local std::vector<float> wide;
  if (static_cast<int64_t>(wide.size()) < count) wide.resize(count);
  tandem::bf16_gemm_avx2::widen_rows(x, count, wide.data());
  return {nullptr, wide.data()};
#else
  (void)count;
  return {reinterpret_cast<const uint32_t*>(x), nullptr};
#endif
}

// Every row of x against one group of `group` blocks (1 or 2) starting at output out0.
void run_group(const Rows& x, int64_t rows, int64_t pairs, const uint16_t* group_weights,
               int64_t group, const uint16_t* bias, int64_t out0, int64_t out_features,
               uint16_t* y, Ahead ahead) {
#if TANDEM_BF16_GEMM_AVX512
  static_assert(kGroupBlocks == 2, "a group holds 2 blocks, the last one 1 or 2");
  const __m512bh* w = reinterpret_cast<const __m512bh*>(group_weights);
  if (group == 2)
    group_rows<2>(x.pairs, rows, pairs, w, bias, out0, out_features, y, ahead);
  else
    group_rows<1>(x.pairs, rows, pairs, w, bias, out0, out_features, y, ahead);
#else
  tandem::bf16_gemm_avx2::group_rows(x.floats, rows, pairs,
                                     reinterpret_cast<const uint32_t*>(group_weights), group,
                                     bias, out0, out_features, y, ahead.first, ahead.lines);
#endif
}
#endif

}  // namespace

bool has_bf16_gemm() { return TANDEM_HAS_BF16_GEMM != 0; }

// On AMX CPUs oneDNN's packed matmul computes prefills on the tiles and amx_linear takes
// decode batches; elsewhere this kernel beat oneDNN at every row count measured, 2 to 1,024
// (bench.gemv; docs/benchmarks.md), so it takes every batch past the GEMV's rows. Its AVX2
// tiles pack only on a CPU without AVX512-BF16: where a portable build (the image's
// x86-64-v3) runs on one that has it, oneDNN computes in bfloat16 there (on AMX tiles, or
// VDPBF16PS) and keeps the rows it kept before the AVX2 tiles existed.
bool bf16_gemm_packs() {
  if (!has_bf16_gemm() || has_amx_linear()) return false;
#if TANDEM_BF16_GEMM_AVX2
  return !__builtin_cpu_supports("avx512bf16");
#else
  return true;
#endif
}

int64_t bf16_gemm_group_outputs() { return kBlock * kGroupBlocks; }

void bf16_gemm_pack_group(const uint16_t* rows, int64_t count, int64_t in_features,
                          uint16_t* group) {
  const int64_t blocks = blocks_of(count), whole = in_features / 2;
  const int64_t pairs = padded_pairs(in_features);
  uint32_t* dst = reinterpret_cast<uint32_t*>(group);  // a pair of bfloat16 each
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t valid = std::min(kBlock, count - b * kBlock);
    const uint16_t* first = rows + b * kBlock * in_features;
#if TANDEM_BF16_GEMM_AVX512
    // Lane i gathers row i's pair kp: a 16 x (in / 2) transpose of 32-bit pairs, one
    // gather a vector (the rows of a group are in L1 or L2: they were just written).
    const __mmask16 mask = valid >= kBlock ? __mmask16(0xFFFF) : __mmask16((1u << valid) - 1);
    const __m512i offsets = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32(static_cast<int>(in_features)));
    for (int64_t kp = 0; kp < whole; ++kp)
      _mm512_storeu_si512(dst + (kp * blocks + b) * kBlock,
                          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, offsets,
                                                      first + 2 * kp, 2));
#else
    for (int64_t kp = 0; kp < whole; ++kp)
      for (int64_t i = 0; i < kBlock; ++i) {
        uint32_t pair = 0;
        if (i < valid) std::memcpy(&pair, first + i * in_features + 2 * kp, sizeof pair);
        dst[(kp * blocks + b) * kBlock + i] = pair;
      }
#endif
    // An odd in: the last pair's input alone, beside a zero (little-endian: the low half).
    for (int64_t kp = whole; kp < pairs; ++kp)
      for (int64_t i = 0; i < kBlock; ++i)
        dst[(kp * blocks + b) * kBlock + i] = i < valid ? first[i * in_features + 2 * kp] : 0u;
  }
}

at::Tensor bf16_gemm_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 &&
                  weight.device().is_cpu(),
              "bf16_gemm_pack: weight must be a CPU bfloat16 [out, in]");
  TORCH_CHECK(weight.size(0) > 0 && weight.size(1) > 0, "bf16_gemm_pack: an empty weight");
  const int64_t out = weight.size(0), in = weight.size(1);
  const int64_t blocks = blocks_of(out), pairs = padded_pairs(in);
  // Shaped [out, ceil(size / out)] (a few zeros past the layout) so that it carries out;
  // bf16_gemm_pack_group writes the zeros past out and past an odd in.
  const int64_t size = blocks * kBlock * 2 * pairs;
  at::Tensor packed = at::zeros({out, (size + out - 1) / out}, weight.options());
  const at::Tensor w = weight.contiguous();
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t outputs = bf16_gemm_group_outputs();
  const int64_t groups = (out + outputs - 1) / outputs;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)  // a group: its 32 outputs x pairs x 2 inputs
      bf16_gemm_pack_group(src + g * outputs * in, std::min(outputs, out - g * outputs), in,
                           dst + g * outputs * 2 * pairs);
  });
  return packed;
}

bool bf16_gemm_holds(const at::Tensor& packed, int64_t out_features, int64_t in_features) {
  const int64_t size = blocks_of(out_features) * kBlock * 2 * padded_pairs(in_features);
  return packed.dim() == 2 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
         packed.device().is_cpu() && packed.size(0) == out_features &&
         packed.numel() - size >= 0 && packed.numel() - size < out_features;
}

void bf16_gemm_rows(const uint16_t* x, const uint16_t* packed, const uint16_t* bias,
                    uint16_t* y, int64_t rows, int64_t out_features, int64_t in_features,
                    const Bf16GemmNext* then) {
  TORCH_CHECK(has_bf16_gemm(), kNoGemm);
  TORCH_CHECK(in_features % 2 == 0, "bf16_gemm_rows: x's rows must be whole pairs");
#if TANDEM_HAS_BF16_GEMM
  const int64_t blocks = blocks_of(out_features), pairs = in_features / 2;
  const int64_t groups = (blocks + kGroupBlocks - 1) / kGroupBlocks;
  const Rows xr = rows_of(x, rows * in_features);
  // The first group `thread` will take of `then`: its starting share's first, as
  // parallel_steal splits that call.
  const auto then_first = [&](int64_t thread) -> Ahead {
    if (then == nullptr) return {};
    const int64_t then_blocks = blocks_of(then->out_features);
    const int64_t then_groups = (then_blocks + kGroupBlocks - 1) / kGroupBlocks;
    const int64_t threads = tandem::steal_threads(then_groups);
    if (thread >= threads) return {};
    return group_lines(then->packed, then_blocks, padded_pairs(then->in_features),
                       tandem::share_begin(thread, then_groups, threads));
  };
  tandem::parallel_steal(groups, [&](int64_t g, int64_t following) {
    const int64_t first_block = g * kGroupBlocks;
    // What this thread computes next: a group of this weight, or, after its last, its first
    // of the next projection; nothing for a few rows (kFetchFromRows).
    const Ahead ahead = rows < kFetchFromRows ? Ahead{}
                        : following >= 0      ? group_lines(packed, blocks, pairs, following)
                                              : then_first(at::get_thread_num());
    run_group(xr, rows, pairs, packed + 2 * kBlock * first_block * pairs,
              std::min(kGroupBlocks, blocks - first_block), bias, first_block * kBlock,
              out_features, y, ahead);
  });
#else
  (void)x, (void)packed, (void)bias, (void)y, (void)rows, (void)out_features, (void)then;
#endif
}

void bf16_gemm_group(const uint16_t* x, int64_t rows, int64_t in_features, const uint16_t* group,
                     const uint16_t* bias, int64_t out0, int64_t out_features, uint16_t* y) {
  TORCH_CHECK(has_bf16_gemm(), kNoGemm);
  TORCH_CHECK(in_features % 2 == 0 && out0 % bf16_gemm_group_outputs() == 0 && out0 < out_features,
              "bf16_gemm_group: whole pairs of x, a group's first output");
#if TANDEM_HAS_BF16_GEMM
  run_group(rows_of(x, rows * in_features), rows, in_features / 2, group,
            out_features - out0 > kBlock ? 2 : 1, bias, out0, out_features, y, Ahead{});
#else
  (void)x, (void)rows, (void)group, (void)bias, (void)y;
#endif
}

at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& packed,
                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(has_bf16_gemm(), kNoGemm);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "bf16_gemm: x must be a CPU bfloat16 [rows, in]");
  const int64_t rows = x.size(0), in = x.size(1);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && packed.device().is_cpu(),
              "bf16_gemm: packed must come from bf16_gemm_pack");
  const int64_t out_features = packed.size(0);
  TORCH_CHECK(bf16_gemm_holds(packed, out_features, in),
              "bf16_gemm: packed weight does not hold [", out_features, ", ", in, "]");
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features &&
                    bias->scalar_type() == at::kBFloat16 && bias->is_contiguous(),
                "bf16_gemm: bias must be [", out_features, "] contiguous bfloat16");
  at::Tensor y = at::empty({rows, out_features}, x.options());
  if (rows == 0) return y;
  // An odd in: x's last pair needs a zero partner, which the packed weight already has
  // (a zero times anything finite adds nothing), so copy x into whole pairs.
  at::Tensor xp = in % 2 == 0 ? x.contiguous() : at::constant_pad_nd(x, {0, 1}, 0);
  const uint16_t* b =
      bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>()) : nullptr;
  bf16_gemm_rows(reinterpret_cast<const uint16_t*>(xp.data_ptr<at::BFloat16>()),
                 reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), b,
                 reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), rows, out_features,
                 xp.size(1));
  return y;
}
