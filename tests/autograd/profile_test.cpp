// core/profile.h with the autograd engine: nodes carry the Region they were made
// in, their backward is charged there, nested Regions take their own forward time,
// off means nothing is recorded; a device clock (a fake one here, CUDA events in
// the [cuda] case) charges the device's time between marks.
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>

#include "autograd/node.h"
#include "backend/cuda/runtime.h"
#include "core/profile.h"
#include "moetrain.h"
#include "testing.h"

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

namespace {

// A device clock whose time the test sets: each mark reads `now`, then advances it
// by `tick` (so every switch between components costs a known time).
class FakeClock final : public profile::DeviceClock {
 public:
  double now = 0, tick = 0;
  int64_t live = 0, max_live = 0, reads = 0;

  int64_t mark() override {
    times_.push_back(now);
    now += tick;
    max_live = std::max(max_live, ++live);
    return static_cast<int64_t>(times_.size()) - 1;
  }
  std::vector<double> intervals(const std::vector<int64_t>& marks) override {
    ++reads;
    std::vector<double> out;
    for (size_t i = 0; i + 1 < marks.size(); ++i) {
      out.push_back(times_[static_cast<size_t>(marks[i + 1])] - times_[static_cast<size_t>(marks[i])]);
      --live;
    }
    return out;
  }
  void release(int64_t) override { --live; }

 private:
  std::vector<double> times_;
};

double total_s(const std::vector<profile::Entry>& entries) {
  double t = 0;
  for (const profile::Entry& e : entries) t += e.forward_s + e.backward_s;
  return t;
}

struct ClockGuard {
  explicit ClockGuard(profile::DeviceClock* c) { profile::set_device_clock(c); }
  ~ClockGuard() { profile::set_device_clock(nullptr); }
};

}  // namespace

TEST_CASE("profile: a device clock charges each component the device time between its marks",
          "[autograd][profile]") {
  FakeClock clock;
  ClockGuard installed(&clock);
  profile::reset();
  profile::set_enabled(true);
  clock.now += 2;  // outside any region: "other"
  {
    profile::Region a("a");
    clock.now += 3;
    {
      profile::Region b("b");
      clock.now += 5;
    }
    clock.now += 7;  // a again, after b
  }
  clock.now += 11;
  profile::set_enabled(false);
  auto entries = profile::entries();
  const profile::Entry* a = find(entries, "a");
  const profile::Entry* b = find(entries, "b");
  const profile::Entry* other = find(entries, "other");
  REQUIRE(a);
  REQUIRE(b);
  REQUIRE(other);
  CHECK(a->forward_s == 10);
  CHECK(b->forward_s == 5);
  CHECK(other->forward_s == 13);
  CHECK(a->backward_s == 0);
  CHECK(clock.live == 0);  // every mark released once profiling stopped

  // Backward: every switch costs one tick, so each node's scope is charged exactly
  // its tick and the total is conserved.
  Tensor x = randn({8, 8}, DType::f32, 2);
  x.set_requires_grad(true);
  profile::reset();
  clock.tick = 1;
  const double start = clock.now;  // the first mark's time
  profile::set_enabled(true);
  Tensor y;
  {
    profile::Region r("tanh");
    y = tanh(x);
  }
  sum(y).backward();
  profile::set_enabled(false);
  entries = profile::entries();
  const profile::Entry* t = find(entries, "tanh");
  REQUIRE(t);
  CHECK(t->forward_s == 1);
  CHECK(t->backward_s == 1);  // tanh's node: one interval, from its scope's mark to the next
  REQUIRE(find(entries, "autograd"));
  CHECK(total_s(entries) == clock.now - clock.tick - start);  // from the first mark to the last
  CHECK(clock.live == 0);
}

TEST_CASE("profile: a long profile reads its device marks as it goes", "[autograd][profile]") {
  FakeClock clock;
  ClockGuard installed(&clock);
  clock.tick = 0.5;
  profile::reset();
  const double start = clock.now;
  profile::set_enabled(true);
  for (int i = 0; i < 10000; ++i) profile::Region r(i % 2 ? "odd" : "even");
  const auto midway = profile::entries();  // reading while on charges what is recorded so far
  CHECK(total_s(midway) == clock.now - clock.tick - start);  // from the first mark to the last
  profile::set_enabled(false);
  CHECK(clock.max_live <= 4096);
  CHECK(clock.reads >= 4);
  CHECK(clock.live == 0);
  const auto entries = profile::entries();
  CHECK(find(entries, "odd")->forward_s == 5000 * 0.5);
  CHECK(find(entries, "even")->forward_s == 5000 * 0.5);
  CHECK(total_s(entries) == clock.now - clock.tick - start);
}

TEST_CASE("profile: on a GPU the event clock charges each region the device time of its kernels",
          "[autograd][profile][cuda]") {
  if (!testing::gpu_available()) return;
  const Device gpu{DeviceKind::cuda, 0};
  Tensor a = randn({2048, 2048}, DType::f32, 1).to(gpu), b = randn({2048, 2048}, DType::f32, 2).to(gpu);
  auto big = [&] {
    for (int i = 0; i < 4; ++i) a = tanh(matmul(a, b));
  };
  auto small = [&] { b = add(b, b); };
  big();  // warm-up: cuBLAS handles, allocator blocks
  small();
  cuda::synchronize(0);
  cuda::EventTimer timer(0);
  timer.start();
  big();
  small();
  const double alone_s = timer.stop_ms() * 1e-3;

  ClockGuard installed(cuda::event_clock(0));
  profile::reset();
  profile::set_enabled(true);
  {
    profile::Region r("big");
    big();
  }
  {
    profile::Region r("small");
    small();
  }
  profile::set_enabled(false);
  const auto entries = profile::entries();
  const profile::Entry* e_big = find(entries, "big");
  const profile::Entry* e_small = find(entries, "small");
  REQUIRE(e_big);
  REQUIRE(e_small);
  // Host launch times would be microseconds for both; the device's are the kernels'.
  CHECK(e_big->forward_s > 10 * e_small->forward_s);
  CHECK(e_big->forward_s + e_small->forward_s > 0.5 * alone_s);
  CHECK(e_big->forward_s + e_small->forward_s < 2.0 * alone_s);
}
