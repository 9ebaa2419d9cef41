// The host block's thread orders (ops/common/simt.h, HostOrder) and what they are
// for: a body that keeps the phase rule gives the same bits in every order; a body
// with a planted race (a barrier missing between a phase that writes shared memory
// and the read of another thread's value) passes in the natural order, which
// happens to run the writer first, and the shuffled order exposes it. Also the
// warp's lane primitives (lanes, warp_sum, warp_max, group_sum, group_max) and the shared-memory bank
// model the layout tests use (ops/smem_banks.h).
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops/common/simt.h"
#include "ops/simt_orders.h"
#include "ops/smem_banks.h"

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

TEST_CASE("simt: warp_sum and warp_max reduce the lanes' values by the GPU's butterfly, in every lane order",
          "[ops][simt]") {
  // Values of many magnitudes, so that the order of the additions shows in the bits.
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i) {
    const float mantissa = 1.0f + 0.37f * static_cast<float>(i % 5), sign = i % 3 == 0 ? -1.0f : 1.0f;
    x[static_cast<size_t>(i)] = sign * std::ldexp(mantissa, (i * 7) % 23 - 11);
  }
  // Lane 0's chain of __shfl_xor_sync additions: after step `off`, lane i holds
  // the sum of the lanes that agree with i in the bits above off; lane 0 adds
  // lane off's partial to its own.
  float tree[32];
  for (int i = 0; i < 32; ++i) tree[i] = x[static_cast<size_t>(i)];
  for (int off = 16; off > 0; off /= 2)
    for (int i = 0; i < off; ++i) tree[i] = tree[i] + tree[i + off];
  float in_order = 0.0f;
  for (float v : x) in_order += v;
  REQUIRE(tree[0] != in_order);  // the inputs tell the two orders apart
  for (HostOrder order : {HostOrder::natural, HostOrder::reversed, HostOrder::shuffled}) {
    const simt::HostBlock blk = host_block(128, order);
    std::vector<int> seen;
    const float sum = blk.warp_sum([&](int lane) {
      seen.push_back(lane);
      return x[static_cast<size_t>(lane)];
    });
    CHECK(std::memcmp(&sum, &tree[0], sizeof(float)) == 0);
    CHECK(blk.warp_max([&](int lane) { return x[static_cast<size_t>(lane)]; }) ==
          *std::max_element(x.begin(), x.end()));
    std::vector<int> sorted = seen;
    std::sort(sorted.begin(), sorted.end());
    for (int i = 0; i < 32; ++i) REQUIRE(sorted[static_cast<size_t>(i)] == i);
    if (order == HostOrder::reversed) CHECK(seen.front() == 31);
  }
}

TEST_CASE("simt: group_sum and group_max reduce each group of lanes by the butterfly's last steps",
          "[ops][simt]") {
  // Groups of G lanes (G = 2, 4, 32): every lane gets its own group's reduction,
  // summed as the GPU's xor G/2, ..., 1 shuffles sum it, in every lane order.
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i)
    x[static_cast<size_t>(i)] = std::ldexp(1.0f + 0.37f * static_cast<float>(i % 5), (i * 7) % 23 - 11);
  auto expect = [&](int G, int lane, bool max) {
    float v[32];
    for (int i = 0; i < 32; ++i) v[i] = x[static_cast<size_t>(i)];
    for (int off = G / 2; off > 0; off /= 2) {
      float next[32];
      for (int i = 0; i < 32; ++i) next[i] = max ? std::fmax(v[i], v[i ^ off]) : v[i] + v[i ^ off];
      std::copy(next, next + 32, v);
    }
    return v[lane];
  };
  for (HostOrder order : {HostOrder::natural, HostOrder::reversed, HostOrder::shuffled}) {
    const simt::HostBlock blk = host_block(32, order);
    auto check = [&](auto g_tag) {
      constexpr int G = decltype(g_tag)::value;
      std::vector<float> sum(32, -1.0f), mx(32, -1.0f);
      std::vector<int> calls(32, 0);
      blk.group_sum<G>([&](int lane) { return x[static_cast<size_t>(lane)]; },
                       [&](int lane, float v) {
                         sum[static_cast<size_t>(lane)] = v;
                         ++calls[static_cast<size_t>(lane)];
                       });
      blk.group_max<G>([&](int lane) { return x[static_cast<size_t>(lane)]; },
                       [&](int lane, float v) { mx[static_cast<size_t>(lane)] = v; });
      for (int lane = 0; lane < 32; ++lane) {
        const float want = expect(G, lane, false);
        CHECK(std::memcmp(&sum[static_cast<size_t>(lane)], &want, sizeof(float)) == 0);
        CHECK(mx[static_cast<size_t>(lane)] == expect(G, lane, true));
        CHECK(calls[static_cast<size_t>(lane)] == 1);
      }
      // Lanes of one group agree; the first lanes of two groups do not (for G < 32).
      if (G < 32) CHECK(sum[0] != sum[G]);
    };
    check(std::integral_constant<int, 2>{});
    check(std::integral_constant<int, 4>{});
    check(std::integral_constant<int, 32>{});
    // G = 32 is warp_sum's butterfly.
    const float whole = blk.warp_sum([&](int lane) { return x[static_cast<size_t>(lane)]; });
    const float g32 = expect(32, 0, false);
    CHECK(std::memcmp(&whole, &g32, sizeof(float)) == 0);
  }
}

