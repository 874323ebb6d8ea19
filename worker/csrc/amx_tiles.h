// What the AMX kernels share (amx_linear.cpp's bfloat16 tiles, int8_amx.cpp's int8 ones):
// asking Linux for the tile data, and the tile configuration's memory layout.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace tandem::amx {

// Linux hands AMX's tile data state to a process only once it asks; true where it did.
inline bool request_tiles() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// LDTILECFG's 64-byte operand (palette 1): each tile's rows and bytes per row.
struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace tandem::amx
