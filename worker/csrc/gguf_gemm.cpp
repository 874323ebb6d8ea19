// GGUF projections for many bfloat16 rows (a bfloat16 model's decode steps of 2 or 3 on)
// on AVX512-BF16 CPUs: y = x W^T (+ b), float32 out, with the quants of the 32-weight
// formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) repacked once, at load, into bf16_gemm's layout.
//
// Past two rows gguf_linear.cpp dequantizes each block to float32 and dots it with float32
// rows: two float FMAs per 32 products, ~2.4x a bfloat16 step's time at 32 rows. Here, as
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
// 4-bit formats, an int8 for the others: 0.75 or 1.25 bytes a weight with the scales), then
// the 32 scales as float32, then the 32 mins where the format has them. A group is read as
// one ascending stream. A block's quants are widened to bfloat16 once into an L1 buffer and
// used by every row of the call, in tiles of up to kTileRows rows whose block sums stay in
// registers.
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

template <typename F>
constexpr bool packs() {
  return F::kWeights == kBlockWeights;
}

// The 4-bit formats keep a quant in a nibble (the low one input 0 of its pair, the high
// one input 1), the others in a byte (int8: 5- and 8-bit quants).
template <typename F>
constexpr bool nibbles() {
  return std::is_same_v<F, Q4<false>> || std::is_same_v<F, Q4<true>>;
}

// Bytes of one vector's 32 quants (16 outputs x 2 inputs).
template <typename F>
constexpr int64_t vector_bytes() {
  return nibbles<F>() ? 16 : 32;
}

// Bytes of one group's block of quants, then of the whole block with scales (and mins).
template <typename F>
constexpr int64_t quant_bytes() {
  return 2 * kPairs * vector_bytes<F>();
}
template <typename F>
constexpr int64_t block_bytes() {
  return quant_bytes<F>() + kGroup * 4 * (F::kHasOffset ? 2 : 1);
}

int64_t groups_of(int64_t out_features) { return (out_features + kGroup - 1) / kGroup; }

#if TANDEM_HAS_GGUF_GEMM
// A vector's 32 quants -> 32 exact bfloat16. Bytes: through float32 (every int8 is exact
// there too). Nibbles: byte i | byte i << 12 puts its low nibble in the low bits of word
// 2 i and its high nibble in those of word 2 i + 1, and VPERMW looks the value up (it
// reads 5 bits of an index: the table is written twice, so the fifth does not matter).
template <typename F>
inline __m512bh widen(const uint8_t* q) {
  if constexpr (nibbles<F>()) {
    alignas(64) static constexpr auto kTable =
        bf16_table<32>([](int i) { return F::kHasOffset ? i % 16 : i % 16 - 8; });
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512i index = _mm512_or_si512(b, _mm512_slli_epi32(b, 12));
    return (__m512bh)_mm512_permutexvar_epi16(index, _mm512_load_si512(kTable.data()));
  } else {
    const auto* p = reinterpret_cast<const __m128i*>(q);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);  // lo's 16 values first
  }
}

// acc[r][v] += scale[v] * (block . x[r]) (+ min[v] * xsum[r]) for the R rows of one tile:
// w the block's widened quants [16 pairs][2 vectors], x[r] the block's pairs of row r.
template <int R, bool kHasOffset>
void tile(const __m512bh* w, const uint32_t* x, int64_t pairs, const float* scales,
          const float* xsum, int64_t blocks, float* acc) {
  __m512 s[R][2];
  for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kPairs; ++kp) {
    const __m512bh w0 = w[2 * kp], w1 = w[2 * kp + 1];
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[r * pairs + kp]);
      s[r][0] = _mm512_dpbf16_ps(s[r][0], xv, w0);
      s[r][1] = _mm512_dpbf16_ps(s[r][1], xv, w1);
    }
  }
  for (int v = 0; v < 2; ++v) {
    const __m512 d = _mm512_loadu_ps(scales + 16 * v);
    for (int r = 0; r < R; ++r) {
      float* a = acc + r * kGroup + 16 * v;
      __m512 sum = _mm512_fmadd_ps(d, s[r][v], _mm512_loadu_ps(a));
      if constexpr (kHasOffset)
        sum = _mm512_fmadd_ps(_mm512_loadu_ps(scales + kGroup + 16 * v),
                              _mm512_set1_ps(xsum[r * blocks]), sum);
      _mm512_storeu_ps(a, sum);
    }
  }
}

