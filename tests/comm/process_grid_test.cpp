// The dp x ep process grid: rank = dp_index * ep + ep_index; each group holds
// the ranks expected (checked by gathering world ranks over it), and an ep that
// does not divide the world is a clear error.
#include <catch2/catch.hpp>

#include "comm/process_grid.h"
#include "moetrain.h"
#include "testing.h"

using namespace moetrain;
using namespace moetrain::comm;
using moetrain::testing::error_of;

namespace {

std::vector<double> world_ranks_in(Communicator& group, int world_rank) {
  return group.all_gather(from_vector({static_cast<double>(world_rank)}, Shape{1}, DType::i64)).to_vector();
}

void check_grid(Communicator& w, int ep) {
  INFO("world size " << w.size() << ", ep " << ep << ", world rank " << w.rank());
  ProcessGrid grid = make_process_grid(w, ep);
  CHECK(grid.ep == ep);
  CHECK(grid.dp == w.size() / ep);
  CHECK(grid.dp_index * ep + grid.ep_index == w.rank());
  REQUIRE(grid.ep_group);
  REQUIRE(grid.dp_group);
  CHECK(grid.ep_group->size() == ep);
  CHECK(grid.ep_group->rank() == grid.ep_index);
  CHECK(grid.dp_group->size() == grid.dp);
  CHECK(grid.dp_group->rank() == grid.dp_index);
  std::vector<double> ep_members, dp_members;
  for (int e = 0; e < ep; ++e) ep_members.push_back(grid.dp_index * ep + e);
  for (int d = 0; d < grid.dp; ++d) dp_members.push_back(d * ep + grid.ep_index);
  CHECK(world_ranks_in(*grid.ep_group, w.rank()) == ep_members);
  CHECK(world_ranks_in(*grid.dp_group, w.rank()) == dp_members);
}

}  // namespace

TEST_CASE("comm: process grid of one process", "[comm]") {
  std::unique_ptr<Communicator> one = single_process();
  check_grid(*one, 1);
  CHECK_THAT(error_of([&] { make_process_grid(*one, 2); }),
             Catch::Contains("train.ep = 2 must divide the number of ranks (1") && Catch::Contains("choose one of 1"));
  CHECK_THAT(error_of([&] { make_process_grid(*one, 0, "--ep"); }), Catch::StartsWith("--ep = 0"));
}

TEST_CASE("comm: process grid layout for every ep dividing the world", "[comm][mpi]") {
  Communicator& w = world();
  for (int ep = 1; ep <= w.size(); ++ep)
    if (w.size() % ep == 0) check_grid(w, ep);
  if (w.size() == 4) {
    CHECK_THAT(error_of([&] { make_process_grid(w, 3); }),
               Catch::Contains("train.ep = 3 must divide the number of ranks (4") &&
                   Catch::Contains("choose one of 1, 2, 4"));
  }
}
