// AMX tile setup shared by tidepool's AMX kernels (cpu_encoder_attention.cpp's bf16 products,
// cpu_int8_gemm.cpp's int8 GEMM): the process's permission for the tile state, and the one tile
// configuration both use (8 tiles of 16 rows x 64 bytes).
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace {

// Asks the kernel for the tile data state (ARCH_REQ_XCOMP_PERM for XTILEDATA), once per
// process; oneDNN usually asked already, and asking again is harmless.
inline bool request_tile_data() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes. Per thread, and loaded again before each task's tile work:
// other code on the thread (oneDNN) configures tiles its own way.
inline void load_tile_config() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = 16;
  }
  // Not _tile_loadconfig: gcc 12's macro tells the compiler it reads 8 bytes, so the stores of
  // the rows and widths could be dropped (SIGILL on the first tile instruction).
  asm volatile("ldtilecfg %0" ::"m"(cfg));
}

}  // namespace
