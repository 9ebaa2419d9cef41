// A run directory as runs on a cluster use it (train/run_dir.h): one run at a
// time (a second one exits 2 naming the holder; a SIGKILLed holder leaves no
// stale lock), no silent overwrite of an earlier run, one consistent
// metrics.jsonl after crashes and rollbacks, and `ckpt.resume: auto` following
// the lineage of a rollback instead of jumping into the abandoned branch. Also a
// learning rate that makes the update overflow: skipped steps, then exit 3,
// never a non-finite model. A tiny byte-level GPT-2, one thread.
#include <catch2/catch.hpp>

#include <signal.h>

#include <filesystem>
#include <regex>
#include <sstream>
#include <string>

#include "cli/cli_fixtures.h"
#include "testing.h"

using moetrain::testing::metrics_history;
using moetrain::testing::read_bytes;
using moetrain::testing::TempDir;
using std::string;
namespace fs = std::filesystem;

using moetrain::testing::one_to;
using moetrain::testing::steps_of;

namespace {

using Result = moetrain::testing::CommandOutput;

using Job = moetrain::testing::TinyGpt2Runs;

}  // namespace

TEST_CASE("cli: a second run on a run.dir in use exits 2 naming the holder; a SIGKILLed holder leaves no lock",
          "[cli][run_dir]") {
  Job job;
  // The first run trains in the background; the second starts once it has logged steps.
  const string first = job.path("shared.log");
  Result second = moetrain::testing::capture_command(
      "{ " + string(MOETRAIN_BINARY_DIR) + "/moetrain " + job.args("shared", 100000, "--set ckpt.every=0") + " > " + first +
      " 2>&1 & pid=$!; i=0; while [ \"$( (wc -l < " + job.path("shared", "metrics.jsonl") +
      ") 2>/dev/null || echo 0)\" -lt 3 ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; echo \"holder=$pid\"; " +
      string(MOETRAIN_BINARY_DIR) + "/moetrain " + job.args("shared", 20, "--set ckpt.resume=auto") +
      "; echo \"rc=$?\"; kill -KILL $pid; wait $pid; }");
  INFO(second.output);
  std::smatch m;
  REQUIRE(std::regex_search(second.output, m, std::regex(R"(holder=(\d+))")));
  CHECK(second.output.find("rc=2") != string::npos);
  CHECK(second.output.find("run.dir " + job.path("shared") + " is in use by another moetrain run (pid " + m[1].str() +
                           " on host ") != string::npos);
  CHECK(second.output.find("choose another run.dir") != string::npos);
  const string history = read_bytes(job.path("shared", "metrics.jsonl"));
  CHECK(steps_of(history) == one_to(static_cast<int64_t>(steps_of(history).size())));  // nothing interleaved

  // The holder was SIGKILLed: the next run takes the directory and resumes.
  Result next = job.train("shared", 20, "--set ckpt.resume=auto");
  INFO(next.output);
  CHECK(next.code == 0);
  CHECK(steps_of(read_bytes(job.path("shared", "metrics.jsonl"))) == one_to(20));
}

TEST_CASE("cli: ckpt.resume none in a run.dir that holds a run is refused unless run.overwrite", "[cli][run_dir]") {
  Job job;
  REQUIRE(job.train("run", 20).code == 0);
  const string before = read_bytes(job.path("run", "metrics.jsonl"));
  Result again = job.train("run", 20);
  INFO(again.output);
  CHECK(again.code == 2);
  CHECK(again.output.find("ckpt.resume = none (default): a fresh run, but run.dir " + job.path("run") +
                          " already holds one (2 checkpoints, 20 metrics records, a model/); continue it with "
                          "ckpt.resume: auto, start over there with run.overwrite: true") != string::npos);
  CHECK(read_bytes(job.path("run", "metrics.jsonl")) == before);  // untouched
  CHECK(fs::exists(job.path("run", "checkpoints/step_00000020/COMMIT")));

  Result overwritten = job.train("run", 15, "--set run.overwrite=true");
  INFO(overwritten.output);
  CHECK(overwritten.code == 0);
  CHECK(overwritten.output.find("run.overwrite: deleting the earlier run in " + job.path("run")) != string::npos);
  CHECK(steps_of(read_bytes(job.path("run", "metrics.jsonl"))) == one_to(15));  // one history, the new one
  CHECK(!fs::exists(job.path("run", "checkpoints/step_00000020")));
}

