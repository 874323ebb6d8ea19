// GGUF projections for many bfloat16 rows (a bfloat16 model's decode steps from
// gguf_gemm_min_rows on) on AVX512-BF16 CPUs: y = x W^T (+ b), float32 out, with the
// quants of every format repacked once, at load, into bf16_gemm's layout: the 32-weight
// formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) by their blocks, the K-quants by their sub-blocks
// (Q4_K and Q5_K: 32 weights with a scale and a min, as Q4_1 and Q5_1; Q6_K: 16 weights
// with a scale, two to a block of 32).
//
// Without it gguf_linear.cpp dequantizes each block to float32 and dots it with float32
// rows: two float FMAs per 32 products, ~2.4x a bfloat16 step's time at 32 rows, and the
// K-quants' scalar unpacking held their one-row steps to ~1.5-1.7 GB/s. Here, as
// in bf16_gemm.cpp, a vector holds 16 outputs x 2 inputs and VDPBF16PS takes a broadcast
// pair of x's bfloat16 inputs: 32 products an instruction. A quant is a small integer, so
// its bfloat16 is exact and so is every product (gguf_bf16_dot.cpp's argument); each lane
// sums one output's products over one block, then the block's scale (and min times the
// block's sum of x) is applied to the lane, as the factored dot does: the same exact
// products, summed in another order. Each output's sums run in K order whatever the rows
// of the call, so a row's result never depends on the others.
//
// The packed weight, per group of 32 outputs (zeros past out_features), per block of 32
// inputs: the quants [16 K pairs][2 vectors][16 outputs][2 inputs] (a nibble each for the
// 4-bit formats, a byte for the others: 0.75 or 1.25 bytes a weight with the scales), then
// the 32 scales as float32 (Q6_K: 2 x 32, a scale per half block), then the 32 mins where
// the format has them. A group is read as one ascending stream. A block's quants are
// widened to bfloat16 once into an L1 buffer and used by every row of the call, in tiles of
// up to kTileRows rows whose block sums stay in registers.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "gguf_formats.h"
#include "kernels.h"
#include "parallel.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TANDEM_HAS_GGUF_GEMM 1
#else
#define TANDEM_HAS_GGUF_GEMM 0
#endif

