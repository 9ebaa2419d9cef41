// The named parallel dimensions and their validation; see parallel_dims.h.
#include "comm/parallel_dims.h"

#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"

namespace moetrain::comm {

namespace {

std::string parallel_dims_divisors(int n) {
  std::vector<int> divisors;
  for (int d = 1; d <= n; ++d)
    if (n % d == 0) divisors.push_back(d);
  return fmt::format("{}", fmt::join(divisors, ", "));
}

}  // namespace

ParallelDims make_parallel_dims(int world, const ParallelDegrees& degrees, const ParallelDimsFail& fail) {
  const auto refuse = [&](const std::string& key, int value, const std::string& message) {
    if (fail) fail(key, message);
    throw Error(fmt::format("{} = {}: {}", key, value, message));
  };
  MT_ASSERT(world >= 1, "make_parallel_dims: {} ranks", world);
  if (degrees.tp != 1)
    refuse(degrees.tp_key, degrees.tp, "tensor parallelism is not implemented; the degree is 1 (docs/parallelism.md)");
  if (degrees.cp != 1)
    refuse(degrees.cp_key, degrees.cp, "context parallelism is not implemented; the degree is 1 (docs/parallelism.md)");
  const int pp = degrees.pp, ep = degrees.ep;
  if (pp < 1) refuse(degrees.pp_key, pp, "must be at least 1");
  if (ep < 1) refuse(degrees.ep_key, ep, "must be at least 1");
  if (world % pp != 0)
    refuse(degrees.pp_key, pp,
           fmt::format("does not divide the {} ranks of this run (from the launcher) into pipeline stages (world = pp "
                       "x dp x ep); choose one of {}", world, parallel_dims_divisors(world)));
  const int n = world / pp;  // ranks per stage
  if (n % ep != 0) {
    const std::string ranks = pp == 1 ? fmt::format("the {} ranks of this run (from the launcher)", n)
                                      : fmt::format("the {} ranks of a pipeline stage ({} ranks / {} = {})", n, world,
                                                    degrees.pp_key, pp);
    refuse(degrees.ep_key, ep,
           fmt::format("does not divide {} into expert-parallel groups (world = pp x dp x ep); choose one of {}", ranks,
                       parallel_dims_divisors(n)));
  }
  if (degrees.pp_virtual < 1) refuse(degrees.pp_virtual_key, degrees.pp_virtual, "must be at least 1");
  if (degrees.pp_virtual > 1 && pp == 1)
    refuse(degrees.pp_virtual_key, degrees.pp_virtual,
           fmt::format("needs {} > 1 (it splits each pipeline rank's layers into chunks)", degrees.pp_key));
  ParallelDims dims;
  dims.world = world;
  dims.pp_virtual = degrees.pp_virtual;
  dims.pp = pp;
  dims.ep = ep;
  dims.dp = n / ep;
  return dims;
}

}  // namespace moetrain::comm
