// Where a step's time goes, by component. Code marks a component with a Region
// ("kda", "moe", ...); while profiling is on, a Region adds its forward wall time
// (exclusive of Regions nested in it) to its name, every autograd node records the
// Region it was created in, and the engine adds the time of that node's backward
// to the same name. Time outside any Region counts as "other". Off by default:
// then a Region costs one branch and nodes record the name only.
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
  const char* saved_;
  bool timed_;
};

// The autograd engine wraps a backward pass in a BackwardPass (its wall time is
// not forward time of the region that called backward()) and reports each node's
// backward; the pass's time outside nodes counts as "autograd".
class BackwardPass {
 public:
  BackwardPass();
  ~BackwardPass();
  BackwardPass(const BackwardPass&) = delete;
  BackwardPass& operator=(const BackwardPass&) = delete;

 private:
  bool timed_;
  double nodes_s_at_start_;
};
void add_backward(const char* region, double seconds);

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
