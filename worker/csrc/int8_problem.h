// What the W8A8 kernels share (int8_linear.cpp drives every ISA path, int8_amx.cpp holds
// the AMX-INT8 one): the packing's constants and one call's operands.
#pragma once

#include <cstdint>

namespace tandem::int8 {

constexpr int64_t kPanel = 16;       // output channels per packed panel
constexpr int64_t kGroup = 4;        // inputs per VNNI group
constexpr int64_t kBlockPanels = 4;  // panels computed together (one broadcast, four sums)
constexpr int64_t kBlock = kBlockPanels * kPanel;

// The operands of one call: quantized rows [m, kp] (kp: in padded to 4, zeros past in; for
// the VNNI paths offset to unsigned, q + 128), the packed weight and its row sums.
struct Problem {
  const int8_t* xq;
  const int8_t* packed;
  const int32_t* sums;
  int64_t kp;  // padded inputs
  int64_t n;   // outputs
};

inline const int8_t* panel_weights(const Problem& p, int64_t panel) {
  return p.packed + panel * p.kp * kPanel;
}

// The AMX-INT8 path (int8_amx.cpp), for signed rows (TDPBSSD: no unsigned offset).
constexpr int64_t kAmxRows = 32;  // rows of one block: two 16-row tiles of x

// Whether this build has the AMX-INT8 path and Linux granted this process the tile data.
bool amx_int8_ready();

// A number for one int8 call, told to each of its amx_block calls: a thread loads its tile
// configuration once a call (and again where the rows of its blocks change).
uint64_t amx_begin_call();

// acc[r * kBlock + q * kPanel + j] := the exact int32 products of rows [row, row + rows)
// (rows <= kAmxRows) with panels [panel0, panel0 + panels) (panels <= kBlockPanels).
void amx_block(const Problem& p, int64_t row, int64_t rows, int64_t panel0, int64_t panels,
               int32_t* acc, uint64_t call);

}  // namespace tandem::int8
