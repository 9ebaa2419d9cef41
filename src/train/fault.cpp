// fault.kind = kill | stop; see fault.h.
#include "train/fault.h"

#include <csignal>

#include <spdlog/spdlog.h>

namespace moetrain {

SignalFault::SignalFault(const Config& config, int rank, int world_size) : rank_(rank) {
  const std::string kind = config.get_string("fault.kind");
  if (kind != "kill" && kind != "stop") return;
  const int64_t fault_rank = config.get_int("fault.rank");
  step_ = config.get_int("fault.step");
  if (fault_rank >= world_size)
    config.fail("fault.rank", fmt::format("is not a rank of this run, which has {} rank{}; fault.kind = {} would "
                                          "never fire", world_size, world_size == 1 ? "" : "s", kind));
  if (step_ < 1) config.fail("fault.step", fmt::format("fault.kind = {} needs a step (1-based) to fire at", kind));
  const char* name = kind == "kill" ? "SIGKILL" : "SIGSTOP";
  if (rank == 0)
    spdlog::warn("fault injection (a testing aid): rank {} sends itself {} at the start of step {}", fault_rank, name,
                 step_);
  if (fault_rank == rank) signal_ = kind == "kill" ? SIGKILL : SIGSTOP;
}

void SignalFault::at_step_start(int64_t step) const {
  if (signal_ == 0 || step != step_) return;
  spdlog::warn("fault injection: rank {} sends itself {} at the start of step {}", rank_,
               signal_ == SIGKILL ? "SIGKILL" : "SIGSTOP", step);
  spdlog::default_logger()->flush();
  std::raise(signal_);
}

}  // namespace moetrain
