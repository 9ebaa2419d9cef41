// How pipeline parallelism (train.pp, docs/parallelism.md#pipeline-parallelism)
// splits a decoder's layer stack into stages: by layer count, contiguous, the
// larger stages first. Stage s holds layers [first(s), first(s + 1)); the first
// stage also holds the token embedding, the last the final norm, the output
// AttnRes read and the LM head (with tied embeddings, a copy of the embedding
// table whose gradient is summed with the first stage's). The trainer and the
// ledger both split with this function.
#pragma once

#include <cstdint>
#include <vector>

namespace moetrain {

struct StageLayers {
  int64_t first = 0, end = 0;  // layers [first, end)
  int64_t count() const { return end - first; }
};

// Which stage of how many a model is built for (1 of 1: the whole model).
struct PipelineStage {
  int64_t index = 0, count = 1;
  bool first() const { return index == 0; }
  bool last() const { return index == count - 1; }
  bool whole() const { return count == 1; }
};

// Stage `stage` of `pp` over n_layer layers: the first n_layer % pp stages hold
// n_layer / pp + 1 layers, the rest n_layer / pp. Requires 1 <= pp <= n_layer.
inline StageLayers stage_layers(int64_t n_layer, int64_t pp, int64_t stage) {
  const int64_t base = n_layer / pp, extra = n_layer % pp;
  const int64_t first = stage * base + (stage < extra ? stage : extra);
  return {first, first + base + (stage < extra ? 1 : 0)};
}

}  // namespace moetrain
