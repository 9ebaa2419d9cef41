// Fault injection for the fault tests (a testing aid, off by default;
// docs/distributed.md, "Faults and exit codes"): one fault.kind on rank
// fault.rank at step fault.step (1-based), consulted by the trainer at named
// points:
//   nan_grad          after backward: a NaN in this rank's first gradient
//   kill, stop        at the start of the step: SIGKILL (a dead rank) or SIGSTOP
//                     (a hung rank) to itself
//   kill_during_ckpt  inside the save of that step: SIGKILL at fault.phase
//   signal            fault.signal to itself, fault.signal_count times, at
//                     fault.signal_at: startup (while the trainer sets up, before
//                     step 1), step (the start of step fault.step) or save (inside
//                     the save of step fault.step, once this rank's file is
//                     written)
#pragma once

#include <cstdint>
#include <string>

#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "nn/parameters.h"

namespace moetrain {

class FaultPlan {
 public:
  FaultPlan() = default;  // no fault
  // Checks the keys (fault.rank a rank of the run, a step to fire at, phases that
  // exist on that rank; ConfigError naming the key) and warns on the root that
  // a fault is armed.
  static FaultPlan from(const Config& config, int rank, int world_size);

  void at_startup() const;
  void at_step_start(int64_t step) const;
  // Whether some rank writes a NaN into its gradients after this step's backward
  // (every rank knows: the overlapped gradient sync is left out of that step).
  bool corrupts_gradients(int64_t step) const { return kind_ == Kind::nan_grad && step == step_; }
  void after_backward(int64_t step, const ParameterList& params) const;
  // What the save of `step` does on this rank: the kill point and the hook run
  // once this rank's file is written.
  SaveOptions save_options(int64_t step, SaveOptions options) const;

 private:
  enum class Kind { none, nan_grad, kill, stop, kill_during_ckpt, signal };
  enum class At { startup, step, save };
  bool mine(int64_t step) const { return on_this_rank_ && step == step_; }
  void raise_signal(const char* where) const;

  Kind kind_ = Kind::none;
  bool on_this_rank_ = false;
  int rank_ = 0;
  int64_t step_ = 0;
  CheckpointKillPoint phase_ = CheckpointKillPoint::none;
  int signal_ = 0;
  int64_t signal_count_ = 1;
  At signal_at_ = At::step;
};

}  // namespace moetrain
