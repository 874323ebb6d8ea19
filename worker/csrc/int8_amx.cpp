// The AMX-INT8 path of the W8A8 projections (int8_linear.cpp drives it as ISA kAmx).
//
// At 8-32 rows a decode step's int8 products are compute-bound on AVX512-VNNI: one
// VPDPBUSD does 64 multiply-adds, and SmolLM2's 120 projections at 32 rows are ~3.4 G of
// them. One TDPBSSD does 16 x 16 x 64 = 16,384, signed by signed, so the rows need no
// unsigned offset (and no row-sum correction), and the step goes back to reading weights.
//
// int8_pack's layout is already what TDPBSSD wants for its right operand: a panel's 16
// outputs x 4 inputs per group are 64 adjacent bytes, so K step s (64 inputs, 16 groups)
// of a panel is one contiguous 1 KiB tile (16 rows of 64 bytes). The rows of x are the left
// operand as they are: a 16-row tile of 64 inputs at the rows' own stride. Inputs past the
// last whole step of 64 (shapes whose padded width is not a multiple of 64; no model we
// serve has one) are added on the scalar path after the tiles are stored.
//
// Tiles: tmm0/tmm1 the sums of panels a/b for rows 0-15, tmm2/tmm3 the same for rows
// 16-31 (16 rows x 16 int32 outputs); tmm4/tmm5 rows 0-15 / 16-31 of x; tmm6/tmm7 the
// weight tiles of panels a/b. Every product and sum is exact in int32 (|sum| <= K * 127^2).
#include <atomic>
#include <cstdint>
#include <cstring>

#include "int8_problem.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <immintrin.h>

#include "amx_tiles.h"
#define TANDEM_HAS_AMX_INT8 1
#else
#define TANDEM_HAS_AMX_INT8 0
#endif

namespace tandem::int8 {
namespace {

constexpr int64_t kTileRows = 16;
constexpr int64_t kStep = 64;  // inputs (bytes) per K step
constexpr int64_t kAhead = 2;  // L1 prefetch distance, in K steps

#if TANDEM_HAS_AMX_INT8
using tandem::amx::TileConfig;

// The tiles for a block of `rows` rows (the second half's tiles get what is left, or one
// row where nothing is: configured, never used).
void load_config(int64_t rows) {
  TileConfig config;
  const auto low = static_cast<uint8_t>(rows < kTileRows ? rows : kTileRows);
  const auto high = static_cast<uint8_t>(rows > kTileRows ? rows - kTileRows : 1);
  const uint8_t tile_rows[8] = {low, low, high, high, low, high, kTileRows, kTileRows};
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = tile_rows[t];
    config.bytes_per_row[t] = kStep;
  }
  _tile_loadconfig(&config);
}

// The configuration this thread last loaded: a block of the same rows loads none. oneDNN
// (bf16 projections) and amx_linear load their own configurations between int8 calls, so
// every call starts by forgetting it (begin_call).
thread_local int64_t configured_rows = -1;
thread_local uint64_t configured_call = 0;

// Panels a (and b where `two_panels`) over whole K steps, for both halves where
// `two_halves`; sums stored into acc (stride kBlock int32).
template <bool kTwoHalves, bool kTwoPanels>
void tiles(const Problem& p, const int8_t* x, int64_t steps, const int8_t* wa, const int8_t* wb,
           int32_t* acc) {
  const int64_t x_stride = p.kp;
  const int8_t* x1 = x + kTileRows * x_stride;
  _tile_zero(0);
  if (kTwoPanels) _tile_zero(1);
  if (kTwoHalves) _tile_zero(2);
  if (kTwoHalves && kTwoPanels) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    // Tile loads wait on their 16 lines in turn: the weights' lines reach L1 kAhead
    // steps before their tiles load.
    if (s + kAhead < steps)
      for (int64_t line = 0; line < kTileRows; ++line) {
        const int64_t at = (s + kAhead) * kStep * kPanel + line * kStep;
        _mm_prefetch(reinterpret_cast<const char*>(wa + at), _MM_HINT_T0);
        if (kTwoPanels) _mm_prefetch(reinterpret_cast<const char*>(wb + at), _MM_HINT_T0);
      }
    _tile_loadd(4, x + s * kStep, x_stride);
    if (kTwoHalves) _tile_loadd(5, x1 + s * kStep, x_stride);
    _tile_loadd(6, wa + s * kStep * kPanel, kStep);
    _tile_dpbssd(0, 4, 6);
    if (kTwoHalves) _tile_dpbssd(2, 5, 6);
    if (kTwoPanels) {
      _tile_loadd(7, wb + s * kStep * kPanel, kStep);
      _tile_dpbssd(1, 4, 7);
      if (kTwoHalves) _tile_dpbssd(3, 5, 7);
    }
  }
  constexpr int64_t stride = kBlock * sizeof(int32_t);
  int32_t* high = acc + kTileRows * kBlock;
  _tile_stored(0, acc, stride);
  if (kTwoPanels) _tile_stored(1, acc + kPanel, stride);
  if (kTwoHalves) _tile_stored(2, high, stride);
  if (kTwoHalves && kTwoPanels) _tile_stored(3, high + kPanel, stride);
}
#endif

