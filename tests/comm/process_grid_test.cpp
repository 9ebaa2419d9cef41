// The pp x dp x ep process grid: rank = pp_index * (dp * ep) + dp_index * ep +
// ep_index; each group holds the ranks expected (checked by gathering world ranks
// over it), and a pp or ep that does not divide the world (or a stage) is a clear error.
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
             Catch::Contains("train.ep = 2: does not divide the 1 ranks of this run") && Catch::Contains("choose one of 1"));
  CHECK_THAT(error_of([&] { make_process_grid(*one, 0, "--ep"); }), Catch::StartsWith("--ep = 0: must be at least 1"));
}

TEST_CASE("comm: process grid layout for every ep dividing the world", "[comm][mpi]") {
  Communicator& w = world();
  for (int ep = 1; ep <= w.size(); ++ep)
    if (w.size() % ep == 0) check_grid(w, ep);
  if (w.size() == 4) {
    CHECK_THAT(error_of([&] { make_process_grid(w, 3); }),
               Catch::Contains("train.ep = 3: does not divide the 4 ranks of this run") &&
                   Catch::Contains("choose one of 1, 2, 4"));
  }
}

TEST_CASE("comm: pp x dp x ep grid: stages of consecutive ranks, groups inside and across them", "[comm][mpi]") {
  Communicator& w = world();
  const int W = w.size(), rank = w.rank();
  for (int pp = 1; pp <= W; ++pp) {
    if (W % pp != 0) continue;
    const int n = W / pp;  // ranks per stage
    for (int ep = 1; ep <= n; ++ep) {
      if (n % ep != 0) continue;
      INFO("world " << W << " pp " << pp << " ep " << ep << " rank " << rank);
      ProcessGrid g = make_process_grid(w, ep, "train.ep", pp, "train.pp");
      CHECK(g.pp == pp);
      CHECK(g.dp == n / ep);
      CHECK(g.replicas() == n);
      CHECK(g.pp_index * n + g.dp_index * ep + g.ep_index == rank);
      CHECK(g.local_index() == rank % n);
      std::vector<double> ep_members, dp_members, stage_members, pipe_members;
      for (int e = 0; e < ep; ++e) ep_members.push_back(g.pp_index * n + g.dp_index * ep + e);
      for (int d = 0; d < g.dp; ++d) dp_members.push_back(g.pp_index * n + d * ep + g.ep_index);
      for (int l = 0; l < n; ++l) stage_members.push_back(g.pp_index * n + l);
      for (int s = 0; s < pp; ++s) pipe_members.push_back(s * n + g.local_index());
      CHECK(world_ranks_in(*g.ep_group, rank) == ep_members);
      CHECK(world_ranks_in(*g.dp_group, rank) == dp_members);
      if (pp == 1) {
        CHECK(!g.stage_group);
        CHECK(!g.pipe_group);
        CHECK(!g.tied_group);
        continue;
      }
      CHECK(world_ranks_in(*g.stage_group, rank) == stage_members);
      CHECK(world_ranks_in(*g.pipe_group, rank) == pipe_members);
      if (g.first_stage() || g.last_stage()) {
        REQUIRE(g.tied_group);
        CHECK(world_ranks_in(*g.tied_group, rank) ==
              std::vector<double>{static_cast<double>(g.local_index()),
                                  static_cast<double>((pp - 1) * n + g.local_index())});
      } else {
        CHECK(!g.tied_group);
      }
    }
  }
  if (W == 4) {
    CHECK_THAT(error_of([&] { make_process_grid(w, 1, "train.ep", 3, "train.pp"); }),
               Catch::Contains("train.pp = 3: does not divide the 4 ranks of this run") &&
                   Catch::Contains("choose one of 1, 2, 4"));
    CHECK_THAT(error_of([&] { make_process_grid(w, 4, "train.ep", 2, "train.pp"); }),
               Catch::Contains("train.ep = 4: does not divide the 2 ranks of a pipeline stage") &&
                   Catch::Contains("choose one of 1, 2"));
  }
}
