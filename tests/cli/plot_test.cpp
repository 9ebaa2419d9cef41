// launch/plot.py on the metrics.jsonl of real runs: an image of the curves of
// several runs, one summary line per run that agrees with the file, and exit 2
// naming a run without metrics.
#include <catch2/catch.hpp>

#include <fmt/format.h>

#include <sstream>
#include <string>

#include "testing.h"

using moetrain::testing::TempDir;
using std::string;

namespace {

using Result = moetrain::testing::CommandOutput;

// The last "loss" of a metrics.jsonl.
double last_loss(const string& metrics) {
  std::stringstream in(moetrain::testing::read_bytes(metrics));
  double last = -1;
  for (string line; std::getline(in, line);)
    if (auto at = line.find("\"loss\":"); at != string::npos) last = std::stod(line.substr(at + 7));
  return last;
}

}  // namespace

TEST_CASE("cli: launch/plot.py draws several runs' metrics and names a run without them", "[cli]") {
  TempDir tmp;
  const string dir = tmp.path();
  Result prep = moetrain::testing::run_moetrain("prepare " + string(MOETRAIN_SOURCE_DIR) +
                                                "/data/tinyshakespeare.txt --out " + dir +
                                                "/data --tokenizer byte --val-tokens 8192");
  REQUIRE(prep.code == 0);
  const string train = "train -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/gpt2-shakespeare.yaml "
                       "--set model.vocab_size=256 --set model.n_layer=1 --set model.n_head=2 --set model.d_model=32 "
                       "--set model.n_ctx=32 --set train.seq_len=16 --set train.batch_size=2 --set train.max_steps=6 "
                       "--set train.warmup_steps=1 --set train.eval_every=3 --set train.eval_batches=1 "
                       "--set train.sample_every=0 --set data.tokenizer=byte --set data.train=" + dir +
                       "/data/train_*.bin --set data.val=" + dir + "/data/val_*.bin";
  for (const char* run : {"a", "b"}) {
    Result r = moetrain::testing::run_moetrain(train + " --set train.lr=" + (run == string("a") ? "1e-3" : "3e-3") +
                                               " --set run.dir=" + dir + "/" + run);
    INFO(r.output);
    REQUIRE(r.code == 0);
  }
  const string plot = "/usr/bin/python3 " + string(MOETRAIN_SOURCE_DIR) + "/launch/plot.py ";
  Result p = moetrain::testing::capture_command(plot + dir + "/a " + dir + "/b/metrics.jsonl -o " + dir + "/loss.png");
  INFO(p.output);
  REQUIRE(p.code == 0);
  const string png = moetrain::testing::read_bytes(dir + "/loss.png");
  CHECK(png.substr(0, 8) == "\x89PNG\r\n\x1a\n");
  CHECK(png.size() > 20000);  // curves, not an empty canvas
  for (const char* run : {"a", "b"})
    CHECK(p.output.find(fmt::format("{}: 6 steps, last loss {:.4f} at step 6, val loss ", run,
                                    last_loss(dir + "/" + run + "/metrics.jsonl"))) != string::npos);

  Result missing = moetrain::testing::capture_command(plot + dir + "/a " + dir + "/nothing -o " + dir + "/x.png");
  CHECK(missing.code == 2);
  CHECK(missing.output.find("plot.py: " + dir + "/nothing: no metrics.jsonl") != string::npos);
}
