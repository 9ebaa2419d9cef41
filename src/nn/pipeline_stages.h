// How pipeline parallelism (train.pp, docs/parallelism.md#pipeline-parallelism)
// splits a decoder's layer stack into stages: by layer count, contiguous, the
// larger stages first. Stage s holds layers [first(s), first(s + 1)); the first
// stage also holds the token embedding, the last the final norm, the output
// AttnRes read and the LM head (with tied embeddings, a copy of the embedding
// table whose gradient is summed with the first stage's). With virtual stages
// (train.pp_virtual V, docs/parallelism.md#interleaved-virtual-stages) the stack
// is split into pp x V stages and rank r holds V of them, r, pp + r, 2 pp + r, ...
// (its chunks 0 .. V - 1). The trainer and the ledger both split with this function.
#pragma once

#include <cstdint>
#include <vector>

namespace moetrain {

struct StageLayers {
  int64_t first = 0, end = 0;  // layers [first, end)
  int64_t count() const { return end - first; }
};

// Which stage of how many a model is built for (1 of 1: the whole model): the
// rank's place in the pipeline and, with virtual stages, how many chunks it holds.
struct PipelineStage {
  int64_t index = 0, count = 1;
  int64_t chunks = 1;  // virtual stages per rank (train.pp_virtual)
  bool first() const { return index == 0; }            // holds the embedding (virtual stage 0)
  bool last() const { return index == count - 1; }     // holds the head (the last virtual stage)
  bool whole() const { return count == 1; }
  int64_t virtual_count() const { return count * chunks; }
  int64_t virtual_index(int64_t chunk) const { return chunk * count + index; }
};

// Stage `stage` of `pp` over n_layer layers: the first n_layer % pp stages hold
// n_layer / pp + 1 layers, the rest n_layer / pp. Requires 1 <= pp <= n_layer.
inline StageLayers stage_layers(int64_t n_layer, int64_t pp, int64_t stage) {
  const int64_t base = n_layer / pp, extra = n_layer % pp;
  const int64_t first = stage * base + (stage < extra ? stage : extra);
  return {first, first + base + (stage < extra ? 1 : 0)};
}

// Chunk `chunk` of a rank's stage: virtual stage chunk x count + index of count x chunks.
inline StageLayers stage_layers(int64_t n_layer, const PipelineStage& stage, int64_t chunk) {
  return stage_layers(n_layer, stage.virtual_count(), stage.virtual_index(chunk));
}

}  // namespace moetrain
