// The process grid of expert-parallel training: world = dp x ep ranks,
// rank = dp_index * ep + ep_index, so the ranks of one expert-parallel group
// are consecutive (on one node when ep divides the ranks per node).
//
//   ep_group: the ep ranks with this rank's dp_index; experts are sharded over
//             it and tokens travel over it (all_to_all_v). Rank = ep_index.
//   dp_group: the dp ranks with this rank's ep_index, which hold the same expert
//             shard: the expert-data-parallel group whose expert grads are
//             summed (all_reduce_grads). Rank = dp_index.
// Non-expert (replicated) parameters are summed over the whole world.
#pragma once

#include <memory>
#include <string_view>

#include "comm/communicator.h"

namespace moetrain::comm {

struct ProcessGrid {
  int dp = 1, ep = 1;
  int dp_index = 0, ep_index = 0;
  std::unique_ptr<Communicator> ep_group;
  std::unique_ptr<Communicator> dp_group;
};

// Splits `world` into the grid. ep must divide world.size(); `ep_key` names the
// setting in the error (the config key, or a CLI flag).
ProcessGrid make_process_grid(const Communicator& world, int ep, std::string_view ep_key = "train.ep");

}  // namespace moetrain::comm
