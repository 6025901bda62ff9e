// AMX tile state shared by the kernels that use it (amx_linear.cpp, the attention's prompt tiles). The tile
// configuration is per thread: each kernel loads its own in every thread of its parallel region, and releases
// it at the end, so the kernels never depend on each other's shapes.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pagedllm {

// The LDTILECFG operand (palette 1): per tile, its bytes per row and its rows.
struct TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline bool amx_permitted() {
  // Linux grants a process the AMX tile state on request (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); the
  // request fails where the CPU has no AMX.
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

}  // namespace pagedllm
