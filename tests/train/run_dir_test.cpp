// Run directories: one holder at a time (flock), where a run starts (ckpt.resume
// and lineages: auto never picks a checkpoint of an abandoned branch), and what
// begin() writes. Checkpoints are fabricated: a committed step directory is
// COMMIT plus a manifest naming its lineage (what RunDirectory reads of them).
#include <catch2/catch.hpp>

#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "testing.h"
#include "train/metrics.h"
#include "train/run_dir.h"

using namespace moetrain;
using moetrain::testing::read_bytes;
using moetrain::testing::TempDir;
using moetrain::testing::write_bytes;
using std::string;
namespace fs = std::filesystem;

namespace {

void fake_checkpoint(const string& run, int64_t step, const string& lineage) {
  const string dir = run + "/checkpoints/" + checkpoint_name(step);
  fs::create_directories(dir);
  write_bytes(dir + "/COMMIT", checkpoint_name(step) + "\n");
  write_bytes(dir + "/manifest.json", nlohmann::json{{"step", step}, {"lineage", lineage}, {"run_id", lineage}}.dump());
}

Config with_resume(const string& resume, bool overwrite = false) {
  return Config::load_string("ckpt:\n  resume: " + resume + "\nrun:\n  overwrite: " + (overwrite ? "true" : "false") +
                             "\n", "test.yaml");
}

std::vector<string> names(const std::vector<CommittedCheckpoint>& cs) {
  std::vector<string> out;
  for (const CommittedCheckpoint& c : cs) out.push_back(c.name);
  return out;
}

StartPlan plan_of(RunDirectory& run, const string& resume, bool overwrite = false) {
  const Config config = with_resume(resume, overwrite);
  CheckpointOptions o;
  o.run_dir = run.path();
  o.resume = resume;
  o.overwrite = overwrite;
  return run.plan(o, config);
}

}  // namespace

TEST_CASE("run dir: a second holder is refused naming the first; the lock goes with its holder", "[train][run_dir]") {
  TempDir tmp;
  const string dir = tmp / "run";
  {
    RunDirectory first(dir);
    const string message = moetrain::testing::error_of([&] { RunDirectory second(dir); });
    CHECK(message.find("run.dir " + dir + " is in use by another moetrain run (pid " + std::to_string(::getpid())) !=
          string::npos);
    CHECK(message.find(first.run_id()) != string::npos);
    CHECK(message.find("choose another run.dir") != string::npos);
  }
  RunDirectory again(dir);  // released with the first holder
  CHECK(fs::exists(dir + "/run.lock"));
}

TEST_CASE("run dir: resume none refuses a directory holding an earlier run unless run.overwrite", "[train][run_dir]") {
  TempDir tmp;
  const string dir = tmp / "run";
  RunDirectory run(dir);
  CHECK(!plan_of(run, "none").clear);  // empty: a fresh run
  write_bytes(dir + "/metrics.jsonl", "{\"step\":1,\"loss\":2.5}\n{\"step\":2,\"loss\":2.4}\n");
  fake_checkpoint(dir, 2, "a");
  const string message = moetrain::testing::error_of<ConfigError>([&] { plan_of(run, "none"); });
  CHECK(message.find("already holds one (1 checkpoint, 2 metrics records)") != string::npos);
  CHECK(message.find("ckpt.resume: auto") != string::npos);
  CHECK(message.find("run.overwrite: true") != string::npos);
  const StartPlan plan = plan_of(run, "none", true);
  CHECK(plan.clear);
  run.begin(plan);
  CHECK(!fs::exists(dir + "/checkpoints"));
  CHECK(!fs::exists(dir + "/metrics.jsonl"));
  CHECK(nlohmann::json::parse(read_bytes(dir + "/run.json"))["lineage"] == run.run_id());
}

TEST_CASE("run dir: a rollback starts a lineage and moves the newer checkpoints aside; auto then follows it",
          "[train][run_dir]") {
  TempDir tmp;
  const string dir = tmp / "run";
  for (int64_t s : {10, 20, 30}) fake_checkpoint(dir, s, "A");
  write_bytes(dir + "/run.json", R"({"run_id": "A", "lineage": "A", "started_from": ""})");
  string metrics;
  for (int s = 1; s <= 30; ++s) metrics += "{\"step\":" + std::to_string(s) + "}\n";
  write_bytes(dir + "/metrics.jsonl", metrics);
  string lineage_b;
  {
    RunDirectory run(dir);
    const StartPlan auto_plan = plan_of(run, "auto");  // the newest of lineage A
    REQUIRE(auto_plan.from);
    CHECK(auto_plan.from->name == "step_00000030");
    CHECK(!auto_plan.rollback);
    CHECK(auto_plan.lineage == "A");

    const StartPlan plan = plan_of(run, "step_00000010");
    REQUIRE(plan.from);
    CHECK(plan.rollback);
    CHECK(plan.lineage == run.run_id());
    CHECK(names(plan.abandoned) == std::vector<string>{"step_00000020", "step_00000030"});
    run.begin(plan);
    lineage_b = run.run_id();
    const string aside = dir + "/checkpoints/abandoned/" + run.run_id();
    CHECK(fs::exists(aside + "/step_00000020/COMMIT"));
    CHECK(fs::exists(aside + "/step_00000030/COMMIT"));
    CHECK(names(committed_checkpoints(dir, false)) == std::vector<string>{"step_00000010"});
    CHECK(read_bytes(dir + "/checkpoints/latest") == "step_00000010\n");
    CHECK(count_metrics_records(dir + "/metrics.jsonl") == 10);
    CHECK(count_metrics_records(aside + "/metrics.jsonl") == 20);
  }
  // The rollback's run died before its first checkpoint; A's step 30 comes back
  // (copied by hand, or a crash between run.json and the move): auto still starts
  // from the rollback's checkpoint, not from the abandoned branch.
  fake_checkpoint(dir, 30, "A");
  {
    RunDirectory run(dir);
    const StartPlan plan = plan_of(run, "auto");
    REQUIRE(plan.from);
    CHECK(plan.from->name == "step_00000010");
    CHECK(plan.lineage == lineage_b);
    CHECK(names(plan.abandoned) == std::vector<string>{"step_00000030"});
  }
  // Lineage B saved step 20: auto takes it, and never A's 30.
  fake_checkpoint(dir, 20, lineage_b);
  {
    RunDirectory run(dir);
    const StartPlan plan = plan_of(run, "auto");
    REQUIRE(plan.from);
    CHECK(plan.from->name == "step_00000020");
    CHECK(!plan.rollback);
    CHECK(plan.lineage == lineage_b);
  }
}

TEST_CASE("run dir: a named checkpoint that is missing or incomplete is refused with the complete ones listed",
          "[train][run_dir]") {
  TempDir tmp;
  const string dir = tmp / "run";
  fake_checkpoint(dir, 10, "A");
  fs::create_directories(dir + "/checkpoints/step_00000020");  // no COMMIT
  RunDirectory run(dir);
  CHECK(moetrain::testing::error_of<ConfigError>([&] { plan_of(run, "step_00000030"); })
            .find("step_00000030 does not exist (complete checkpoints: step_00000010)") != string::npos);
  CHECK(moetrain::testing::error_of<ConfigError>([&] { plan_of(run, "step_00000020"); })
            .find("step_00000020 has no COMMIT") != string::npos);
  const StartPlan newest = plan_of(run, "step_00000010");  // the newest: the lineage goes on
  CHECK(!newest.rollback);
  CHECK(newest.lineage == "A");
}
