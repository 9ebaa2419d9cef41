// Stop signals: what SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 do to a
// moetrain process (docs/checkpoints.md, "Signals"; exit codes in
// docs/troubleshooting.md).
//
// main installs the handlers first thing, before any config is read, so no stop
// signal kills a process on its own. The handlers only note the signal; code
// acts on it at safe points:
//   * training: at the next step boundary every rank saves a checkpoint
//     (collectively) and exits: 0 after SIGUSR1 ("save and exit"), 75
//     (kExitPreempted) after the others ("preempted: resume with the same command
//     and ckpt.resume: auto");
//   * before training starts: the trainer stops at its next safe point with an
//     Interrupted error (the same codes), having written nothing;
//   * other commands have nothing to save: they go back to the default actions
//     (restore_default_actions), a noted signal included.
// While a checkpoint is being written (SaveGuard) further signals are only
// noted: the save finishes. Outside a save the third SIGTERM/SIGINT/SIGHUP ends
// the process at once with the default action (exit 128 + signal), for a user
// who does not want to wait for the step to end.
#pragma once

#include <string>

#include "core/error.h"

namespace moetrain {

// A signal that asks to stop arrived before training started.
class Interrupted : public Error {
 public:
  Interrupted(const std::string& what, int exit_code) : Error(what), exit_code_(exit_code) {}
  int exit_code() const { return exit_code_; }

 private:
  int exit_code_;
};

// "Preempted, checkpoint saved (or nothing begun): run the same command again"
// (sysexits.h's EX_TEMPFAIL).
inline constexpr int kExitPreempted = 75;

namespace signals {

// What the signals noted so far ask for, weakest first. SIGUSR1 asks to save and
// exit; SIGTERM, SIGINT, SIGHUP and SIGUSR2 say the job is being taken away.
enum class Stop : int { none = 0, save_and_exit = 1, preempted = 2 };

// Installs the handlers (once; later calls do nothing).
void install();
// Back to the default actions; a signal noted before is raised again now.
void restore_default_actions();

// The strongest stop noted so far, and the first signal that asked for it
// (0 when none).
Stop requested();
int first_signal();
// "SIGTERM"
std::string name(int signal);
// The exit code of a run that stopped for `stop`: 0 or kExitPreempted.
int exit_code(Stop stop);

// Throws Interrupted ("interrupted by SIGTERM <doing>; nothing was written; ...")
// when a signal has been noted. The trainer's safe points before step 1.
void throw_if_requested(const std::string& doing);

// While one lives, stop signals are only noted (a checkpoint is being written).
class SaveGuard {
 public:
  SaveGuard();
  ~SaveGuard();
  SaveGuard(const SaveGuard&) = delete;
  SaveGuard& operator=(const SaveGuard&) = delete;
};

// Tests only: forgets what was noted.
void reset_for_testing();

}  // namespace signals
}  // namespace moetrain
