// The collective watchdog; see watchdog.h. The published state is a handful of
// process-wide atomics (trivially destructible, so valid until the process
// ends); the monitor reads them without locks. A wait publishes an id, not a
// time (no clock read on the hot path): the monitor times an id from when it
// first sees it, so it measures at least the wait minus one poll interval.
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
// The current wait: a new id per wait, 0 = not waiting.
std::atomic<uint64_t> g_wait_id{0};
// Ids of the thread that publishes (the MPI thread).
thread_local uint64_t t_last_wait_id = 0;
std::atomic<const char*> g_op{nullptr};
std::atomic<const char*> g_label{nullptr};
std::atomic<int64_t> g_step{0};

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
  // Ten checks per timeout (10 ms to 1 s apart): a wait is first seen within a
  // poll of its start and reported within another, so the job ends between 1
  // and 1.2 x the timeout after the wait began.
  using Clock = std::chrono::steady_clock;
  const auto poll = std::chrono::duration<double>(std::clamp(options_.timeout_s / 10, 0.01, 1.0));
  uint64_t seen_id = 0;
  Clock::time_point seen_at;
  std::unique_lock lock(mutex_);
  while (!wake_.wait_for(lock, poll, [this] { return stop_; })) {
    const uint64_t id = g_wait_id.load(std::memory_order_acquire);
    if (id != seen_id) {
      seen_id = id;
      seen_at = Clock::now();
      continue;
    }
    if (id == 0) continue;
    const char* op = g_op.load(std::memory_order_relaxed);
    const char* label = g_label.load(std::memory_order_relaxed);
    const int64_t step = g_step.load(std::memory_order_relaxed);
    if (g_wait_id.load(std::memory_order_acquire) != id) continue;  // that wait ended meanwhile
    const double waited = std::chrono::duration<double>(Clock::now() - seen_at).count();
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
  g_op.store(op, std::memory_order_relaxed);
  g_wait_id.store(++t_last_wait_id, std::memory_order_release);
}

WatchdogWait::~WatchdogWait() { g_wait_id.store(0, std::memory_order_release); }

WatchdogLabel::WatchdogLabel(const char* label) noexcept : previous_(g_label.load(std::memory_order_relaxed)) {
  g_label.store(label, std::memory_order_relaxed);
}

WatchdogLabel::~WatchdogLabel() { g_label.store(previous_, std::memory_order_relaxed); }

}  // namespace moetrain::comm
