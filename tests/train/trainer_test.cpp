// The Trainer driven in-process, step by step, as train() drives it: its losses
// equal the CLI's for the same config, a skipped step changes nothing, stop
// signals reach stop_requested(), and a signal before step 1 ends the run with
// Interrupted, nothing written.
#include <catch2/catch.hpp>

#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "core/signals.h"
#include "testing.h"
#include "train/trainer.h"

using namespace moetrain;
using moetrain::testing::TempDir;
using std::string;
namespace fs = std::filesystem;

namespace {

// Byte-level tinyshakespeare shards and a tiny GPT-2 config writing to dir/<run>.
struct Workspace {
  TempDir tmp;
  string dir = tmp.path();
  Workspace() { moetrain::testing::prepare_byte_shards(dir); }
  string yaml(const string& run) const {
    return "model:\n  vocab_size: 256\n  n_layer: 2\n  n_head: 2\n  d_model: 32\n  n_ctx: 64\n"
           "data:\n  train: " + dir + "/data/train_*.bin\n  val: ''\n  tokenizer: byte\n"
           "train:\n  batch_size: 4\n  seq_len: 32\n  max_steps: 2\n  warmup_steps: 1\n  lr: 3.0e-3\n"
           "  eval_every: 0\n  threads: 1\n"
           "run:\n  dir: " + dir + "/" + run + "\n";
  }
  Config config(const string& run, const std::vector<string>& overrides = {}) const {
    return Config::load_string(yaml(run), dir + "/tiny.yaml", overrides);
  }
};

// Handlers installed for one test, forgotten and removed at its end (the test
// binary otherwise runs without them).
struct InstalledSignals {
  InstalledSignals() { signals::install(); }
  ~InstalledSignals() {
    signals::reset_for_testing();
    signals::restore_default_actions();
  }
};

}  // namespace

TEST_CASE("Trainer::train_step in-process gives the CLI's losses bit for bit", "[train][trainer]") {
  Workspace w;
  std::vector<double> losses;
  {
    Trainer trainer(w.config("inproc"));
    trainer.resume();
    CHECK(trainer.step() == 0);
    while (!trainer.done()) {
      const StepResult r = trainer.train_step();
      CHECK(!r.skipped);
      CHECK(r.step == static_cast<int64_t>(losses.size()) + 1);
      CHECK(r.tokens == 4 * 32);
      CHECK(std::isfinite(r.grad_norm));
      losses.push_back(r.loss);
    }
    CHECK(trainer.step() == 2);
  }
  moetrain::testing::write_bytes(w.dir + "/tiny.yaml", w.yaml("cli"));
  const auto cli = moetrain::testing::run_moetrain("train -c " + w.dir + "/tiny.yaml");
  INFO(cli.output);
  REQUIRE(cli.code == 0);
  // metrics.jsonl holds %.9g, which round-trips the f32 loss exactly.
  std::vector<double> printed;
  for (double l : losses) printed.push_back(std::stod(fmt::format("{:.9g}", l)));
  CHECK(moetrain::testing::metrics_losses(w.dir + "/cli") == printed);
}

TEST_CASE("Trainer: a step with a NaN gradient is skipped and leaves the weights as they were", "[train][trainer]") {
  Workspace w;
  Trainer trainer(w.config("nan", {"fault.kind=nan_grad", "fault.step=2", "train.max_steps=3"}));
  trainer.resume();
  REQUIRE(!trainer.train_step().skipped);
  std::vector<Tensor> before;
  for (const NamedParameter& p : trainer.model().parameters()) before.push_back(p.tensor.detach().clone());
  const StepResult r = trainer.train_step();
  CHECK(r.skipped);
  CHECK(r.skip_reason.find("nan") != string::npos);
  CHECK(trainer.progress().skipped == 1);
  CHECK(trainer.step() == 2);
  for (size_t i = 0; i < before.size(); ++i)
    CHECK(moetrain::testing::bitwise_equal(trainer.model().parameters()[i].tensor, before[i]));
  CHECK(!trainer.train_step().skipped);
  CHECK(trainer.progress().consecutive_skips == 0);
}

TEST_CASE("Trainer: a stop signal is what stop_requested() reports; before step 1 it ends the run with "
          "Interrupted and nothing written", "[train][trainer]") {
  Workspace w;
  InstalledSignals installed;
  {
    Trainer trainer(w.config("running"));
    trainer.resume();
    trainer.train_step();
    CHECK(trainer.stop_requested() == signals::Stop::none);
    REQUIRE(::kill(::getpid(), SIGUSR1) == 0);
    CHECK(trainer.stop_requested() == signals::Stop::save_and_exit);
    REQUIRE(::kill(::getpid(), SIGUSR2) == 0);  // a preemption outranks "save and exit"
    CHECK(trainer.stop_requested() == signals::Stop::preempted);
    CHECK(signals::first_signal() == SIGUSR1);
    const TrainSummary s = trainer.stop(trainer.stop_requested());
    CHECK(s.exit_code == kExitPreempted);
    CHECK(fs::exists(w.dir + "/running/checkpoints/step_00000001/COMMIT"));
  }
  signals::reset_for_testing();
  REQUIRE(::kill(::getpid(), SIGTERM) == 0);
  Config config = w.config("interrupted");
  try {
    Trainer trainer(config);
    trainer.resume();
    FAIL("no Interrupted");
  } catch (const Interrupted& e) {
    CHECK(e.exit_code() == kExitPreempted);
    CHECK(string(e.what()).find("interrupted by SIGTERM while the run was being set up; nothing was written") !=
          string::npos);
  }
  for (const char* f : {"metrics.jsonl", "config.resolved.yaml", "run.json", "checkpoints", "model"})
    CHECK(!fs::exists(w.dir + "/interrupted/" + f));
}
