// The collective watchdog without MPI: waits published by WatchdogWait, with a
// tiny timeout and an injected action in place of ending the job.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <future>
#include <string>
#include <thread>

#include "comm/watchdog.h"

using namespace moetrain;
using namespace std::chrono_literals;

namespace {

// Counts the firings and hands the first message to a future.
struct Recorder {
  std::atomic<int> fired{0};
  std::promise<std::string> first;
  std::function<void(const std::string&)> action() {
    return [this](const std::string& message) {
      if (fired++ == 0) first.set_value(message);
    };
  }
};

}  // namespace

TEST_CASE("watchdog: a wait longer than the timeout fires once, naming rank, host, operation, label and step",
          "[comm][watchdog]") {
  Recorder r;
  std::future<std::string> message = r.first.get_future();
  {
    comm::Watchdog dog({.timeout_s = 0.05, .rank = 2, .size = 4, .host = "node7", .on_timeout = r.action()});
    comm::set_watchdog_step(37);
    comm::WatchdogLabel outer("gradient sync");
    {
      comm::WatchdogLabel inner("expert dispatch");  // the innermost label is shown, then the outer one again
    }
    comm::WatchdogWait wait("all_reduce_sum");
    REQUIRE(message.wait_for(10s) == std::future_status::ready);
    std::this_thread::sleep_for(200ms);  // still waiting: no second firing
  }
  const std::string m = message.get();
  INFO(m);
  CHECK(m.rfind("watchdog: rank 2 of 4 (host node7) has waited 0.", 0) == 0);
  CHECK(m.find(" s in all_reduce_sum (gradient sync) at step 37 (dist.timeout_s = 0.05): another rank is hung") !=
        std::string::npos);
  CHECK(m.find("ending the job (exit code 42)") != std::string::npos);
  CHECK(r.fired == 1);
}

TEST_CASE("watchdog: short waits and time outside waits do not fire; before step 1 is named", "[comm][watchdog]") {
  Recorder r;
  std::future<std::string> message = r.first.get_future();
  {
    comm::Watchdog dog({.timeout_s = 0.5, .rank = 0, .size = 2, .host = "h", .on_timeout = r.action()});
    for (int i = 0; i < 20; ++i) {
      comm::WatchdogWait wait("barrier");
      std::this_thread::sleep_for(1ms);
    }
    std::this_thread::sleep_for(1s);  // twice the timeout outside any wait
    CHECK(r.fired == 0);
    comm::WatchdogWait wait("split");  // the constructor reset the step: before the first one
    REQUIRE(message.wait_for(10s) == std::future_status::ready);
  }
  const std::string m = message.get();
  INFO(m);
  CHECK(m.find(" s in split before step 1 (dist.timeout_s = 0.5)") != std::string::npos);
}

TEST_CASE("watchdog: stopping it is prompt and another can start", "[comm][watchdog]") {
  Recorder r;
  for (int i = 0; i < 2; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    { comm::Watchdog dog({.timeout_s = 60, .rank = 0, .size = 1, .host = "h", .on_timeout = r.action()}); }
    CHECK(std::chrono::steady_clock::now() - t0 < 2s);  // the monitor polls every second but wakes on stop
  }
  CHECK(r.fired == 0);
}
