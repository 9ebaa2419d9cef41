// The host block's thread orders (ops/common/simt.h, HostOrder) and what they are
// for: a body that keeps the phase rule gives the same bits in every order; a body
// with a planted race (a barrier missing between a phase that writes shared memory
// and the read of another thread's value) passes in the natural order, which
// happens to run the writer first, and the shuffled order exposes it.
#include <catch2/catch.hpp>

#include <algorithm>
#include <vector>

#include "ops/common/simt.h"
#include "ops/simt_orders.h"

using namespace moetrain;
using moetrain::testing::host_block;
using moetrain::testing::run_in_all_orders;
using simt::HostOrder;

namespace {

// A block sum of x[0..n) into out[0]: the partials phase writes sh[tid], a barrier,
// then thread 0 adds them in order. `barrier` false merges the two phases: the
// last thread adds the partials in the phase that writes them, which is right
// only when it happens to run after all the others.
template <class Block>
void block_sum(const Block& blk, const std::vector<double>& x, double* sh, double* out, bool barrier) {
  const int n = blk.threads;
  auto partial = [&](int tid) {
    double s = 0;
    for (size_t i = static_cast<size_t>(tid); i < x.size(); i += static_cast<size_t>(n)) s += x[i];
    sh[tid] = s;
  };
  auto total = [&] {
    double s = 0;
    for (int t = 0; t < n; ++t) s += sh[t];
    out[0] = s;
  };
  if (barrier) {
    blk.each(partial);
    blk.each([&](int tid) {
      if (tid == 0) total();
    });
  } else {
    blk.each([&](int tid) {
      partial(tid);
      if (tid == n - 1) total();  // reads sh[t] of threads that may not have run yet
    });
  }
}

std::vector<double> sums(HostOrder order, bool barrier, int threads) {
  std::vector<double> x(1000);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 1.0 + static_cast<double>(i % 7);
  std::vector<double> out;
  for (int rep = 0; rep < 4; ++rep) {  // four blocks: each shuffled phase draws a new permutation
    std::vector<double> sh(static_cast<size_t>(threads), -1e9);  // stale shared memory
    double r = 0;
    block_sum(host_block(threads, order), x, sh.data(), &r, barrier);
    out.push_back(r);
  }
  return out;
}

}  // namespace

TEST_CASE("simt: the host block runs every thread and warp once per phase, in the order asked for", "[ops][simt]") {
  for (HostOrder order : {HostOrder::natural, HostOrder::reversed, HostOrder::shuffled}) {
    const simt::HostBlock blk = host_block(128, order);
    std::vector<int> seen, warps;
    blk.each([&](int tid) { seen.push_back(tid); });
    blk.each_warp([&](int w) { warps.push_back(w); });
    std::vector<int> sorted = seen;
    std::sort(sorted.begin(), sorted.end());
    for (int i = 0; i < 128; ++i) REQUIRE(sorted[static_cast<size_t>(i)] == i);
    std::sort(warps.begin(), warps.end());
    CHECK(warps == std::vector<int>{0, 1, 2, 3});
    if (order == HostOrder::natural) CHECK(seen == sorted);
    if (order == HostOrder::reversed) CHECK(seen.front() == 127);
    if (order == HostOrder::shuffled) CHECK(seen != sorted);
  }
  // Shuffled: reproducible for a seed, and a new permutation in each phase.
  const simt::HostBlock a = host_block(64, HostOrder::shuffled), b = host_block(64, HostOrder::shuffled);
  std::vector<int> a1, a2, b1;
  a.each([&](int t) { a1.push_back(t); });
  a.each([&](int t) { a2.push_back(t); });
  b.each([&](int t) { b1.push_back(t); });
  CHECK(a1 == b1);
  CHECK(a1 != a2);
}

TEST_CASE("simt: a planted race (a missing barrier) passes in the natural order, the shuffled order catches it",
          "[ops][simt]") {
  const int threads = 32;
  // The right sums, with the barrier, in every order.
  const std::vector<double> right = run_in_all_orders([&](HostOrder o) { return sums(o, true, threads); });
  double expected = 0;
  for (int i = 0; i < 1000; ++i) expected += 1.0 + (i % 7);
  CHECK(right == std::vector<double>(4, expected));
  // Without it: right by luck in the natural order (the last thread runs last) ...
  CHECK(sums(HostOrder::natural, false, threads) == right);
  // ... wrong (stale partials) in the shuffled and reversed orders: what run_in_all_orders reports.
  CHECK(sums(HostOrder::shuffled, false, threads) != right);
  CHECK(sums(HostOrder::reversed, false, threads) != right);
  CHECK_FALSE(testing::same_bits(sums(HostOrder::natural, false, threads), sums(HostOrder::shuffled, false, threads)));
}
