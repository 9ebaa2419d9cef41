// The process grid of training: world = pp x dp x ep ranks,
// rank = pp_index * (dp * ep) + dp_index * ep + ep_index: pipeline stages
// outermost (stage s is a block of dp x ep consecutive ranks), the ranks of one
// expert-parallel group consecutive (on one node when ep divides the ranks per
// node). docs/parallelism.md draws it.
//
// Inside a stage (pp = 1: the whole world):
//   ep_group: the ep ranks with this rank's dp_index; experts are sharded over
//             it and tokens travel over it (all_to_all_v). Rank = ep_index.
//   dp_group: the dp ranks with this rank's ep_index, which hold the same expert
//             shard: the expert-data-parallel group whose expert grads are
//             summed (all_reduce_grads). Rank = dp_index.
//   stage_group: the dp x ep ranks of this stage (pp > 1; null at pp = 1, where
//             it is the world): data-parallel replicas of the stage's layers,
//             whose non-expert grads are summed over it. Rank = local index.
// Across stages (pp > 1 only; null at pp = 1):
//   pipe_group: the pp ranks with this rank's local index (one per stage), the
//             pipeline its micro-batches flow through. Rank = pp_index.
//   tied_group: the first and the last stage's ranks of this pipeline (tied
//             embeddings: the table's gradient summed between them); null on
//             the other stages.
#pragma once

#include <memory>
#include <string_view>

#include "comm/communicator.h"
#include "comm/parallel_dims.h"

namespace moetrain::comm {

struct ProcessGrid {
  int pp = 1, dp = 1, ep = 1;
  int pp_index = 0, dp_index = 0, ep_index = 0;
  std::unique_ptr<Communicator> ep_group;
  std::unique_ptr<Communicator> dp_group;
  std::unique_ptr<Communicator> stage_group, pipe_group, tied_group;

  int replicas() const { return dp * ep; }                  // data-parallel replicas of one stage
  int local_index() const { return dp_index * ep + ep_index; }  // rank within the stage
  bool first_stage() const { return pp_index == 0; }
  bool last_stage() const { return pp_index == pp - 1; }
};

// Splits `world` into the grid of `dims` (make_parallel_dims of world.size()).
ProcessGrid make_process_grid(const Communicator& world, const ParallelDims& dims);
// The same for degrees not validated yet: make_parallel_dims's errors, `ep_key` and
// `pp_key` naming the settings (config keys, or CLI flags).
ProcessGrid make_process_grid(const Communicator& world, int ep, std::string_view ep_key = "train.ep", int pp = 1,
                              std::string_view pp_key = "train.pp");

}  // namespace moetrain::comm