namespace {

using namespace tandem::gguf;

constexpr int64_t kGroup = 32;         // outputs per group: two vectors of 16
constexpr int64_t kBlockWeights = 32;  // inputs per block
constexpr int64_t kPairs = kBlockWeights / 2;
constexpr int kTileRows = 12;  // 24 block sums in registers, beside 2 weights and x
// How many blocks ahead of the widening to prefetch: of 2, 3, 4 and 6, 4 ran SmolLM2's
// projections fastest from 3 to 32 rows (32 rows: 16.6 ms without, 12.3 with).
constexpr int64_t kPrefetchBlocks = 4;

// Whether a format's repacked blocks carry a min: the 32-weight formats' own, Q4_K's and
// Q5_K's (negated), not Q6_K.
template <typename F>
constexpr bool has_offset() {
  if constexpr (std::is_same_v<F, Q6_K>)
    return false;
  else if constexpr (F::kWeights != kBlockWeights)
    return true;
  else
    return F::kHasOffset;
}

// How a format's quants are laid out once repacked: a nibble each (4-bit quants, the low
// nibble input 0 of its pair, the high one input 1) or a byte (5-, 6- and 8-bit), with a
// min or without, and how many scales a block of 32 inputs has (Q6_K: one per 16). A
// nibble, or a 5- or 6-bit quant's byte, holds the index of the quant's value in a table
// (the quant plus kCentre); Q8_0's byte holds the int8 itself.
template <typename F>
struct Packing {
  static constexpr bool kQ6K = std::is_same_v<F, Q6_K>;
  static constexpr bool kKQuant = F::kWeights != kBlockWeights;
  static constexpr bool kNibbles = std::is_same_v<F, Q4<false>> ||
                                   std::is_same_v<F, Q4<true>> || std::is_same_v<F, QK45<false>>;
  static constexpr bool kHasOffset = has_offset<F>();
  static constexpr int kSplits = kQ6K ? 2 : 1;
  static constexpr int kIndexBits = kNibbles                        ? 4
                                    : std::is_same_v<F, Q8_0>       ? 0
                                    : kQ6K                          ? 6
                                                                    : 5;
  static constexpr int kCentre = std::is_same_v<F, Q4<false>> ? 8
                                 : std::is_same_v<F, Q5<false>> ? 16
                                 : kQ6K                         ? 32
                                                                : 0;
};

// Block b (of 32 inputs) of one output's row of blocks: its 32 quants, its kSplits scales
// and (kHasOffset) its offset, weight j being scales[j * kSplits / 32] * q[j] (+ offset) as
// the format's dequant computes it (a K-quant's min enters as the offset's negation).
template <typename F>
void read_block(const uint8_t* row, int64_t b, int* q, float* scales, float* offset) {
  if constexpr (std::is_same_v<F, Q6_K>) {
    const uint8_t* super = row + b / 8 * F::kBytes;
    Q6_K::group(super, static_cast<int>(b % 8), q);
    scales[0] = Q6_K::scale(super, static_cast<int>(b % 8 * 2));
    scales[1] = Q6_K::scale(super, static_cast<int>(b % 8 * 2 + 1));
  } else if constexpr (Packing<F>::kKQuant) {
    float min;
    F::sub_block(row + b / 8 * F::kBytes, static_cast<int>(b % 8), q, scales, &min);
    *offset = -min;
  } else {
#if defined(__AVX512F__)
    const uint8_t* in = row + b * F::kBytes;
    alignas(64) float whole[kBlockWeights];
    __m512 lo, hi;
    F::quants(in, lo, hi);
    _mm512_store_ps(whole, lo);
    _mm512_store_ps(whole + 16, hi);
    for (int64_t j = 0; j < kBlockWeights; ++j) q[j] = static_cast<int>(whole[j]);
    scales[0] = F::scale(in);
    if constexpr (F::kHasOffset) *offset = F::offset(in);
#else
    (void)row, (void)b, (void)q, (void)scales, (void)offset;
#endif
  }
}

// Bytes of one vector's 32 quants (16 outputs x 2 inputs).
template <typename F>
constexpr int64_t vector_bytes() {
  return Packing<F>::kNibbles ? 16 : 32;
}

// Bytes of one group's block of quants, then of the whole block with scales (and mins).
template <typename F>
constexpr int64_t quant_bytes() {
  return 2 * kPairs * vector_bytes<F>();
}
template <typename F>
constexpr int64_t block_bytes() {
  return quant_bytes<F>() + kGroup * 4 * (Packing<F>::kSplits + (Packing<F>::kHasOffset ? 1 : 0));
}

int64_t groups_of(int64_t out_features) { return (out_features + kGroup - 1) / kGroup; }

#if TANDEM_HAS_GGUF_GEMM
// A vector's 32 quants -> 32 exact bfloat16, by table lookup where the quants are indexes.
// Nibbles: byte i | byte i << 12 puts its low nibble in the low bits of word 2 i and its
// high nibble in those of word 2 i + 1, and VPERMW looks the value up (it reads 5 bits of
// an index: the table is written twice, so the fifth does not matter). 5-bit indexes: byte
// i widened to word i, VPERMW; 6-bit: VPERMT2W over two tables of 32. Q8_0's int8s: through
// float32 (every int8 is exact there too), five instructions to the lookup's two. (Gemma's
// Q5_0 projections, against the int8s through float32, alternated in process 3x: 3 rows
// 1.59-1.60 -> 1.51-1.54 ms, 8 rows 1.82-1.90 -> 1.75-1.85, 32 rows 5.17-5.47 -> 5.13-5.27.)
template <typename F>
inline __m512bh widen(const uint8_t* q) {
  using P = Packing<F>;
  if constexpr (P::kIndexBits == 4) {
    alignas(64) static constexpr auto kTable =
        bf16_table<32>([](int i) { return i % 16 - P::kCentre; });
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512i index = _mm512_or_si512(b, _mm512_slli_epi32(b, 12));
    return (__m512bh)_mm512_permutexvar_epi16(index, _mm512_load_si512(kTable.data()));
  } else if constexpr (P::kIndexBits == 5 || P::kIndexBits == 6) {
    alignas(64) static constexpr auto kTable =
        bf16_table<1 << P::kIndexBits>([](int i) { return i - P::kCentre; });
    const __m512i index =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
    const __m512i low = _mm512_load_si512(kTable.data());
    if constexpr (P::kIndexBits == 5) return (__m512bh)_mm512_permutexvar_epi16(index, low);
    return (__m512bh)_mm512_permutex2var_epi16(low, index, _mm512_load_si512(kTable.data() + 32));
  } else {
    const auto* p = reinterpret_cast<const __m128i*>(q);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);  // lo's 16 values first
  }
}

