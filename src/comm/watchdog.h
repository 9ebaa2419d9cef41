// The collective watchdog (dist.timeout_s): ends a job whose collective waits
// too long, because a peer is hung (stopped, deadlocked, blocked outside MPI)
// or dead in a way the launcher does not see. Without it Open MPI waits forever.
//
// Every blocking MPI call (src/comm/mpi.cpp) runs inside a WatchdogWait naming
// the operation; callers may name what the collective is for with a
// WatchdogLabel ("gradient sync", "expert dispatch"), and the trainer publishes
// the step. A monitor thread (one per process, while a Watchdog exists) checks
// ten times per timeout whether the current wait has lasted longer than the
// timeout (as timed by the monitor, from when it first saw the wait: to within
// a tenth of the timeout); then it logs one line, from this rank,
//
//   watchdog: rank 2 of 4 (host node7) has waited 10.0 s in all_reduce_sum
//   (gradient sync) at step 37 (dist.timeout_s = 10): ...; ending the job (exit code 42)
//
// and ends the whole job: comm::abort_job(42), i.e. MPI_Abort, called from the
// monitor thread while the main thread is blocked in MPI. Open MPI 4.1 kills
// every rank then, a SIGSTOPped one too (docs/distributed.md, measured).
//
// Cost on the hot path: a wait is two atomic stores (relaxed, release) on entry
// and one on exit; a label a load and a store, and a store on exit. No locks,
// no clock read (a few ns in all). Only the
// thread that calls MPI (the main thread, MPI_THREAD_FUNNELED) publishes waits,
// so one slot suffices; waits do not nest. Names and labels must be string
// literals (or otherwise outlive the process): the monitor reads the pointers.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace moetrain::comm {

struct WatchdogOptions {
  double timeout_s = 600;  // a wait longer than this ends the job (> 0)
  int rank = 0, size = 1;  // in the world, for the message
  std::string host;
  // Called once, on the monitor thread, with the message line. Empty: log it
  // (spdlog error) and comm::abort_job(kExitWatchdog). Tests inject their own.
  std::function<void(const std::string&)> on_timeout;
};

// The monitor thread, from construction to destruction (which stops and joins
// it). One at a time per process. Construction resets the published step to 0.
class Watchdog {
 public:
  explicit Watchdog(WatchdogOptions options);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

 private:
  void monitor();

  WatchdogOptions options_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

// The step the trainer is in (1-based; 0 = before the first step).
void set_watchdog_step(int64_t step);

// A blocking collective: `op` from construction to destruction. Does not nest.
class WatchdogWait {
 public:
  explicit WatchdogWait(const char* op) noexcept;
  ~WatchdogWait();
  WatchdogWait(const WatchdogWait&) = delete;
  WatchdogWait& operator=(const WatchdogWait&) = delete;
};

// What the collectives in this scope are for; nests (the innermost is shown).
class WatchdogLabel {
 public:
  explicit WatchdogLabel(const char* label) noexcept;
  ~WatchdogLabel();
  WatchdogLabel(const WatchdogLabel&) = delete;
  WatchdogLabel& operator=(const WatchdogLabel&) = delete;

 private:
  const char* previous_;
};

}  // namespace moetrain::comm
