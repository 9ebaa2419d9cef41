// Stop signals end to end (core/signals.h, docs/checkpoints.md "Signals"): each
// of SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 at start-up (the run ends at
// once, nothing written), mid-run (a checkpoint at the step boundary, exit 0 for
// SIGUSR1 and 75 for the others, and the rerun continues bit for bit) and during
// a save (the save finishes first), on one process and under mpirun -np 2; real
// signals from outside to the process, to mpirun and to launch/mpirun.sh. A tiny
// byte-level GPT-2, one thread per rank. Deterministic cases send the signal
// from inside (fault.kind signal, a testing aid) at a named point.
#include <catch2/catch.hpp>

#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "testing.h"

using moetrain::testing::kLocalMpirun;
using moetrain::testing::metrics_history;
using moetrain::testing::TempDir;
using std::string;
namespace fs = std::filesystem;

namespace {

using Result = moetrain::testing::CommandOutput;

struct Job {
  TempDir tmp;
  string dir = tmp.path();

  Job() { moetrain::testing::prepare_byte_shards(dir); }
  string train_args(const string& run, int steps) const {
    return moetrain::testing::tiny_gpt2_train_args(dir, dir + "/" + run, steps);
  }
  string moetrain() const { return string(MOETRAIN_BINARY_DIR) + "/moetrain "; }
  Result train(const string& run, int steps, const string& extra = "") const {
    return moetrain::testing::run_moetrain(train_args(run, steps) + " " + extra);
  }
  Result mpirun(const string& run, int steps, const string& extra = "") const {
    return moetrain::testing::capture_command(string(kLocalMpirun) + "-np 2 " + moetrain() + train_args(run, steps) +
                                              " " + extra + " < /dev/null");
  }
  // Starts `command` in the background, sends it `signal` (to the process group
  // when `group`) once <run>/metrics.jsonl has `records` lines, and waits: the
  // exit code (as "rc=N") and the log.
  Result signal_mid_run(const string& command, const string& run, const string& signal, bool group = false) const {
    const string metrics = dir + "/" + run + "/metrics.jsonl", log = dir + "/" + run + ".log";
    Result r = moetrain::testing::capture_command(
        "{ " + command + " > " + log + " 2>&1 & pid=$!; i=0; while [ \"$( (wc -l < " + metrics +
        ") 2>/dev/null || echo 0)\" -lt 5 ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; kill -" + signal +
        (group ? " -$pid" : " $pid") + "; wait $pid; echo \"rc=$?\"; }");
    r.output += moetrain::testing::read_bytes(log);
    return r;
  }
  bool has(const string& run, const string& path) const { return fs::exists(dir + "/" + run + "/" + path); }
};

struct Signal {
  string name;  // as fault.signal takes it
  int exit_code;
};
const std::vector<Signal> kSignals = {{"TERM", 75}, {"INT", 75}, {"HUP", 75}, {"USR1", 0}, {"USR2", 75}};

// What a run writes, none of which a run stopped before step 1 may leave.
void check_nothing_written(const Job& job, const string& run) {
  for (const char* f : {"metrics.jsonl", "config.resolved.yaml", "run.json", "checkpoints", "model"}) {
    INFO(run << "/" << f);
    CHECK(!job.has(run, f));
  }
}

}  // namespace

TEST_CASE("cli: a stop signal during start-up ends train at once with its exit code, nothing written",
          "[cli][signals]") {
  Job job;
  for (const Signal& s : kSignals) {
    const string run = "startup_" + s.name;
    Result r = job.train(run, 20, "--set fault.kind=signal --set fault.signal=" + s.name +
                                      " --set fault.signal_at=startup");
    INFO(s.name << "\n" << r.output);
    CHECK(r.code == s.exit_code);
    CHECK(r.output.find("interrupted by SIG" + s.name + " while the run was being set up; nothing was written") !=
          string::npos);
    CHECK(r.output.find("step 1/") == string::npos);
    check_nothing_written(job, run);
  }
  // Under mpirun the signal of one rank ends the job the same way.
  Result r = job.mpirun("startup_mpi", 20, "--set fault.kind=signal --set fault.rank=1 --set fault.signal_at=startup");
  INFO(r.output);
  CHECK(r.code == 75);
  CHECK(r.output.find("interrupted by SIGTERM while the run was being set up; nothing was written") != string::npos);
  check_nothing_written(job, "startup_mpi");
}

