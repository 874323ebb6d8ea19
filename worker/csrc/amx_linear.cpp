// bfloat16 projections of 3-32 rows on Intel AMX: y = x W^T (+ bias).
//
// A decode step at 3-32 sequences still reads every projection weight once, and
// oneDNN's prepacked matmul reaches ~12 GB/s over SmolLM2's projections at 32 rows here
// (bench.gemv), half the machine's read bandwidth. This kernel reads the plain [out, in]
// weight the GEMV already keeps (no third copy) straight into AMX tiles: 16 output rows
// x 32 inputs is the layout the left operand of TDPBF16PS wants, so only x, a few rows,
// is repacked per call into the right operand's pair-interleaved layout.
//
// Two 16-output blocks are taken at a time so four accumulators (2 blocks x 2 halves of
// x) keep the tile unit busy while the next block pair streams in: prefetched into L2 a
// pair ahead, and into L1 two K steps ahead (tile loads wait on their 16 lines in turn).
// Every sum is float32 and rounded once to bfloat16 after the bias, as the GEMV does;
// an output depends only on its own row of x, never on how many rows the call has.
//
// Needs AMX-BF16 (Intel Sapphire Rapids and later) and the kernel's permission to use
// tile data (arch_prctl); without either has_amx_linear() is false and those rows stay
// on oneDNN.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#include "amx_tiles.h"
#include "simd.h"
#define TANDEM_HAS_AMX 1
#else
#define TANDEM_HAS_AMX 0
#endif

namespace {

constexpr int64_t kMaxRows = 32;  // two 16-row halves of x per weight tile
constexpr int64_t kTile = 16;     // rows of a tile; also float32 columns of a sums tile
constexpr int64_t kTileK = 32;    // bf16 inputs per weight tile row (64 bytes)
constexpr int64_t kOutAlign = 2 * kTile;  // outputs go in pairs of 16-output blocks

#if TANDEM_HAS_AMX
constexpr int64_t kPairsPerTask = 2;  // at::parallel_for grain, in pairs of blocks
constexpr int64_t kNearSteps = 2;     // L1 prefetch distance, in K steps

using tandem::amx::TileConfig;

// tmm0/tmm1: sums of block a for x rows 0-15 / 16-31, tmm6/tmm7 the same for block b
// (16 outputs x 16 rows of float32); tmm2/tmm5: the weight tiles of blocks a and b
// (16 outputs x 32 inputs); tmm3/tmm4: x rows 0-15 / 16-31, pair-packed.
TileConfig tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTile;
    config.bytes_per_row[t] = 64;
  }
  return config;
}

// t[i] := column i of the 16 x 16 32-bit lanes in r (an in-register transpose).
inline void transpose16(const __m512 r[16], __m512 t[16]) {
  __m512 a[16], b[16];
  // a[2 i], a[2 i + 1]: rows 2 i and 2 i + 1 interleaved, columns 4 L + {0, 1} and
  // 4 L + {2, 3} of each 128-bit lane L.
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // b[4 i + k]: in each 128-bit lane L, rows 4 i .. 4 i + 3 of column 4 L + k.
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 2; ++j) {
      const __m512d lo = _mm512_castps_pd(a[4 * i + j]), hi = _mm512_castps_pd(a[4 * i + 2 + j]);
      b[4 * i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi));
      b[4 * i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi));
    }
  for (int k = 0; k < 4; ++k) {
    const __m512 p0 = _mm512_shuffle_f32x4(b[k], b[4 + k], 0x88);
    const __m512 p1 = _mm512_shuffle_f32x4(b[k], b[4 + k], 0xDD);
    const __m512 p2 = _mm512_shuffle_f32x4(b[8 + k], b[12 + k], 0x88);
    const __m512 p3 = _mm512_shuffle_f32x4(b[8 + k], b[12 + k], 0xDD);
    t[k] = _mm512_shuffle_f32x4(p0, p2, 0x88);
    t[8 + k] = _mm512_shuffle_f32x4(p0, p2, 0xDD);
    t[4 + k] = _mm512_shuffle_f32x4(p1, p3, 0x88);
    t[12 + k] = _mm512_shuffle_f32x4(p1, p3, 0xDD);
  }
}

// packed[h][s][i][2 m + j] = x[16 h + m][32 s + 2 i + j]: x rows 16 h .. 16 h + 15 as the
// right operand of K step s, zeros past the last row. Each step's tile is the transpose
// of those rows' 16 bf16 pairs (read as 32-bit lanes).
std::vector<float> pack_rows(const uint16_t* x, int64_t M, int64_t K) {
  const int64_t halves = (M + kTile - 1) / kTile, steps = K / kTileK, pairs = K / 2;
  std::vector<float> packed(halves * steps * kTile * kTile);
  const auto* x32 = reinterpret_cast<const float*>(x);
  for (int64_t h = 0; h < halves; ++h) {
    const int64_t valid = std::min(kTile, M - h * kTile);
    for (int64_t s = 0; s < steps; ++s) {
      __m512 r[16], t[16];
      for (int64_t m = 0; m < kTile; ++m)
        r[m] = m < valid ? _mm512_loadu_ps(x32 + (h * kTile + m) * pairs + s * kTile)
                         : _mm512_setzero_ps();
      transpose16(r, t);
      float* out = packed.data() + (h * steps + s) * kTile * kTile;
      for (int i = 0; i < kTile; ++i) _mm512_storeu_ps(out + i * kTile, t[i]);
    }
  }
  return packed;
}