// acc[r][v] += scale[v] * (block . x[r]) (+ min[v] * xsum[r]) for the R rows of one tile:
// w the block's widened quants [16 pairs][2 vectors], x[r] the block's pairs of row r. With
// two splits each half block's sums take their own scale (Q6_K's 16-weight sub-blocks).
template <int R, bool kHasOffset, int kSplits>
void tile(const __m512bh* w, const uint32_t* x, int64_t pairs, const float* scales,
          const float* xsum, int64_t blocks, float* acc) {
  constexpr int64_t kSplitPairs = kPairs / kSplits;
  for (int h = 0; h < kSplits; ++h) {
    __m512 s[R][2];
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
    for (int64_t kp = h * kSplitPairs; kp < (h + 1) * kSplitPairs; ++kp) {
      const __m512bh w0 = w[2 * kp], w1 = w[2 * kp + 1];
      for (int r = 0; r < R; ++r) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[r * pairs + kp]);
        s[r][0] = _mm512_dpbf16_ps(s[r][0], xv, w0);
        s[r][1] = _mm512_dpbf16_ps(s[r][1], xv, w1);
      }
    }
    for (int v = 0; v < 2; ++v) {
      const __m512 d = _mm512_loadu_ps(scales + h * kGroup + 16 * v);
      for (int r = 0; r < R; ++r) {
        float* a = acc + r * kGroup + 16 * v;
        __m512 sum = _mm512_fmadd_ps(d, s[r][v], _mm512_loadu_ps(a));
        if constexpr (kHasOffset)
          sum = _mm512_fmadd_ps(_mm512_loadu_ps(scales + kSplits * kGroup + 16 * v),
                                _mm512_set1_ps(xsum[r * blocks]), sum);
        _mm512_storeu_ps(a, sum);
      }
    }
  }
}

template <bool kHasOffset, int kSplits>
void tile_rows(int height, const __m512bh* w, const uint32_t* x, int64_t pairs,
               const float* scales, const float* xsum, int64_t blocks, float* acc) {
  switch (height) {
#define TANDEM_TILE(R) \
  case R:              \
    return tile<R, kHasOffset, kSplits>(w, x, pairs, scales, xsum, blocks, acc);
    TANDEM_TILE(1) TANDEM_TILE(2) TANDEM_TILE(3) TANDEM_TILE(4) TANDEM_TILE(5) TANDEM_TILE(6)
    TANDEM_TILE(7) TANDEM_TILE(8) TANDEM_TILE(9) TANDEM_TILE(10) TANDEM_TILE(11) TANDEM_TILE(12)
#undef TANDEM_TILE
    default:
      TORCH_CHECK(false, "gguf_gemm: a tile of ", height, " rows");
  }
}

// Every row of x against one group: block by block, the block's quants widened once,
// then the rows in as few tiles as kTileRows allows, of even heights.
// One group's sums (plus the bias) into its outputs of y, as T (bfloat16 rounded to
// nearest even, as c10 rounds).
template <typename T>
void write_group(const float* acc, const float* bias, int64_t rows, int64_t first,
                 int64_t out_features, T* y) {
  const int64_t valid = std::min(kGroup, out_features - first);
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = acc + r * kGroup;
    T* out = y + r * out_features + first;
    if (valid == kGroup) {
      for (int64_t v = 0; v < kGroup; v += 16) {
        __m512 s = _mm512_loadu_ps(a + v);
        if (bias != nullptr) s = _mm512_add_ps(s, _mm512_loadu_ps(bias + first + v));
        tandem::store_lanes(out + v, s);
      }
    } else {
      for (int64_t o = 0; o < valid; ++o)
        out[o] = T(a[o] + (bias != nullptr ? bias[first + o] : 0.0f));
    }
  }
}

