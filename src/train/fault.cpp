// fault.*: see fault.h.
#include "train/fault.h"

#include <unistd.h>

#include <cmath>
#include <csignal>

#include <spdlog/spdlog.h>

#include "core/signals.h"
#include "ops/elementwise/elementwise.h"

namespace moetrain {

namespace {

int parse_signal(const std::string& name) {
  if (name == "TERM") return SIGTERM;
  if (name == "INT") return SIGINT;
  if (name == "HUP") return SIGHUP;
  if (name == "USR1") return SIGUSR1;
  return SIGUSR2;
}

CheckpointKillPoint parse_phase(const std::string& phase) {
  if (phase == "before_commit") return CheckpointKillPoint::before_commit;
  if (phase == "before_rename") return CheckpointKillPoint::before_rename;
  return CheckpointKillPoint::before_latest;
}

}  // namespace

FaultPlan FaultPlan::from(const Config& config, int rank, int world_size) {
  FaultPlan f;
  const std::string kind = config.get_string("fault.kind");
  if (kind == "none") return f;
  f.kind_ = kind == "nan_grad" ? Kind::nan_grad
            : kind == "kill"   ? Kind::kill
            : kind == "stop"   ? Kind::stop
            : kind == "signal" ? Kind::signal
                               : Kind::kill_during_ckpt;
  f.rank_ = static_cast<int>(config.get_int("fault.rank"));
  f.step_ = config.get_int("fault.step");
  f.on_this_rank_ = f.rank_ == rank;
  const std::string at = config.get_string("fault.signal_at");
  f.signal_at_ = at == "startup" ? At::startup : at == "save" ? At::save : At::step;
  f.signal_ = parse_signal(config.get_string("fault.signal"));
  f.signal_count_ = config.get_int("fault.signal_count");
  if (f.kind_ == Kind::kill_during_ckpt) f.phase_ = parse_phase(config.get_string("fault.phase"));
  if (f.rank_ >= world_size)
    config.fail("fault.rank", fmt::format("is not a rank of this run, which has {} rank{}; fault.kind = {} would "
                                          "never fire", world_size, world_size == 1 ? "" : "s", kind));
  const bool needs_step = f.kind_ != Kind::signal || f.signal_at_ != At::startup;
  if (needs_step && f.step_ < 1)
    config.fail("fault.step", fmt::format("fault.kind = {} needs a step (1-based) to fire at", kind));
  if (f.kind_ == Kind::kill_during_ckpt && f.phase_ != CheckpointKillPoint::before_commit && f.rank_ != 0)
    config.fail("fault.rank", fmt::format("fault.phase {} happens on rank 0 only; set fault.rank: 0",
                                          config.get_string("fault.phase")));
  if (rank != 0) return f;
  switch (f.kind_) {
    case Kind::nan_grad:
      spdlog::warn("fault injection (a testing aid): NaN gradient on rank {} at step {}", f.rank_, f.step_);
      break;
    case Kind::kill:
    case Kind::stop:
      spdlog::warn("fault injection (a testing aid): rank {} sends itself {} at the start of step {}", f.rank_,
                   f.kind_ == Kind::kill ? "SIGKILL" : "SIGSTOP", f.step_);
      break;
    case Kind::kill_during_ckpt:
      spdlog::warn("fault injection (a testing aid): SIGKILL on rank {} while saving the checkpoint of step {} ({})",
                   f.rank_, f.step_, config.get_string("fault.phase"));
      break;
    case Kind::signal:
      spdlog::warn("fault injection (a testing aid): rank {} sends itself {} x{} {}", f.rank_,
                   signals::name(f.signal_), f.signal_count_,
                   f.signal_at_ == At::startup ? std::string("during start-up")
                   : f.signal_at_ == At::save  ? fmt::format("while saving the checkpoint of step {}", f.step_)
                                               : fmt::format("at the start of step {}", f.step_));
      break;
    case Kind::none: break;
  }
  return f;
}

void FaultPlan::raise_signal(const char* where) const {
  spdlog::warn("fault injection: rank {} sends itself {} x{} {}", rank_, signals::name(signal_), signal_count_, where);
  for (int64_t i = 0; i < signal_count_; ++i) ::kill(::getpid(), signal_);
}

void FaultPlan::at_startup() const {
  if (kind_ == Kind::signal && signal_at_ == At::startup && on_this_rank_) raise_signal("during start-up");
}

void FaultPlan::at_step_start(int64_t step) const {
  if (!mine(step)) return;
  if (kind_ == Kind::signal && signal_at_ == At::step) raise_signal(fmt::format("at the start of step {}", step).c_str());
  if (kind_ != Kind::kill && kind_ != Kind::stop) return;
  const int sig = kind_ == Kind::kill ? SIGKILL : SIGSTOP;
  spdlog::warn("fault injection: rank {} sends itself {} at the start of step {}", rank_,
               sig == SIGKILL ? "SIGKILL" : "SIGSTOP", step);
  spdlog::default_logger()->flush();
  std::raise(sig);
}

void FaultPlan::after_backward(int64_t step, const ParameterList& params) const {
  if (kind_ != Kind::nan_grad || !mine(step)) return;
  for (const NamedParameter& p : params)
    if (p.tensor.grad().defined()) {
      fill_(p.tensor.grad(), std::nan(""));
      return;
    }
}

SaveOptions FaultPlan::save_options(int64_t step, SaveOptions options) const {
  if (!mine(step)) return options;
  if (kind_ == Kind::kill_during_ckpt) options.kill_at = phase_;
  if (kind_ == Kind::signal && signal_at_ == At::save)
    options.after_rank_file = [this, step] {
      raise_signal(fmt::format("while saving the checkpoint of step {}", step).c_str());
    };
  return options;
}

}  // namespace moetrain
