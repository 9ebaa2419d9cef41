// The evolution ladder end to end at a tiny budget (launch/evolution.sh: every rung
// on tinyshakespeare bytes and on two synthetic memory tasks, then the report with
// its table and plot), a synthetic-task run whose accuracy agrees with its metrics,
// and the config errors of the new keys.
#include <catch2/catch.hpp>

#include <filesystem>
#include <string>

#include "testing.h"

using moetrain::testing::TempDir;
using std::string;

namespace {

using Result = moetrain::testing::CommandOutput;

const string kSource = MOETRAIN_SOURCE_DIR;

}  // namespace

// [slow]: seven training runs; not rerun under the sanitizers (launch/test.sh).
TEST_CASE("cli: launch/evolution.sh runs all seven rungs at a tiny budget and writes the report",
          "[cli][evolution][slow]") {
  TempDir tmp;
  const string dir = tmp.path();
  // 2 LM steps and 2 steps per memory task; 1 evaluation batch of 2 rows; one thread.
  const string cmd = "MOETRAIN_BIN=" + string(MOETRAIN_BINARY_DIR) + "/moetrain " + kSource +
                     "/launch/evolution.sh --steps 2 --task-steps 2 --threads 1 --out " + dir + "/runs --doc " + dir +
                     "/evolution.md --data " + dir + "/data --set train.batch_size=2 --set train.eval_batches=1";
  Result r = moetrain::testing::capture_command(cmd);
  INFO(r.output);
  REQUIRE(r.code == 0);
  const string doc = moetrain::testing::read_bytes(dir + "/evolution.md");
  for (const char* rung : {"01-gpt2", "02-linear-attention", "03-deltanet", "04-gated-deltanet", "05-kda",
                           "06-kimi-linear", "07-k3"}) {
    INFO(rung);
    CHECK(doc.find(string("| ") + rung + " ") != string::npos);
    CHECK(std::filesystem::exists(dir + "/runs/" + rung + "-assoc_recall/metrics.jsonl"));
    CHECK(std::filesystem::exists(dir + "/runs/" + rung + "-repeated_key/metrics.jsonl"));
  }
  CHECK(doc.find("2 language-model steps per rung") != string::npos);
  CHECK(doc.find("## Expected orderings on the memory tasks") != string::npos);
  CHECK(std::filesystem::file_size(dir + "/images/evolution.png") > 10000);

  Result bad = moetrain::testing::capture_command(kSource + "/launch/evolution.sh --rungs 09 --out " + dir + "/x");
  CHECK(bad.code == 2);
  CHECK(bad.output.find("no rung '09'") != string::npos);
}

TEST_CASE("cli: data.synthetic trains on a memory task and reports the answer accuracy", "[cli][evolution]") {
  TempDir tmp;
  const string dir = tmp.path();
  const string sets = " --set run.dir=" + dir +
                     "/run --set data.synthetic=repeated_key --set data.synthetic_num_pairs=6 "
                     "--set data.synthetic_num_queries=3 --set data.synthetic_num_rebinds=3 --set train.batch_size=4 "
                     "--set train.max_steps=3 --set train.eval_every=3 --set train.eval_batches=2 --set train.threads=1";
  const string base = "train -c " + kSource + "/configs/evolution/03-deltanet.yaml" + sets;
  Result ok = moetrain::testing::run_moetrain(base + " --set train.seq_len=17");  // 2·6 + 2·3 − 1
  INFO(ok.output);
  REQUIRE(ok.code == 0);
  CHECK(ok.output.find("(24 answers)") != string::npos);  // 2 batches x 4 rows x 3 queries
  const string metrics = moetrain::testing::read_bytes(dir + "/run/metrics.jsonl");
  CHECK(metrics.find("\"val_acc\":") != string::npos);

  Result len = moetrain::testing::run_moetrain(base + " --set train.seq_len=16");
  CHECK(len.code == 2);
  CHECK(len.output.find("train.seq_len") != string::npos);
  CHECK(len.output.find("must be 17") != string::npos);

  Result vocab = moetrain::testing::run_moetrain(base + " --set train.seq_len=17 --set model.vocab_size=100");
  CHECK(vocab.code == 2);
  CHECK(vocab.output.find("model.vocab_size") != string::npos);
  CHECK(vocab.output.find("130") != string::npos);  // 2 + 64 keys + 64 values

  const string cfg = tmp.write("bad.yaml", "include: " + kSource + "/configs/evolution/03-deltanet.yaml\n"
                                           "model:\n  layer_mixers: deltanet,gru,deltanet,deltanet\n");
  // Synthetic data: the run needs no prepared shards, so the mixer is what it stops at.
  Result mixer = moetrain::testing::run_moetrain("train -c " + cfg + sets + " --set train.seq_len=17");
  CHECK(mixer.code == 2);
  CHECK(mixer.output.find("bad.yaml:3") != string::npos);
  CHECK(mixer.output.find("model.layer_mixers") != string::npos);
  CHECK(mixer.output.find("unknown mixer 'gru'") != string::npos);
}
