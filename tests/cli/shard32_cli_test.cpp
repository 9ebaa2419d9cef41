// A vocabulary beyond uint16 end to end: `train` and `eval` on llm.c uint32 token
// shards (magic 20240801, version 7) with ids up to 69999, and shards whose ids
// exceed model.vocab_size refused naming the file.
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/cli_fixtures.h"
#include "data/shard.h"
#include "testing.h"

using moetrain::testing::CommandOutput;
using moetrain::testing::TempDir;
using std::string;

namespace {

constexpr int64_t kVocab = 70000;

// n ids in [0, kVocab), 69999 and the uint16 boundary 65535, 65536 among them.
std::vector<uint32_t> ids_above_uint16(size_t n, uint64_t salt) {
  std::vector<uint32_t> ids(n);
  for (size_t i = 0; i < n; ++i) ids[i] = static_cast<uint32_t>(((i + salt) * 2654435761ull) % kVocab);
  ids[3] = kVocab - 1;
  ids[5] = 65535;
  ids[8] = 65536;
  return ids;
}

// A tiny GPT-2 whose 70000-row embedding stays cheap (d_model 16), on uint32 shards.
string write_config(const TempDir& tmp, const string& train, const string& val) {
  const string path = tmp.path() + "/v70k.yaml";
  moetrain::testing::write_bytes(
      path, "model:\n  vocab_size: " + std::to_string(kVocab) + "\n  n_layer: 1\n  n_head: 2\n  d_model: 16\n"
            "  n_ctx: 32\n"
            "data:\n  tokenizer: byte\n  train: " + train + "\n  val: " + val + "\n"
            "train:\n  batch_size: 2\n  seq_len: 16\n  max_steps: 2\n  warmup_steps: 1\n  eval_every: 2\n"
            "  eval_batches: 1\n  threads: 1\n  log_every: 1\n"
            "run:\n  dir: " + tmp.path() + "/run\n");
  return path;
}

}  // namespace

TEST_CASE("shard32 cli: train and eval a 70000-token vocabulary on uint32 shards", "[cli]") {
  TempDir tmp;
  const string train = tmp.path() + "/train_000000.bin", val = tmp.path() + "/val_000000.bin";
  moetrain::data::write_shard(train, ids_above_uint16(2048, 1), moetrain::data::TokenWidth::u32);
  moetrain::data::write_shard(val, ids_above_uint16(512, 99), moetrain::data::TokenWidth::u32);
  const string config = write_config(tmp, train, val);

  const CommandOutput trained = moetrain::testing::run_moetrain("train -c " + config);
  INFO(trained.output);
  REQUIRE(trained.code == 0);
  CHECK_THAT(trained.output, Catch::Contains("step 2/2 | loss") && Catch::Contains("val loss"));
  CHECK(moetrain::testing::steps_of(moetrain::testing::read_bytes(tmp.path() + "/run/metrics.jsonl")).back() == 2);

  const CommandOutput ev = moetrain::testing::run_moetrain(
      "eval --checkpoint " + tmp.path() + "/run/model --data " + val + " --batches 4 --json", false);
  INFO(ev.output);
  REQUIRE(ev.code == 0);
  CHECK_THAT(ev.output, Catch::Contains("\"tokens\": 64"));
  const size_t at = ev.output.find("\"loss\": ");
  REQUIRE(at != string::npos);
  const double loss = std::stod(ev.output.substr(at + 8));
  // Two steps from initialisation: near ln(70000) = 11.16, and finite.
  CHECK(std::isfinite(loss));
  CHECK(loss > 9.0);
  CHECK(loss < 13.0);
}

TEST_CASE("shard32 cli: ids at or above model.vocab_size in a uint32 shard are refused naming the file", "[cli]") {
  TempDir tmp;
  const string train = tmp.path() + "/train_000000.bin", val = tmp.path() + "/val_000000.bin",
               bad = tmp.path() + "/bad_000000.bin";
  moetrain::data::write_shard(train, ids_above_uint16(2048, 1), moetrain::data::TokenWidth::u32);
  moetrain::data::write_shard(val, ids_above_uint16(512, 99), moetrain::data::TokenWidth::u32);
  std::vector<uint32_t> ids = ids_above_uint16(2048, 5);
  ids[777] = kVocab;  // one past the vocabulary
  moetrain::data::write_shard(bad, ids, moetrain::data::TokenWidth::u32);
  const string config = write_config(tmp, train, val);

  const string refusal = "token id 70000 at token offset 777 (byte offset 4132) is outside the vocabulary [0, 70000)";
  const string elsewhere = " --set run.dir=" + tmp.path() + "/refused";
  moetrain::testing::check_command_cases({
      {"train on a shard with an id past the vocabulary",
       "train -c " + config + elsewhere + " --set data.train=" + bad, 2, {bad, refusal, "data.train"}},
      {"a smaller vocabulary than the shard's ids",
       "train -c " + config + elsewhere + " --set model.vocab_size=65536", 2,
       {train, "is outside the vocabulary [0, 65536)", "data.train"}},
  });
  CHECK(!std::filesystem::exists(tmp.path() + "/refused/model"));

  const CommandOutput trained = moetrain::testing::run_moetrain("train -c " + config);
  INFO(trained.output);
  REQUIRE(trained.code == 0);
  moetrain::testing::check_command_cases({
      {"eval on a shard with an id past the vocabulary",
       "eval --checkpoint " + tmp.path() + "/run/model --data " + bad, 2, {bad, refusal}},
  });
}
