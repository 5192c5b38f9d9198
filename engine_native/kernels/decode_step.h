// The per-sequence arguments of a decode step (one new token a sequence) as the whole-step decoders take
// them (fused_decode.cpp, panel_decode.cpp), checked once so that no index reads outside its table or pool.
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace sluice {

struct DecodeStep {
  torch::Tensor positions, slots, context_lens, block_tables;  // contiguous int64, kept alive for the pointers
  const int64_t *pos, *slot, *lens, *tables;
  int64_t max_blocks;
};

// positions, slots, context_lens [m] int64 and block_tables [m, max_blocks] int64, every position within a
// rotary table of `rotary_positions` rows, every slot and block within a pool of `num_blocks` x `block_size`.
inline DecodeStep check_decode_step(int64_t m, torch::Tensor positions, torch::Tensor slots, torch::Tensor block_tables,
                                    torch::Tensor context_lens, int64_t rotary_positions, int64_t num_blocks,
                                    int64_t block_size) {
  TORCH_CHECK(positions.numel() == m && slots.numel() == m && context_lens.numel() == m && block_tables.dim() == 2 &&
                  block_tables.size(0) == m,
              "one position, slot, length and table per row");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && slots.scalar_type() == torch::kInt64 &&
                  context_lens.scalar_type() == torch::kInt64 && block_tables.scalar_type() == torch::kInt64,
              "int64 positions, slots, lengths and tables");
  DecodeStep s{positions.contiguous(), slots.contiguous(), context_lens.contiguous(), block_tables.contiguous(),
               nullptr, nullptr, nullptr, nullptr, block_tables.size(1)};
  s.pos = s.positions.data_ptr<int64_t>();
  s.slot = s.slots.data_ptr<int64_t>();
  s.lens = s.context_lens.data_ptr<int64_t>();
  s.tables = s.block_tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i) {
    TORCH_CHECK(s.pos[i] >= 0 && s.pos[i] < rotary_positions, "position beyond the rotary table");
    TORCH_CHECK(s.slot[i] >= 0 && s.slot[i] < num_blocks * block_size, "slot out of the KV pool");
    TORCH_CHECK(s.lens[i] >= 1 && s.lens[i] <= s.max_blocks * block_size, "context length out of its block table");
    for (int64_t j = 0; j < (s.lens[i] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(s.tables[i * s.max_blocks + j] >= 0 && s.tables[i * s.max_blocks + j] < num_blocks,
                  "block id out of the pool");
  }
  return s;
}

}  // namespace sluice
