// Where a step's time goes, by component. Code marks a component with a Region
// ("kda", "moe", ...); while profiling is on, a Region adds its forward time
// (exclusive of Regions nested in it) to its name, every autograd node records the
// Region it was created in, and the engine adds the time of that node's backward
// to the same name. Time outside any Region counts as "other". Times are the
// host's clock, or the device's where a DeviceClock is installed (below). Off by
// default: then a Region costs one branch and nodes record the name only.
// Single-threaded bookkeeping: Regions are entered by the thread that drives the
// model (kernels may still use OpenMP inside them).
// In core/ because backend/, below autograd/, reads it too: the CUDA allocator
// (backend/cuda/runtime.cpp) tags each block it hands out with the current Region.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moetrain::profile {

void set_enabled(bool on);
bool enabled();

// The innermost Region's name ("other" outside any).
const char* current_region();

class Region {
 public:
  explicit Region(const char* name);
  ~Region();
  Region(const Region&) = delete;
  Region& operator=(const Region&) = delete;

 private:
  const char* saved_;  // the enclosing region's name
  const char* saved_target_;  // what was charged before: a region's forward or backward
  bool saved_backward_;
};

// Backward time: the autograd engine opens a BackwardScope("autograd") around a
// backward pass (its wall time is not forward time of the region that called
// backward()) and a BackwardScope(node's region) around each node's backward, so
// a node's time goes to the region it was made in and the pass's time outside
// nodes to "autograd".
class BackwardScope {
 public:
  explicit BackwardScope(const char* region);
  ~BackwardScope();
  BackwardScope(const BackwardScope&) = delete;
  BackwardScope& operator=(const BackwardScope&) = delete;

 private:
  const char* saved_region_;
  bool saved_backward_;
};

// Where the work runs asynchronously (CUDA kernels on a stream), the host's clock
// times the launches, not the work. A backend may install a DeviceClock: while
// one is installed, each switch between components records a mark behind the
// work queued so far, and each component is charged the device time between its
// marks, read when profiling is switched off or the entries are read (and every
// few thousand marks, so a long profile holds few). docs/training.md, train.profile.
class DeviceClock {
 public:
  virtual ~DeviceClock() = default;
  // Records a mark behind the work queued so far; returns its handle.
  virtual int64_t mark() = 0;
  // Waits for the marks and returns the seconds between consecutive ones
  // (marks.size() - 1 values). Every handle but the last is released.
  virtual std::vector<double> intervals(const std::vector<int64_t>& marks) = 0;
  virtual void release(int64_t mark) = 0;
};
// nullptr (the default): the host's steady clock. Set while profiling is off.
void set_device_clock(DeviceClock* clock);
DeviceClock* device_clock();

struct Entry {
  std::string region;
  double forward_s = 0, backward_s = 0;
};
// Accumulated times, in the order the regions were first seen.
std::vector<Entry> entries();
void reset();
// A table of `entries` per step (times divided by `steps`): component, forward,
// backward and total ms, share of the total; one line per row, no trailing newline.
std::string format_table(const std::vector<Entry>& entries, int64_t steps);

}  // namespace moetrain::profile
