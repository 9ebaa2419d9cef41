// The pp x dp x ep process grid; see process_grid.h. Splits of the world, in the
// same order on every rank.
#include "comm/process_grid.h"

namespace moetrain::comm {

ProcessGrid make_process_grid(const Communicator& world, int ep, std::string_view ep_key, int pp,
                              std::string_view pp_key) {
  ParallelDegrees degrees;
  degrees.pp = pp;
  degrees.ep = ep;
  degrees.pp_key = pp_key;
  degrees.ep_key = ep_key;
  return make_process_grid(world, make_parallel_dims(world.size(), degrees));
}

ProcessGrid make_process_grid(const Communicator& world, const ParallelDims& dims) {
  MT_ASSERT(dims.world == world.size() && dims.pp * dims.dp * dims.ep == dims.world && dims.tp == 1 && dims.cp == 1,
            "make_process_grid: dims pp {} x dp {} x ep {} (tp {}, cp {}) for {} ranks", dims.pp, dims.dp, dims.ep,
            dims.tp, dims.cp, world.size());
  const int pp = dims.pp, ep = dims.ep;
  const int n = dims.stage_ranks();  // ranks per stage
  ProcessGrid grid;
  grid.pp = pp;
  grid.ep = ep;
  grid.dp = n / ep;
  grid.pp_index = world.rank() / n;
  const int local = world.rank() % n;
  grid.dp_index = local / ep;
  grid.ep_index = local % ep;
  // Colors are unique across stages: (stage, dp_index) for ep groups, (stage, ep_index) for dp groups.
  grid.ep_group = world.split(grid.pp_index * grid.dp + grid.dp_index, grid.ep_index);
  grid.dp_group = world.split(grid.pp_index * ep + grid.ep_index, grid.dp_index);
  if (pp > 1) {
    grid.stage_group = world.split(grid.pp_index, local);
    grid.pipe_group = world.split(local, grid.pp_index);
    const bool end = grid.first_stage() || grid.last_stage();
    grid.tied_group = world.split(end ? local : kNoGroup, grid.pp_index);
    MT_ASSERT(grid.stage_group && grid.stage_group->size() == n && grid.stage_group->rank() == local,
              "stage_group of world rank {}", world.rank());
    MT_ASSERT(grid.pipe_group && grid.pipe_group->size() == pp && grid.pipe_group->rank() == grid.pp_index,
              "pipe_group of world rank {}", world.rank());
    MT_ASSERT(!end || (grid.tied_group && grid.tied_group->size() == 2), "tied_group of world rank {}",
              world.rank());
  }
  MT_ASSERT(grid.ep_group && grid.ep_group->size() == ep && grid.ep_group->rank() == grid.ep_index,
            "ep_group of world rank {}", world.rank());
  MT_ASSERT(grid.dp_group && grid.dp_group->size() == grid.dp && grid.dp_group->rank() == grid.dp_index,
            "dp_group of world rank {}", world.rank());
  return grid;
}

}  // namespace moetrain::comm