template <bool kHasOffset>
void tile_rows(int height, const __m512bh* w, const uint32_t* x, int64_t pairs,
               const float* scales, const float* xsum, int64_t blocks, float* acc) {
  switch (height) {
#define TANDEM_TILE(R) \
  case R:              \
    return tile<R, kHasOffset>(w, x, pairs, scales, xsum, blocks, acc);
    TANDEM_TILE(1) TANDEM_TILE(2) TANDEM_TILE(3) TANDEM_TILE(4) TANDEM_TILE(5) TANDEM_TILE(6)
    TANDEM_TILE(7) TANDEM_TILE(8) TANDEM_TILE(9) TANDEM_TILE(10) TANDEM_TILE(11) TANDEM_TILE(12)
#undef TANDEM_TILE
    default:
      TORCH_CHECK(false, "gguf_gemm: a tile of ", height, " rows");
  }
}

// Every row of x against one group: block by block, the block's quants widened once,
// then the rows in as few tiles as kTileRows allows, of even heights.
template <typename F>
void group_rows(const uint8_t* group, const uint32_t* x, int64_t rows, int64_t pairs,
                const float* xsum, int64_t blocks, float* acc) {
  alignas(64) __m512bh w[2 * kPairs];
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  const int64_t base = rows / tiles, longer = rows % tiles;  // the first `longer` get one more
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = group + b * block_bytes<F>();
    // The stream's hardware prefetch fell behind the widening: ask kPrefetchBlocks ahead.
    for (int64_t line = 0; line < block_bytes<F>(); line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(block) + kPrefetchBlocks * block_bytes<F>() + line,
                   _MM_HINT_T0);
    for (int64_t v = 0; v < 2 * kPairs; ++v) w[v] = widen<F>(block + v * vector_bytes<F>());
    const auto* scales = reinterpret_cast<const float*>(block + quant_bytes<F>());
    for (int64_t t = 0, r = 0; t < tiles; r += base + (t < longer), ++t)
      tile_rows<F::kHasOffset>(static_cast<int>(base + (t < longer)), w, x + r * pairs + b * kPairs,
                               pairs, scales, xsum == nullptr ? nullptr : xsum + r * blocks + b,
                               blocks, acc + r * kGroup);
  }
}
#endif

}  // namespace

bool gguf_gemm_packs(int64_t type) {
  bool supported = false;
  with_format(type, [&](auto format) { supported = packs<decltype(format)>(); });
  return TANDEM_HAS_GGUF_GEMM != 0 && supported;
}

// Fewer rows read the file's blocks as they ship (gguf_linear): one row reads fewer bytes
// there, and SmolLM2's Q4_1 projections took as long either way (3.65-3.81 against
// 3.72-3.80 ms); at two they took 3.67-4.05 ms here against 4.83-5.05 on
// gguf_bf16_dot.cpp. The byte-a-quant copy reads more than the blocks: Q8_0's LM head at
// two rows took 0.60 ms here against 0.52 on the float32 path, so those start at three.
int64_t gguf_gemm_min_rows(int64_t type) {
  int64_t rows = 3;
  with_format(type, [&](auto format) { rows = nibbles<decltype(format)>() ? 2 : 3; });
  return rows;
}