TEST_CASE("cli: a stop signal mid-run saves a checkpoint at the step boundary and exits 0 (SIGUSR1) or 75; the "
          "rerun continues bit for bit", "[cli][signals]") {
  Job job;
  Result ref = job.train("ref", 20);
  INFO(ref.output);
  REQUIRE(ref.code == 0);
  for (const Signal& s : kSignals) {
    const string run = "mid_" + s.name;
    Result r = job.train(run, 20, "--set fault.kind=signal --set fault.signal=" + s.name + " --set fault.step=7");
    INFO(s.name << "\n" << r.output);
    CHECK(r.code == s.exit_code);
    CHECK(r.output.find("SIG" + s.name + ": saving a checkpoint at step 7 and exiting") != string::npos);
    CHECK(r.output.find("stopped by SIG" + s.name + " after step 7; the checkpoint is committed") != string::npos);
    CHECK(job.has(run, "checkpoints/step_00000007/COMMIT"));
    CHECK(!job.has(run, "model"));  // the run is not finished: no final export
    Result resumed = job.train(run, 20, "--set ckpt.resume=auto");
    INFO(resumed.output);
    REQUIRE(resumed.code == 0);
    CHECK(resumed.output.find("resumed from " + job.dir + "/" + run + "/checkpoints/step_00000007 (step 7") !=
          string::npos);
    CHECK(metrics_history(job.dir + "/" + run) == metrics_history(job.dir + "/ref"));
  }
}

TEST_CASE("cli: signals during a checkpoint save: the save finishes, then the run exits; a third signal outside a "
          "save ends the process at once", "[cli][signals][slow]") {
  Job job;
  Result ref = job.train("ref", 20);
  REQUIRE(ref.code == 0);
  // Two signals inside the periodic save of step 10: it completes, and the run
  // stops there without saving again.
  Result r = job.train("in_save", 20, "--set ckpt.every=10 --set fault.kind=signal --set fault.signal=HUP "
                                      "--set fault.signal_count=2 --set fault.signal_at=save --set fault.step=10");
  INFO(r.output);
  CHECK(r.code == 75);
  CHECK(r.output.find("sends itself SIGHUP x2 while saving the checkpoint of step 10") != string::npos);
  CHECK(r.output.find("stopped by SIGHUP after step 10") != string::npos);
  CHECK(job.has("in_save", "checkpoints/step_00000010/COMMIT"));
  CHECK(!job.has("in_save", "checkpoints/step_00000011"));
  CHECK(moetrain::testing::read_bytes(job.dir + "/in_save/checkpoints/latest") == "step_00000010\n");
  Result resumed = job.train("in_save", 20, "--set ckpt.every=10 --set ckpt.resume=auto");
  INFO(resumed.output);
  REQUIRE(resumed.code == 0);
  CHECK(metrics_history(job.dir + "/in_save") == metrics_history(job.dir + "/ref"));

  // An asynchronous save gets them while training goes on: the run stops at the
  // next step boundary, after the save in flight has committed.
  Result long_ref = job.train("long_ref", 2000);
  REQUIRE(long_ref.code == 0);
  Result a = job.train("in_async_save", 2000, "--set ckpt.every=10 --set ckpt.async=true --set fault.kind=signal "
                                              "--set fault.signal=HUP --set fault.signal_count=2 "
                                              "--set fault.signal_at=save --set fault.step=10");
  INFO(a.output);
  CHECK(a.code == 75);
  CHECK(a.output.find("checkpoint " + job.dir + "/in_async_save/checkpoints/step_00000010 committed") != string::npos);
  CHECK(a.output.find("stopped by SIGHUP after step ") != string::npos);
  CHECK(job.has("in_async_save", "checkpoints/step_00000010/COMMIT"));
  Result a_resumed = job.train("in_async_save", 2000, "--set ckpt.every=10 --set ckpt.async=true "
                                                      "--set ckpt.resume=auto");
  INFO(a_resumed.output);
  REQUIRE(a_resumed.code == 0);
  CHECK(metrics_history(job.dir + "/in_async_save") == metrics_history(job.dir + "/long_ref"));

  // Three at once outside a save: the default action, no checkpoint from this stop.
  Result forced = job.train("forced", 20, "--set fault.kind=signal --set fault.signal_count=3 --set fault.step=7");
  INFO(forced.output);
  CHECK((forced.code == 143 || forced.code == -1));  // killed by SIGTERM (the shell says 128 + 15)
  CHECK(forced.output.find("third stop signal outside a checkpoint save: ending now, without a checkpoint") !=
        string::npos);
  CHECK(!job.has("forced", "checkpoints"));
}