// The inputs [from, kp) of rows [row, row + rows) with panel `panel`, added to acc.
void add_tail(const Problem& p, int64_t row, int64_t rows, int64_t panel, int64_t from,
              int32_t* acc) {
  const int8_t* w = panel_weights(p, panel);
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* x = p.xq + (row + r) * p.kp;
    int32_t* out = acc + r * kBlock;
    for (int64_t g = from; g < p.kp; g += kGroup)
      for (int64_t j = 0; j < kPanel; ++j)
        for (int64_t i = 0; i < kGroup; ++i)
          out[j] += int32_t{x[g + i]} * int32_t{w[g * kPanel + j * kGroup + i]};
  }
}

}  // namespace

bool amx_int8_ready() {
#if TANDEM_HAS_AMX_INT8
  static const bool granted = tandem::amx::request_tiles();
  return granted;
#else
  return false;
#endif
}

uint64_t amx_begin_call() {
  static std::atomic<uint64_t> calls{0};
  return calls.fetch_add(1, std::memory_order_relaxed) + 1;
}

void amx_block(const Problem& p, int64_t row, int64_t rows, int64_t panel0, int64_t panels,
               int32_t* acc, uint64_t call) {
  const int64_t steps = p.kp / kStep;
#if TANDEM_HAS_AMX_INT8
  if (configured_call != call || configured_rows != rows) {
    load_config(rows);
    configured_call = call;
    configured_rows = rows;
  }
  const int8_t* x = p.xq + row * p.kp;
  const bool two_halves = rows > kTileRows;
  for (int64_t q = 0; q < panels; q += 2) {
    const int8_t* wa = panel_weights(p, panel0 + q);
    const int8_t* wb = panel_weights(p, panel0 + q + 1);
    int32_t* out = acc + q * kPanel;
    if (q + 1 < panels) {
      if (two_halves)
        tiles<true, true>(p, x, steps, wa, wb, out);
      else
        tiles<false, true>(p, x, steps, wa, wb, out);
    } else if (two_halves) {
      tiles<true, false>(p, x, steps, wa, wb, out);
    } else {
      tiles<false, false>(p, x, steps, wa, wb, out);
    }
  }
#else
  // Never chosen where not built (int8_linear checks the path); zeros keep it defined.
  for (int64_t r = 0; r < rows; ++r) std::memset(acc + r * kBlock, 0, panels * kPanel * 4);
#endif
  if (steps * kStep < p.kp)
    for (int64_t q = 0; q < panels; ++q)
      add_tail(p, row, rows, panel0 + q, steps * kStep, acc + q * kPanel);
}

}  // namespace tandem::int8
