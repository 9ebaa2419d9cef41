// The pinned staging ring's bookkeeping (backend/cuda/staging_ring.h) with fake
// tokens, and on a GPU the copies that go through it and PendingCopy.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "backend/cuda/pending_copy.h"
#include "backend/cuda/runtime.h"
#include "backend/cuda/staging_ring.h"
#include "moetrain.h"
#include "testing.h"

using namespace moetrain;
using cuda::StagingRing;

TEST_CASE("staging ring: regions follow each other, wrap at the end and wait only for what they overlap",
          "[backend][staging]") {
  StagingRing<int> ring(1024);
  std::vector<int> retired;
  auto retire = [&](int t) { retired.push_back(t); };
  CHECK(ring.acquire(100, retire) == 0);
  ring.push(0, 100, 1);
  CHECK(ring.acquire(200, retire) == 128);  // after the first, on a 64-byte boundary
  ring.push(128, 200, 2);
  CHECK(ring.acquire(600, retire) == 384);
  ring.push(384, 600, 3);
  CHECK(retired.empty());
  CHECK(ring.in_flight() == 3);
  // 100 more bytes would pass the end (head 1024 wraps to 0): region 1 is in the way.
  CHECK(ring.acquire(100, retire) == 0);
  CHECK(retired == std::vector<int>{1});
  ring.push(0, 100, 4);
  // 300 bytes at 128 overlap regions 2 and 3: both retire, oldest first; 4 stays.
  CHECK(ring.acquire(300, retire) == 128);
  CHECK(retired == std::vector<int>{1, 2, 3});
  CHECK(ring.in_flight() == 1);
  // The whole ring: everything in flight retires.
  ring.push(128, 300, 5);
  CHECK(ring.acquire(1024, retire) == 0);
  CHECK(retired == std::vector<int>{1, 2, 3, 4, 5});
  CHECK(ring.in_flight() == 0);
  CHECK_THROWS_WITH(ring.acquire(1025, retire), Catch::Contains("1025 bytes in a ring of 1024"));
  CHECK_THROWS_WITH(StagingRing<int>(1000), Catch::Contains("multiple of 64"));
}

TEST_CASE("staging ring: reap drops passed regions oldest first and stops at the first still in flight",
          "[backend][staging]") {
  StagingRing<int> ring(4096);
  auto none = [](int) { FAIL("nothing should wait"); };
  for (int t = 1; t <= 4; ++t) ring.push(ring.acquire(500, none), 500, t);
  std::set<int> passed = {1, 3};  // 3 has passed but 2 has not: 3 stays behind 2
  std::vector<int> dropped;
  ring.reap([&](int t) {
    if (!passed.count(t)) return false;
    dropped.push_back(t);
    return true;
  });
  CHECK(dropped == std::vector<int>{1});
  CHECK(ring.in_flight() == 3);
  passed.insert(2);
  ring.reap([&](int t) {
    if (!passed.count(t)) return false;
    dropped.push_back(t);
    return true;
  });
  CHECK(dropped == std::vector<int>{1, 2, 3});
  CHECK(ring.in_flight() == 1);
}

// A random run: no two live regions ever share a byte, each region's bytes are
// intact until it is retired (the GPU would still be reading them), and a request
// waits only when the space it was given was still in flight.
TEST_CASE("staging ring: random sizes never hand out bytes still in flight", "[backend][staging]") {
  constexpr int64_t cap = 8192;
  StagingRing<int> ring(cap);
  std::vector<unsigned char> mem(cap, 0);
  struct Live {
    int64_t at, bytes;
    unsigned char fill;
  };
  std::vector<std::pair<int, Live>> live;  // token -> region, oldest first
  std::mt19937 rng(7);
  int retires = 0;
  for (int t = 1; t <= 2000; ++t) {
    const int64_t bytes = std::uniform_int_distribution<int64_t>(1, cap / 3)(rng);
    const int64_t at = ring.acquire(bytes, [&](int token) {
      REQUIRE(!live.empty());
      REQUIRE(live.front().first == token);  // oldest first
      const Live& r = live.front().second;
      for (int64_t i = 0; i < r.bytes; ++i) REQUIRE(mem[static_cast<size_t>(r.at + i)] == r.fill);
      live.erase(live.begin());
      ++retires;
    });
    REQUIRE(at >= 0);
    REQUIRE(at % StagingRing<int>::kAlign == 0);
    REQUIRE(at + bytes <= cap);
    for (const auto& [token, r] : live) REQUIRE((r.at + r.bytes <= at || at + bytes <= r.at));
    const auto fill = static_cast<unsigned char>(t % 251 + 1);
    std::memset(mem.data() + at, fill, static_cast<size_t>(bytes));
    ring.push(at, bytes, t);
    live.push_back({t, {at, bytes, fill}});
    if (t % 7 == 0)  // some regions pass on their own
      ring.reap([&](int token) {
        if (live.front().first != token || token % 2) return false;
        live.erase(live.begin());
        return true;
      });
  }
  CHECK(retires > 100);
  CHECK(ring.in_flight() == live.size());
}

TEST_CASE("staging ring: copies to the GPU return before the GPU is done and still arrive intact",
          "[backend][staging][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  // Many small copies whose sources change right after each call, then one read back.
  std::vector<Tensor> on_gpu;
  std::vector<std::vector<float>> expected;
  std::vector<float> src(5000);
  for (int i = 0; i < 3000; ++i) {  // 60 MB in all: the 32 MiB ring wraps
    for (size_t j = 0; j < src.size(); ++j) src[j] = static_cast<float>(i * 7 + static_cast<int>(j));
    Tensor host = empty({static_cast<int64_t>(src.size())}, DType::f32);
    std::copy(src.begin(), src.end(), host.data<float>());
    on_gpu.push_back(host.to(kCuda));
    std::fill(host.data<float>(), host.data<float>() + src.size(), -1.0f);  // the source may change at once
    if (i % 500 == 0) expected.push_back(src);
  }
  for (size_t i = 0, e = 0; i < on_gpu.size(); i += 500, ++e) {
    const Tensor back = on_gpu[i].to(kCpu);
    REQUIRE(std::equal(expected[e].begin(), expected[e].end(), back.data<float>()));
  }
  // A copy larger than the staged limit takes the waiting path and arrives too.
  Tensor big = randn({3'000'000}, DType::f32, 5);
  CHECK(testing::rel_error(big.to(kCuda).to(kCpu), big) == 0.0);
}

TEST_CASE("PendingCopy: device bytes arrive in pinned memory; blocks are reused after release",
          "[backend][staging][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  Tensor x = randn({1000}, DType::f32, 3).to(kCuda);
  Tensor y = randn({70000}, DType::f32, 4).to(kCuda);
  const Tensor hx = x.to(kCpu), hy = y.to(kCpu);
  {
    cuda::PendingCopy a(x.raw_data(), 1000 * 4, 0);
    cuda::PendingCopy b(y.raw_data(), 70000 * 4, 0);  // alive together: two blocks
    CHECK(std::memcmp(a.wait(), hx.raw_data(), 4000) == 0);
    CHECK(std::memcmp(b.wait(), hy.raw_data(), 280000) == 0);
    CHECK(a.wait() != b.wait());
  }
  // One after another: the block just returned is taken again every time.
  std::set<const void*> blocks;
  for (int i = 0; i < 20; ++i) {
    cuda::PendingCopy c(x.raw_data(), 1000 * 4, 0);
    blocks.insert(c.wait());
    REQUIRE(std::memcmp(c.wait(), hx.raw_data(), 4000) == 0);
  }
  CHECK(blocks.size() == 1);
}
