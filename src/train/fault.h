// Signal faults for the fault-handling tests (a testing aid; docs/distributed.md,
// "Faults and exit codes"): fault.kind = kill or stop makes rank fault.rank send
// itself SIGKILL (a dead rank) or SIGSTOP (a hung rank) at the start of step
// fault.step. nan_grad lives in the trainer, kill_during_ckpt in the checkpoint
// code.
#pragma once

#include <cstdint>

#include "config/config.h"

namespace moetrain {

class SignalFault {
 public:
  // Off unless fault.kind is kill or stop; then fault.rank must be a rank of
  // this run and fault.step at least 1 (else a ConfigError naming the key). The
  // root warns once that a fault is armed.
  SignalFault(const Config& config, int rank, int world_size);
  // Raises the signal when this is the faulty rank and `step` (1-based) is fault.step.
  void at_step_start(int64_t step) const;

 private:
  int signal_ = 0;  // 0: off (or another rank's fault)
  int rank_ = 0;
  int64_t step_ = 0;
};

}  // namespace moetrain
