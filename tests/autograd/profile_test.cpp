// core/profile.h with the autograd engine: nodes carry the Region they were made
// in, their backward is charged there, nested Regions take their own forward time,
// off means nothing is recorded.
#include <catch2/catch.hpp>

#include <string>

#include "autograd/node.h"
#include "core/profile.h"
#include "moetrain.h"

using namespace moetrain;

namespace {
const profile::Entry* find(const std::vector<profile::Entry>& entries, const std::string& name) {
  for (const profile::Entry& e : entries)
    if (e.region == name) return &e;
  return nullptr;
}
}  // namespace

TEST_CASE("profile: nodes record their region; backward time goes to it", "[autograd][profile]") {
  Tensor x = randn({64, 64}, DType::f32, 1);
  x.set_requires_grad(true);
  profile::reset();
  profile::set_enabled(true);
  Tensor y, z;
  {
    profile::Region outer("outer");
    y = matmul(x, x);
    {
      profile::Region inner("inner");
      z = tanh(y);
      CHECK(std::string(profile::current_region()) == "inner");
    }
    CHECK(std::string(profile::current_region()) == "outer");
  }
  CHECK(std::string(profile::current_region()) == "other");
  CHECK(std::string(y.impl().grad_fn->region) == "outer");
  CHECK(std::string(z.impl().grad_fn->region) == "inner");
  sum(z).backward();
  profile::set_enabled(false);
  const auto entries = profile::entries();
  const profile::Entry* outer = find(entries, "outer");
  const profile::Entry* inner = find(entries, "inner");
  REQUIRE(outer);
  REQUIRE(inner);
  CHECK(outer->forward_s > 0);
  CHECK(inner->forward_s > 0);
  CHECK(outer->backward_s > 0);  // matmul's backward
  CHECK(inner->backward_s > 0);  // tanh's backward
  const profile::Entry* other = find(entries, "other");
  REQUIRE(other);  // sum's node was made outside any region
  CHECK(other->backward_s > 0);
  const std::string table = profile::format_table(entries, 1);
  CHECK(table.find("outer") != std::string::npos);
  CHECK(table.find("total") != std::string::npos);

  // Off: regions still name nodes, nothing is timed.
  profile::reset();
  {
    profile::Region r("quiet");
    Tensor w = tanh(x);
    CHECK(std::string(w.impl().grad_fn->region) == "quiet");
    sum(w).backward();
  }
  CHECK(profile::entries().empty());
}
