// Shared-memory bank conflicts of one warp's access, for the layout tests of the
// GPU bodies (docs/cuda.md, "Attention on tensor cores", states the model and
// what it leaves out). The model, compute capability 5.x and later: shared
// memory is 32 banks of 4-byte words, word w in bank w % 32; a warp's request of
// `width`-byte accesses is served in phases of 128 bytes' worth of lanes (all 32
// lanes for 1-4 bytes, 16 for 8, 8 for 16); within a phase, lanes that touch the
// same word share it, and the phase takes as many passes as its busiest bank has
// distinct words.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <set>

namespace moetrain::testing {

// bytes[lane]: the byte offset lane accesses from a 128-byte aligned base, -1 for
// an idle lane. Returns the worst passes of a phase: 1 is conflict-free, 32 the
// worst a 4-byte access can be.
inline int bank_ways(const std::array<int64_t, 32>& bytes, int width) {
  const int per_phase = width <= 4 ? 32 : 128 / width;
  const int words_per_lane = width <= 4 ? 1 : width / 4;
  int worst = 1;
  for (int first = 0; first < 32; first += per_phase) {
    std::map<int64_t, std::set<int64_t>> words_of_bank;
    for (int lane = first; lane < first + per_phase; ++lane) {
      if (bytes[static_cast<size_t>(lane)] < 0) continue;
      for (int k = 0; k < words_per_lane; ++k) {
        const int64_t word = bytes[static_cast<size_t>(lane)] / 4 + k;
        words_of_bank[word % 32].insert(word);
      }
    }
    for (const auto& [bank, words] : words_of_bank) worst = std::max(worst, static_cast<int>(words.size()));
  }
  return worst;
}

}  // namespace moetrain::testing