// y[row0 + m, n0 .. n0 + 15] for m < rows, from a stored sums tile ([16 outputs][16
// rows] of float32): transposed, the bias added, rounded once to bfloat16.
void write_sums(const float* sums, int64_t row0, int64_t rows, int64_t n0, int64_t N,
                const uint16_t* bias, uint16_t* y) {
  __m512 r[16], t[16];
  for (int i = 0; i < kTile; ++i) r[i] = _mm512_loadu_ps(sums + i * kTile);
  transpose16(r, t);
  const __m512 b = bias != nullptr
                       ? tandem::load_lanes(reinterpret_cast<const c10::BFloat16*>(bias + n0))
                       : _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (row0 + m) * N + n0),
                        tandem::bf16_bits(_mm512_add_ps(t[m], b)));
}

void amx_rows(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
              int64_t M, int64_t N, int64_t K) {
  const std::vector<float> packed = pack_rows(x, M, K);
  const int64_t steps = K / kTileK, block_pairs = N / kOutAlign;
  const float* x0 = packed.data();
  const float* x1 = x0 + steps * kTile * kTile;
  const bool two = M > kTile;
  const int64_t low = std::min(M, kTile), high = M - low;
  at::parallel_for(0, block_pairs, kPairsPerTask, [&](int64_t begin, int64_t end) {
    const TileConfig config = tile_config();
    _tile_loadconfig(&config);  // per thread and call: oneDNN may load its own between
    float scratch[kTile * kTile];
    for (int64_t pair = begin; pair < end; ++pair) {
      const uint16_t* wa = w + pair * kOutAlign * K;
      const uint16_t* wb = wa + kTile * K;
      // The next pair's 32 rows are contiguous: 32 of its lines per step reach L2 over
      // this pair's steps.
      const char* ahead = reinterpret_cast<const char*>(wa + kOutAlign * K);
      const bool far = pair + 1 < block_pairs;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(6);
      _tile_zero(7);
      for (int64_t s = 0; s < steps; ++s) {
        if (far)
          for (int64_t line = 0; line < 2 * kTile; ++line)
            _mm_prefetch(ahead + (s * 2 * kTile + line) * 64, _MM_HINT_T1);
        if (s + kNearSteps < steps)
          for (int64_t r = 0; r < kTile; ++r) {
            _mm_prefetch(reinterpret_cast<const char*>(wa + r * K + (s + kNearSteps) * kTileK), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(wb + r * K + (s + kNearSteps) * kTileK), _MM_HINT_T0);
          }
        _tile_loadd(3, x0 + s * kTile * kTile, 64);
        if (two) _tile_loadd(4, x1 + s * kTile * kTile, 64);
        _tile_loadd(2, wa + s * kTileK, K * 2);
        _tile_dpbf16ps(0, 2, 3);
        if (two) _tile_dpbf16ps(1, 2, 4);
        _tile_loadd(5, wb + s * kTileK, K * 2);
        _tile_dpbf16ps(6, 5, 3);
        if (two) _tile_dpbf16ps(7, 5, 4);
      }
      const int64_t na = pair * kOutAlign, nb = na + kTile;
      // (_tile_stored takes its tile as a literal)
      _tile_stored(0, scratch, 64);
      write_sums(scratch, 0, low, na, N, bias, y);
      _tile_stored(6, scratch, 64);
      write_sums(scratch, 0, low, nb, N, bias, y);
      if (two) {
        _tile_stored(1, scratch, 64);
        write_sums(scratch, kTile, high, na, N, bias, y);
        _tile_stored(7, scratch, 64);
        write_sums(scratch, kTile, high, nb, N, bias, y);
      }
    }
    _tile_release();
  });
}
#endif

}  // namespace

bool has_amx_linear() {
#if TANDEM_HAS_AMX
  static const bool granted = tandem::amx::request_tiles();
  return granted;
#else
  return false;
#endif
}

int64_t amx_linear_max_rows(int64_t out_features, int64_t in_features) {
  const bool fits = out_features % kOutAlign == 0 && in_features % kTileK == 0;
  return has_amx_linear() && fits ? kMaxRows : 0;
}

// x [M, K], weight [N, K], bias [N] or none: bfloat16, contiguous, already checked by
// bf16_gemv; M <= amx_linear_max_rows(N, K).
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& weight,
                      const std::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(M >= 1 && M <= amx_linear_max_rows(N, K), "amx_linear: ", M,
              " rows of a [", N, ", ", K, "] weight");
  at::Tensor y = at::empty({M, N}, x.options());
#if TANDEM_HAS_AMX
  const uint16_t* b = bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr;
  amx_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()),
           reinterpret_cast<const uint16_t*>(weight.data_ptr()), b,
           reinterpret_cast<uint16_t*>(y.data_ptr()), M, N, K);
#endif
  return y;
}
