// What the AMX kernels (amx_linear.cpp, prefill_attention.cpp) share: whether the build has AMX, the OS's
// permission for the tile state and the one tile configuration both use (simd.h's transpose16 lays out
// their B operands).
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define SLUICE_HAVE_AMX 1
#include <immintrin.h>
#endif

namespace sluice {

// Whether this build has AMX and Linux granted this process the tile state (asked once; defined in
// amx_linear.cpp).
bool amx_permitted();

#ifdef SLUICE_HAVE_AMX
constexpr int64_t kTileRows = 16;  // every tile: 16 rows of 64 bytes (32 bf16 or 16 fp32)

struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// All eight tiles as 16 rows x 64 bytes; per thread, before its first tile instruction.
inline void configure_tiles() {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = kTileRows;
  }
  // As an asm operand, not through _tile_loadconfig: GCC 12 does not count that builtin as reading cfg, and
  // inlined into the OpenMP worker of an AMX decode attention (tried on 2026-12-05, not kept: docs/engine.md) it
  // dropped the stores above as dead; ldtilecfg then faulted on a half-zeroed configuration.
  asm volatile("ldtilecfg %0" : : "m"(cfg));
}

#endif

}  // namespace sluice
