// The dp x ep process grid; see process_grid.h. Two splits of the world, in the
// same order on every rank.
#include "comm/process_grid.h"

#include <vector>

namespace moetrain::comm {

ProcessGrid make_process_grid(const Communicator& world, int ep, std::string_view ep_key) {
  const int n = world.size();
  if (ep < 1 || n % ep != 0) {
    std::vector<int> divisors;
    for (int d = 1; d <= n; ++d)
      if (n % d == 0) divisors.push_back(d);
    MT_THROW("{} = {} must divide the number of ranks ({}, from the launcher) into expert-parallel groups; "
             "choose one of {}",
             ep_key, ep, n, fmt::join(divisors, ", "));
  }
  ProcessGrid grid;
  grid.ep = ep;
  grid.dp = n / ep;
  grid.dp_index = world.rank() / ep;
  grid.ep_index = world.rank() % ep;
  grid.ep_group = world.split(grid.dp_index, grid.ep_index);
  grid.dp_group = world.split(grid.ep_index, grid.dp_index);
  MT_ASSERT(grid.ep_group && grid.ep_group->size() == ep && grid.ep_group->rank() == grid.ep_index,
            "ep_group of world rank {}", world.rank());
  MT_ASSERT(grid.dp_group && grid.dp_group->size() == grid.dp && grid.dp_group->rank() == grid.dp_index,
            "dp_group of world rank {}", world.rank());
  return grid;
}

}  // namespace moetrain::comm