template <typename F>
void group_rows(const uint8_t* group, const uint32_t* x, int64_t rows, int64_t pairs,
                const float* xsum, int64_t blocks, float* acc) {
  alignas(64) __m512bh w[2 * kPairs];
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  const int64_t base = rows / tiles, longer = rows % tiles;  // the first `longer` get one more
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = group + b * block_bytes<F>();
    // The stream's hardware prefetch fell behind the widening: ask kPrefetchBlocks ahead,
    // into L2 (T1). On a 2-core Zen 4, SmolLM2's Q4_1 decode step against T0 (into L1),
    // alternated in one process: 4 rows 0.93x the time, 8 rows 0.94x, 16 and 32 level.
    for (int64_t line = 0; line < block_bytes<F>(); line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(block) + kPrefetchBlocks * block_bytes<F>() + line,
                   _MM_HINT_T1);
    for (int64_t v = 0; v < 2 * kPairs; ++v) w[v] = widen<F>(block + v * vector_bytes<F>());
    const auto* scales = reinterpret_cast<const float*>(block + quant_bytes<F>());
    for (int64_t t = 0, r = 0; t < tiles; r += base + (t < longer), ++t)
      tile_rows<Packing<F>::kHasOffset, Packing<F>::kSplits>(
          static_cast<int>(base + (t < longer)), w, x + r * pairs + b * kPairs, pairs, scales,
          xsum == nullptr ? nullptr : xsum + r * blocks + b, blocks, acc + r * kGroup);
  }
}
#endif

}  // namespace

bool gguf_gemm_packs(int64_t type) {
  with_format(type, [](auto) {});  // a type with no format here is refused
  return TANDEM_HAS_GGUF_GEMM != 0;
}

// Fewer rows read the file's blocks as they ship (gguf_linear): one row reads fewer bytes
// there, and SmolLM2's Q4_1 projections took as long either way (3.65-3.81 against
// 3.72-3.80 ms); at two they took 3.67-4.05 ms here against 4.83-5.05 on
// gguf_bf16_dot.cpp. The byte-a-quant copy reads more than the blocks: Q8_0's LM head at
// two rows took 0.60 ms here against 0.52 on the float32 path, so those start at three.
// The K-quants take it from one row: gguf_linear unpacks their sub-blocks one weight at a
// time (Gemma-3-270M's Q4_K and Q6_K projections: 14.2 ms a step at ~1.6 GB/s).
int64_t gguf_gemm_min_rows(int64_t type) {
  int64_t rows = 3;
  with_format(type, [&](auto format) {
    using P = Packing<decltype(format)>;
    rows = P::kKQuant ? 1 : P::kNibbles ? 2 : 3;
  });
  return rows;
}

