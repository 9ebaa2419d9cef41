// The process grid of a training run and what its collectives keep between
// steps: the world, the dp x ep grid (comm/process_grid.h), the collective
// watchdog and the overlapped gradient reducer. In comm/ because checkpoints
// (which ranks write which shard) and the trainer (which sums what) both read
// it; train/distributed.h makes it from a config and issues the trainer's
// collectives around the model.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "comm/grad_sync.h"
#include "comm/process_grid.h"
#include "comm/watchdog.h"

namespace moetrain::comm {

// train.zero 1 (docs/parallelism.md, "Distributed optimizer"): the parameters
// sharing one replica group, as indices into the model's parameter list, and
// how their elements are split over that group's ranks.
struct ZeroGroup {
  Communicator* comm = nullptr;
  bool expert_shards = false;  // routed-expert shards (their norm is also summed over the ep group)
  std::vector<size_t> params;
  FlatShards shards;
};

struct Distributed {
  Communicator* world = nullptr;
  ProcessGrid grid;
  // dist.timeout_s > 0 with several ranks: a collective that waits longer ends the job (exit 42).
  std::unique_ptr<Watchdog> watchdog;
  bool overlap_grad_sync = false;                 // train.overlap_grad_sync
  int64_t grad_bucket_bytes = int64_t{32} << 20;  // train.grad_bucket_mb
  std::unique_ptr<GradReducer> reducer;           // made at the first overlapped step
  bool overlap_logged = false;                    // the first overlapped step's line is printed
  bool tied_pipeline = false;  // pp > 1 with tied embeddings: first and last stage both hold the table
  int64_t pp_virtual = 1;      // train.pp_virtual: chunks (virtual stages) per pipeline rank
  int zero = 0;                                   // train.zero (0 with one rank: nothing to shard)
  std::vector<ZeroGroup> zero_groups;             // train.zero 1: made with the optimizer

  int rank() const { return world->rank(); }
  int size() const { return world->size(); }
  bool root() const { return world->rank() == 0; }
};

}  // namespace moetrain::comm

namespace moetrain {
using comm::Distributed;
}  // namespace moetrain
