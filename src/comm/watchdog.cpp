// The collective watchdog; see watchdog.h. The published state is a handful of
// process-wide atomics (trivially destructible, so valid until the process
// ends); the monitor reads them without locks.
#include "comm/watchdog.h"

#include <algorithm>
#include <atomic>
#include <chrono>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "comm/communicator.h"
#include "core/error.h"

namespace moetrain::comm {

namespace {

std::atomic<bool> g_running{false};
// Steady-clock nanoseconds at which the current wait began; 0 = not waiting.
std::atomic<int64_t> g_wait_start_ns{0};
std::atomic<const char*> g_op{nullptr};
std::atomic<const char*> g_label{nullptr};
std::atomic<int64_t> g_step{0};

int64_t now_ns() {
  const auto t = std::chrono::steady_clock::now().time_since_epoch();
  return std::max<int64_t>(1, std::chrono::duration_cast<std::chrono::nanoseconds>(t).count());
}

void end_job(const std::string& message) {
  spdlog::error("{}", message);
  spdlog::default_logger()->flush();
  abort_job(kExitWatchdog);
}

}  // namespace

Watchdog::Watchdog(WatchdogOptions options) : options_(std::move(options)) {
  MT_CHECK(options_.timeout_s > 0, "watchdog: timeout {} s; it must be positive (dist.timeout_s = 0 turns it off)",
           options_.timeout_s);
  MT_ASSERT(!g_running.exchange(true), "a second watchdog was started while one runs");
  if (!options_.on_timeout) options_.on_timeout = end_job;
  g_step.store(0, std::memory_order_relaxed);
  thread_ = std::thread([this] { monitor(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_one();
  thread_.join();
  g_running.store(false);
}

void Watchdog::monitor() {
  // A few checks per timeout: the job ends within about 1.1 x the timeout.
  const auto poll = std::chrono::duration<double>(std::clamp(options_.timeout_s / 10, 0.01, 1.0));
  std::unique_lock lock(mutex_);
  while (!wake_.wait_for(lock, poll, [this] { return stop_; })) {
    const int64_t start = g_wait_start_ns.load(std::memory_order_acquire);
    if (start == 0) continue;
    const char* op = g_op.load(std::memory_order_relaxed);
    const char* label = g_label.load(std::memory_order_relaxed);
    const int64_t step = g_step.load(std::memory_order_relaxed);
    if (g_wait_start_ns.load(std::memory_order_acquire) != start) continue;  // that wait ended meanwhile
    const double waited = static_cast<double>(now_ns() - start) * 1e-9;
    if (waited <= options_.timeout_s) continue;
    const std::string message = fmt::format(
        "watchdog: rank {} of {} (host {}) has waited {:.1f} s in {}{} {} (dist.timeout_s = {:g}): another rank is "
        "hung, dead or slower than the timeout; ending the job (exit code {})",
        options_.rank, options_.size, options_.host, waited, op ? op : "?",
        label ? fmt::format(" ({})", label) : std::string(),
        step > 0 ? fmt::format("at step {}", step) : std::string("before step 1"), options_.timeout_s, kExitWatchdog);
    lock.unlock();
    options_.on_timeout(message);
    return;  // once
  }
}

void set_watchdog_step(int64_t step) { g_step.store(step, std::memory_order_relaxed); }

WatchdogWait::WatchdogWait(const char* op) noexcept {
  if (!g_running.load(std::memory_order_relaxed)) return;
  g_op.store(op, std::memory_order_relaxed);
  g_wait_start_ns.store(now_ns(), std::memory_order_release);
}

WatchdogWait::~WatchdogWait() { g_wait_start_ns.store(0, std::memory_order_release); }

WatchdogLabel::WatchdogLabel(const char* label) noexcept : previous_(g_label.load(std::memory_order_relaxed)) {
  g_label.store(label, std::memory_order_relaxed);
}

WatchdogLabel::~WatchdogLabel() { g_label.store(previous_, std::memory_order_relaxed); }

}  // namespace moetrain::comm