at::Tensor gguf_gemm_pack(const at::Tensor& weight, int64_t type, int64_t in_features) {
  TORCH_CHECK(gguf_gemm_packs(type), "gguf_gemm_pack: no kernel for type ", type, " here");
  at::Tensor packed;
#if TANDEM_HAS_GGUF_GEMM
  with_format(type, [&](auto format) {
    using F = decltype(format);
    if constexpr (packs<F>()) {
      const int64_t blocks = checked_blocks<F>("gguf_gemm_pack", weight, in_features);
      const int64_t out = weight.size(0), row_bytes = weight.size(1), groups = groups_of(out);
      packed = at::zeros({groups, blocks * block_bytes<F>()}, weight.options());
      const uint8_t* src = weight.data_ptr<uint8_t>();
      uint8_t* dst = packed.data_ptr<uint8_t>();
      at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
        alignas(64) float q[kBlockWeights];
        for (int64_t g = begin; g < end; ++g)
          for (int64_t o = 0; o < kGroup && g * kGroup + o < out; ++o)
            for (int64_t b = 0; b < blocks; ++b) {
              const uint8_t* in = src + (g * kGroup + o) * row_bytes + b * F::kBytes;
              __m512 lo, hi;
              F::quants(in, lo, hi);
              _mm512_store_ps(q, lo);
              _mm512_store_ps(q + 16, hi);
              uint8_t* block = dst + (g * blocks + b) * block_bytes<F>();
              const int64_t v = o / 16, lane = o % 16;
              for (int64_t j = 0; j < kBlockWeights; ++j) {  // pair j / 2, input j % 2
                uint8_t* vector = block + (j / 2 * 2 + v) * vector_bytes<F>();
                const int quant = static_cast<int>(q[j]);
                if constexpr (nibbles<F>()) {  // the table's index: Q4_0's quant plus its 8
                  const int index = F::kHasOffset ? quant : quant + 8;
                  vector[lane] |= static_cast<uint8_t>(index << (4 * (j % 2)));
                } else {
                  reinterpret_cast<int8_t*>(vector)[lane * 2 + j % 2] = static_cast<int8_t>(quant);
                }
              }
              auto* scales = reinterpret_cast<float*>(block + quant_bytes<F>());
              scales[o] = F::scale(in);
              if constexpr (F::kHasOffset) scales[kGroup + o] = F::offset(in);
            }
      });
    }
  });
#endif
  return packed;
}

at::Tensor gguf_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t type,
                     int64_t out_features, const float* bias) {
  TORCH_CHECK(gguf_gemm_packs(type), "gguf_gemm: no kernel for type ", type, " here");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() &&
                  x.device().is_cpu(),
              "gguf_gemm: x is a contiguous CPU bfloat16 [rows, in] tensor");
  const int64_t rows = x.size(0), in = x.size(1);
  at::Tensor y = at::empty({rows, out_features}, x.options().dtype(at::kFloat));
  if (rows == 0) return y;  // no tiles to split the rows into
#if TANDEM_HAS_GGUF_GEMM
  with_format(type, [&](auto format) {
    using F = decltype(format);
    if constexpr (packs<F>()) {
      TORCH_CHECK(in % kBlockWeights == 0, "gguf_gemm: in_features ", in, " is not whole blocks");
      const int64_t blocks = in / kBlockWeights, groups = groups_of(out_features);
      TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte &&
                      packed.is_contiguous() && packed.size(0) == groups &&
                      packed.size(1) == blocks * block_bytes<F>(),
                  "gguf_gemm: the packed weight does not hold [", out_features, ", ", in, "]");
      const auto* bits = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
      std::vector<float> xsum;  // each row's sum of x over each block, for the mins
      if constexpr (F::kHasOffset) xsum = bf16_block_sums(bits, rows * blocks, kBlockWeights);
      const auto* xs = reinterpret_cast<const uint32_t*>(bits);
      const uint8_t* w = packed.data_ptr<uint8_t>();
      float* out = y.data_ptr<float>();
      // As bf16_gemm's groups: a thread that loses its core leaves its last groups to
      // the other (tandem::parallel_steal).
      tandem::parallel_steal(groups, [&](int64_t g, int64_t) {
        static thread_local std::vector<float> acc;
        acc.assign(rows * kGroup, 0.0f);
        group_rows<F>(w + g * packed.size(1), xs, rows, in / 2,
                      xsum.empty() ? nullptr : xsum.data(), blocks, acc.data());
        const int64_t first = g * kGroup, valid = std::min(kGroup, out_features - first);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t o = 0; o < valid; ++o)
            out[r * out_features + first + o] =
                acc[r * kGroup + o] + (bias != nullptr ? bias[first + o] : 0.0f);
      });
    }
  });
#else
  (void)packed, (void)bias;
#endif
  return y;
}
