// The parallel dimensions of a run, by name, validated once
// (docs/architecture.md#adding-a-parallel-dimension): world = pp x dp x ep ranks.
// tp (tensor) and cp (context) parallelism are named so that a layout can be
// written down with them, but not implemented: their degree is 1, and anything
// else is refused here. make_process_grid (comm/process_grid.h) builds the groups of
// the dimensions; the trainer reads them from the config in
// train/distributed.h (parallel_dims).
#pragma once

#include <functional>
#include <string>

namespace moetrain::comm {

// The degrees asked for, each with the setting that asked (a config key or a CLI flag) for messages.
struct ParallelDegrees {
  int pp = 1, pp_virtual = 1, ep = 1, tp = 1, cp = 1;
  std::string pp_key = "train.pp", pp_virtual_key = "train.pp_virtual", ep_key = "train.ep", tp_key = "train.tp",
              cp_key = "train.cp";
};

struct ParallelDims {
  int world = 1;                    // ranks of the run
  int pp = 1, dp = 1, ep = 1;       // pipeline stages x data-parallel replicas x expert shards
  int pp_virtual = 1;               // virtual stages (model chunks) per pipeline rank; no ranks of its own
  int tp = 1, cp = 1;               // not implemented: always 1

  int stage_ranks() const { return dp * ep; }  // the ranks of one pipeline stage
};

// Reports a refused degree: `key` and the message after "key = value: " (e.g.
// Config::fail, which adds where the key was set). Must throw.
using ParallelDimsFail = std::function<void(const std::string& key, const std::string& message)>;

// The dims of `world` ranks split as `degrees` asks: dp = world / (pp x ep). A
// degree below 1, pp not dividing the world, ep not dividing a stage's ranks,
// pp_virtual > 1 without pp > 1, or tp / cp other than 1 is refused through `fail` (default: Error "key = value: message").
ParallelDims make_parallel_dims(int world, const ParallelDegrees& degrees, const ParallelDimsFail& fail = {});

}  // namespace moetrain::comm