at::Tensor gguf_gemm_pack(const at::Tensor& weight, int64_t type, int64_t in_features) {
  TORCH_CHECK(gguf_gemm_packs(type), "gguf_gemm_pack: no kernel for type ", type, " here");
  at::Tensor packed;
#if TANDEM_HAS_GGUF_GEMM
  with_format(type, [&](auto format) {
    using F = decltype(format);
    using P = Packing<F>;
    checked_blocks<F>("gguf_gemm_pack", weight, in_features);
    const int64_t blocks = in_features / kBlockWeights;
    const int64_t out = weight.size(0), row_bytes = weight.size(1), groups = groups_of(out);
    packed = at::zeros({groups, blocks * block_bytes<F>()}, weight.options());
    const uint8_t* src = weight.data_ptr<uint8_t>();
    uint8_t* dst = packed.data_ptr<uint8_t>();
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      int q[kBlockWeights];
      float scale[P::kSplits], offset = 0.0f;
      for (int64_t g = begin; g < end; ++g)
        for (int64_t o = 0; o < kGroup && g * kGroup + o < out; ++o)
          for (int64_t b = 0; b < blocks; ++b) {
            read_block<F>(src + (g * kGroup + o) * row_bytes, b, q, scale, &offset);
            uint8_t* block = dst + (g * blocks + b) * block_bytes<F>();
            const int64_t v = o / 16, lane = o % 16;
            for (int64_t j = 0; j < kBlockWeights; ++j) {  // pair j / 2, input j % 2
              uint8_t* vector = block + (j / 2 * 2 + v) * vector_bytes<F>();
              if constexpr (P::kNibbles)  // the table's index
                vector[lane] |= static_cast<uint8_t>((q[j] + P::kCentre) << (4 * (j % 2)));
              else if constexpr (P::kIndexBits != 0)
                vector[lane * 2 + j % 2] = static_cast<uint8_t>(q[j] + P::kCentre);
              else
                reinterpret_cast<int8_t*>(vector)[lane * 2 + j % 2] = static_cast<int8_t>(q[j]);
            }
            auto* scales = reinterpret_cast<float*>(block + quant_bytes<F>());
            for (int h = 0; h < P::kSplits; ++h) scales[h * kGroup + o] = scale[h];
            if constexpr (P::kHasOffset) scales[P::kSplits * kGroup + o] = offset;
          }
    });
  });
#endif
  return packed;
}

at::Tensor gguf_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t type,
                     int64_t out_features, const float* bias, bool bf16_out) {
  TORCH_CHECK(gguf_gemm_packs(type), "gguf_gemm: no kernel for type ", type, " here");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
                  x.device().is_cpu(),
              "gguf_gemm: x is a contiguous CPU bfloat16 [rows, in] tensor");
  const int64_t rows = x.size(0), in = x.size(1);
  // bfloat16 out halves what a wide head writes: Gemma's 262,144 outputs at 32 rows are
  // 33.5 MB in float32, past glibc's largest mmap threshold, so a fresh mapping (8,192 page
  // faults) every call, then a pass to round it.
  at::Tensor y =
      at::empty({rows, out_features}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (rows == 0) return y;  // no tiles to split the rows into
#if TANDEM_HAS_GGUF_GEMM
  with_format(type, [&](auto format) {
    using F = decltype(format);
    {
      TORCH_CHECK(in % kBlockWeights == 0, "gguf_gemm: in_features ", in, " is not whole blocks");
      const int64_t blocks = in / kBlockWeights, groups = groups_of(out_features);
      TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte &&
                      packed.is_contiguous() && packed.size(0) == groups &&
                      packed.size(1) == blocks * block_bytes<F>(),
                  "gguf_gemm: the packed weight does not hold [", out_features, ", ", in, "]");
      const auto* bits = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
      std::vector<float> xsum;  // each row's sum of x over each block, for the mins
      if constexpr (Packing<F>::kHasOffset)
        xsum = bf16_block_sums(bits, rows * blocks, kBlockWeights);
      const auto* xs = reinterpret_cast<const uint32_t*>(bits);
      const uint8_t* w = packed.data_ptr<uint8_t>();
      // As bf16_gemm's groups: a thread that loses its core leaves its last groups to
      // the other (tandem::parallel_steal).
      tandem::parallel_steal(groups, [&](int64_t g, int64_t) {
        static thread_local std::vector<float> acc;
        acc.assign(rows * kGroup, 0.0f);
        group_rows<F>(w + g * packed.size(1), xs, rows, in / 2,
                      xsum.empty() ? nullptr : xsum.data(), blocks, acc.data());
        if (bf16_out)
          write_group(acc.data(), bias, rows, g * kGroup, out_features,
                      y.data_ptr<at::BFloat16>());
        else
          write_group(acc.data(), bias, rows, g * kGroup, out_features, y.data_ptr<float>());
      });
    }
  });
#else
  (void)packed, (void)bias, (void)bf16_out;
#endif
  return y;
}