TEST_CASE("cli: under mpirun -np 2 a signal to one rank, SIGUSR2 to mpirun or SIGTERM to launch/mpirun.sh stops "
          "every rank with a checkpoint, exit 75, and the rerun continues bit for bit", "[cli][signals][slow]") {
  Job job;
  Result ref = job.mpirun("ref", 20);
  INFO(ref.output);
  REQUIRE(ref.code == 0);
  Result one_rank = job.mpirun("one_rank", 20, "--set fault.kind=signal --set fault.rank=1 --set fault.step=7");
  INFO(one_rank.output);
  CHECK(one_rank.code == 75);
  CHECK(one_rank.output.find("a stop signal on another rank: saving a checkpoint at step 7 and exiting") !=
        string::npos);
  CHECK(job.has("one_rank", "checkpoints/step_00000007/COMMIT"));
  Result resumed = job.mpirun("one_rank", 20, "--set ckpt.resume=auto");
  INFO(resumed.output);
  REQUIRE(resumed.code == 0);
  CHECK(metrics_history(job.dir + "/one_rank") == metrics_history(job.dir + "/ref"));

  // Two signals inside rank 1's part of the step-10 save: every rank finishes it, and stops there.
  Result in_save = job.mpirun("in_save", 20, "--set ckpt.every=10 --set fault.kind=signal --set fault.rank=1 "
                                             "--set fault.signal_at=save --set fault.step=10 --set fault.signal_count=2");
  INFO(in_save.output);
  CHECK(in_save.code == 75);
  CHECK(in_save.output.find("saving a checkpoint at step 10 and exiting") != string::npos);
  CHECK(job.has("in_save", "checkpoints/step_00000010/COMMIT"));
  CHECK(!job.has("in_save", "checkpoints/step_00000011"));
  Result in_save_resumed = job.mpirun("in_save", 20, "--set ckpt.every=10 --set ckpt.resume=auto");
  INFO(in_save_resumed.output);
  REQUIRE(in_save_resumed.code == 0);
  CHECK(metrics_history(job.dir + "/in_save") == metrics_history(job.dir + "/ref"));

  // Real signals from outside, once a few steps are logged, on runs long enough to be hit mid-run.
  Result long_ref = job.mpirun("long_ref", 2000);
  REQUIRE(long_ref.code == 0);
  const string mpirun = string(kLocalMpirun) + "-np 2 " + job.moetrain();
  // launch/mpirun.sh runs with SIGINT at its default (a background job of a
  // non-interactive shell would ignore it), in a session whose group gets the
  // signal as a terminal's Ctrl-C would send it.
  const string wrapper = "setsid perl -e '$SIG{INT}=\"DEFAULT\"; exec @ARGV' -- " + string(MOETRAIN_SOURCE_DIR) +
                         "/launch/mpirun.sh " + string(kLocalMpirun).substr(7) + "-np 2 " + job.moetrain();
  struct External {
    string run, command, signal;
    bool group;
  };
  for (const External& e : {External{"usr2_to_mpirun", mpirun, "USR2", false},
                            External{"term_to_wrapper", wrapper, "TERM", false},
                            External{"int_to_wrapper_group", wrapper, "INT", true}}) {
    Result r = job.signal_mid_run(e.command + job.train_args(e.run, 2000), e.run, e.signal, e.group);
    INFO(e.run << "\n" << r.output);
    CHECK(r.output.find("rc=75") != string::npos);
    CHECK(r.output.find(": saving a checkpoint at step ") != string::npos);
    CHECK(job.has(e.run, "checkpoints/latest"));
    Result again = job.mpirun(e.run, 2000, "--set ckpt.resume=auto");
    INFO(again.output);
    REQUIRE(again.code == 0);
    CHECK(metrics_history(job.dir + "/" + e.run) == metrics_history(job.dir + "/long_ref"));
  }
}

TEST_CASE("cli: SIGTERM or SIGINT to a training process mid-run, as kill, Slurm or a terminal sends it: exit 75, "
          "and the rerun continues bit for bit", "[cli][signals][slow]") {
  Job job;
  Result ref = job.train("ref", 2000);
  REQUIRE(ref.code == 0);
  for (const string signal : {"TERM", "INT"}) {
    const string run = "killed_" + signal;
    Result r = job.signal_mid_run(job.moetrain() + job.train_args(run, 2000), run, signal);
    INFO(r.output);
    CHECK(r.output.find("rc=75") != string::npos);
    CHECK(r.output.find("SIG" + signal + ": saving a checkpoint at step ") != string::npos);
    Result resumed = job.train(run, 2000, "--set ckpt.resume=auto");
    INFO(resumed.output);
    REQUIRE(resumed.code == 0);
    CHECK(metrics_history(job.dir + "/" + run) == metrics_history(job.dir + "/ref"));
  }
}