TEST_CASE("cli: after a rollback and a crash, auto resumes the rollback's lineage, never the abandoned branch; "
          "metrics.jsonl stays one history", "[cli][run_dir]") {
  Job job;
  REQUIRE(job.train("ref", 30).code == 0);  // the history a rollback to 10 must reproduce
  REQUIRE(job.train("run", 30).code == 0);
  // Roll back to step 10, then die at step 15, before the branch's first checkpoint.
  Result rolled = job.train("run", 30, "--set ckpt.resume=step_00000010 --set fault.kind=kill --set fault.step=15");
  INFO(rolled.output);
  CHECK(rolled.code != 0);
  CHECK(rolled.output.find("rollback to step_00000010: step_00000020, step_00000030 are not on this run's path; "
                           "moving them to " + job.path("run", "checkpoints/abandoned/")) != string::npos);
  Result resumed = job.train("run", 30, "--set ckpt.resume=auto");
  INFO(resumed.output);
  REQUIRE(resumed.code == 0);
  CHECK(resumed.output.find("resumed from " + job.path("run", "checkpoints/step_00000010") + " (step 10") !=
        string::npos);
  CHECK(resumed.output.find("done: 30 steps (20 in this run") != string::npos);
  CHECK(metrics_history(job.path("run")) == metrics_history(job.path("ref")));
  // The abandoned branch is kept aside, with its records.
  bool found = false;
  for (const fs::directory_entry& e : fs::directory_iterator(job.path("run", "checkpoints/abandoned"))) {
    found = fs::exists(e.path() / "step_00000030" / "COMMIT") && fs::exists(e.path() / "metrics.jsonl");
    CHECK(steps_of(read_bytes((e.path() / "metrics.jsonl").string())) ==
          std::vector<int64_t>{11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30});
  }
  CHECK(found);
}

TEST_CASE("cli: a run killed before its first checkpoint, or mid-line, leaves a history the rerun continues "
          "without duplicates", "[cli][run_dir]") {
  Job job;
  REQUIRE(job.train("ref", 20).code == 0);
  Result killed = job.train("run", 20, "--set fault.kind=kill --set fault.step=5");
  CHECK(killed.code != 0);
  // A torn last line, as a crash in the middle of a write would leave it.
  {
    std::FILE* f = std::fopen(job.path("run", "metrics.jsonl").c_str(), "a");
    REQUIRE(f);
    std::fputs("{\"step\":5,\"lo", f);
    std::fclose(f);
  }
  Result rerun = job.train("run", 20, "--set ckpt.resume=auto");
  INFO(rerun.output);
  REQUIRE(rerun.code == 0);
  CHECK(rerun.output.find("metrics.jsonl: dropped an incomplete last line") != string::npos);
  CHECK(rerun.output.find("ckpt.resume = auto: no complete checkpoint of this run's lineage in ") != string::npos);
  CHECK(rerun.output.find("metrics.jsonl: dropped 4 records after step 0") != string::npos);
  CHECK(metrics_history(job.path("run")) == metrics_history(job.path("ref")));
}

TEST_CASE("cli: a learning rate whose update overflows f32 skips those steps, then exits 3 naming the tensor; "
          "nothing non-finite is written", "[cli][run_dir]") {
  Job job;
  Result r = job.train("huge_lr", 20, "--set train.lr=1e38 --set train.min_lr=0 --set train.warmup_steps=0");
  INFO(r.output);
  CHECK(r.code == 3);
  CHECK(r.output.find("step 1: the update (lr 1e+38) would make wte.weight [256, 32]: ") != string::npos);
  CHECK(r.output.find("6 steps in a row were not finite (train.max_consecutive_skips = 5)") != string::npos);
  CHECK(!fs::exists(job.path("huge_lr", "model")));
  CHECK(!fs::exists(job.path("huge_lr", "checkpoints")));
  // One step at lr 1e30: finite but enormous weights, which are written (they are
  // finite); eval and generate then refuse to print a NaN loss or text sampled from NaN.
  Result enormous = job.train("enormous", 1, "--set train.lr=1e30 --set train.min_lr=0 --set train.warmup_steps=0");
  INFO(enormous.output);
  REQUIRE(enormous.code == 0);
  Result eval = moetrain::testing::run_moetrain("eval --checkpoint " + job.path("enormous", "model") + " --data '" +
                                                job.dir + "/data/val_*.bin' --batches 2");
  INFO(eval.output);
  CHECK(eval.code == 3);
  CHECK(eval.output.find("eval: the mean loss over 64 tokens of ") != string::npos);
  Result gen = moetrain::testing::run_moetrain("generate --checkpoint " + job.path("enormous", "model") +
                                               " --max-new-tokens 8");
  INFO(gen.output);
  CHECK(gen.code == 3);
  CHECK(gen.output.find("logits for the next token are NaN or infinite") != string::npos);
  Result beyond = job.train("beyond_f32", 20, "--set train.lr=1e39");
  INFO(beyond.output);
  CHECK(beyond.code == 2);
  CHECK(beyond.output.find("--set train.lr=1e39: train.lr = 1e39: outside what f32 can hold") != string::npos);
}