TEST_CASE("simt: lanes() runs every lane once in the block's order; a lane race shows in the orders", "[ops][simt]") {
  // Lane 0 publishes a value its neighbours read in the same lanes() call: right
  // only when lane 0 happens to run first.
  auto racy = [](HostOrder order) {
    const simt::HostBlock blk = host_block(32, order);
    std::vector<float> shared(32, -1.0f), out(32, 0.0f);
    blk.each_warp([&](int) {
      blk.lanes([&](int lane) {
        if (lane == 0) shared[0] = 5.0f;
        out[static_cast<size_t>(lane)] = shared[0];
      });
    });
    return out;
  };
  CHECK(racy(HostOrder::natural) == std::vector<float>(32, 5.0f));
  CHECK_FALSE(testing::same_bits(racy(HostOrder::natural), racy(HostOrder::reversed)));
  CHECK_FALSE(testing::same_bits(racy(HostOrder::natural), racy(HostOrder::shuffled)));
}

TEST_CASE("smem banks: the model counts the passes of a warp's shared-memory access", "[ops][simt]") {
  std::array<int64_t, 32> a{};
  for (int l = 0; l < 32; ++l) a[static_cast<size_t>(l)] = 4 * l;  // consecutive words
  CHECK(testing::bank_ways(a, 4) == 1);
  for (int l = 0; l < 32; ++l) a[static_cast<size_t>(l)] = 4 * 64 * l;  // a column of a 64-float row-major array
  CHECK(testing::bank_ways(a, 4) == 32);
  for (int l = 0; l < 32; ++l) a[static_cast<size_t>(l)] = 4 * 65 * l;  // the same, rows padded by one word
  CHECK(testing::bank_ways(a, 4) == 1);
  for (int l = 0; l < 32; ++l) a[static_cast<size_t>(l)] = 128;  // one word for all: a broadcast
  CHECK(testing::bank_ways(a, 4) == 1);
  for (int l = 0; l < 32; ++l) a[static_cast<size_t>(l)] = 2 * l;  // 2-byte lanes, two per word
  CHECK(testing::bank_ways(a, 2) == 1);
  for (int l = 0; l < 32; ++l) a[static_cast<size_t>(l)] = 8 * l;  // 8 bytes a lane: half-warps of 32 words
  CHECK(testing::bank_ways(a, 8) == 1);
  for (int l = 0; l < 32; ++l) a[static_cast<size_t>(l)] = 8 * l * 2;  // every other pair: 2 words per bank
  CHECK(testing::bank_ways(a, 8) == 2);
  for (int l = 0; l < 32; ++l) a[static_cast<size_t>(l)] = l < 16 ? -1 : 4 * 32 * l;  // idle lanes do not count
  CHECK(testing::bank_ways(a, 4) == 16);
}
