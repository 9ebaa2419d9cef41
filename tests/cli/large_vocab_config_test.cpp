// configs/k3-shakespeare-bpe.yaml end to end (docs/training.md#a-vocabulary-beyond-65536):
// launch/build_tokenizer.py builds its 70,000-token tokenizer from the shipped
// corpus with HF tokenizers ($MOETRAIN_TOKENIZERS_PYTHON; skipped with one line
// without it), prepare writes uint32 shards, and the shipped config, shortened
// with --set, trains: the loss is finite and falls, the sample decodes with the
// tokenizer.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/shard.h"
#include "data/tokenizer.h"
#include "testing.h"

using moetrain::testing::CommandOutput;
using moetrain::testing::run_moetrain;
using moetrain::testing::TempDir;
using std::string;

TEST_CASE("large vocab config: build_tokenizer.py, prepare and k3-shakespeare-bpe.yaml train on uint32 shards",
          "[cli][slow]") {
  const char* env = std::getenv("MOETRAIN_TOKENIZERS_PYTHON");
  if (env == nullptr || *env == '\0' ||
      moetrain::testing::capture_command(moetrain::testing::shell_quote(env) + " -c 'import tokenizers'").code != 0) {
    WARN("skipped: MOETRAIN_TOKENIZERS_PYTHON is not a python that imports tokenizers (launch/test.sh sets it to "
         "build/venv-tokenizers/bin/python)");
    return;
  }
  const string root = MOETRAIN_SOURCE_DIR;
  TempDir tmp;
  const string tok_dir = tmp / "bpe";
  const CommandOutput made = moetrain::testing::capture_command(moetrain::testing::shell_quote(env) + " " + root +
                                                                "/launch/build_tokenizer.py --out " + tok_dir);
  INFO(made.output);
  REQUIRE(made.code == 0);
  const string tok_path = tok_dir + "/tokenizer.json";
  const auto tok = moetrain::data::make_tokenizer(tok_path, "");
  CHECK(tok->vocab_size() == 70000);  // the config's model.vocab_size
  CHECK(tok->document_tokens().prefix == std::vector<int32_t>{69998});

  const CommandOutput p = run_moetrain("prepare " + root + "/data/tinyshakespeare.txt --out " + tmp / "data" +
                                       " --tokenizer " + tok_path + " --val-tokens 8192");
  INFO(p.output);
  REQUIRE(p.code == 0);
  moetrain::data::TokenShard shard(tmp / "data/train_000000.bin");
  CHECK(shard.width() == moetrain::data::TokenWidth::u32);
  const std::vector<uint32_t> ids = moetrain::data::read_shard(tmp / "data/train_000000.bin");
  int64_t past_u16 = 0;
  for (uint32_t id : ids) past_u16 += id > 65535 ? 1 : 0;
  CHECK(past_u16 > 0);  // the grown merges occur: ids a uint16 shard could not hold

  const CommandOutput t = run_moetrain(
      "train -c " + root + "/configs/k3-shakespeare-bpe.yaml --set data.tokenizer=" + tok_path +
      " --set data.train=" + tmp / "data/train_*.bin --set data.val=" + tmp / "data/val_*.bin" +
      " --set train.max_steps=12 --set train.warmup_steps=2 --set train.log_every=1 --set train.eval_every=12"
      " --set train.eval_batches=2 --set train.sample_every=12 --set train.sample_tokens=8"
      " --set train.threads=2 --set run.dir=" + tmp / "run");
  INFO(t.output);
  REQUIRE(t.code == 0);
  CHECK_THAT(t.output, Catch::Contains("sample at step 12:\nROMEO:"));
  std::vector<double> losses;
  std::ifstream metrics(tmp / "run/metrics.jsonl");
  for (string line; std::getline(metrics, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("loss") && j.contains("step")) losses.push_back(j["loss"].get<double>());
  }
  REQUIRE(losses.size() >= 12);
  for (double l : losses) CHECK(std::isfinite(l));
  CHECK(std::abs(losses.front() - std::log(70000.0)) < 1.0);  // a uniform guess over the vocabulary at first
  // Falling: the mean of the last three below the mean of the first three.
  const double first = (losses[0] + losses[1] + losses[2]) / 3, last = (losses[losses.size() - 1] +
                                                                         losses[losses.size() - 2] +
                                                                         losses[losses.size() - 3]) / 3;
  INFO("first " << first << ", last " << last);
  CHECK(last < first - 0.3);
}
