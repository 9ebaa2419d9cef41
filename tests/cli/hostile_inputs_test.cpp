// Inputs that cannot hurt, as a hostile user feeds them: sizes that overflow,
// thread counts far beyond the cores, multi-document YAML, key combinations that
// make no sense, integer tensors where float weights go, op inputs beyond a
// memory budget, checkpoints assembled from other saves, resumes that would
// silently change the learning-rate schedule. Each row of the tables is one
// command line: its exit code and the fragments its message must hold (the key,
// the file, the numbers involved), never a crash or a silent success.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "cli/cli_fixtures.h"
#include "checkpoint/safetensors.h"
#include "core/error.h"
#include "data/loader.h"
#include "data/shard.h"
#include "data/utf8.h"
#include "io/hdf5.h"
#include "moetrain.h"
#include "testing.h"

using moetrain::testing::TempDir;
using std::string;
namespace fs = std::filesystem;

namespace {

using Case = moetrain::testing::CommandCase;
const char* const kTinyGpt2 = moetrain::testing::kTinyGpt2Yaml;
void check_cases(const std::vector<Case>& cases) { moetrain::testing::check_command_cases(cases); }

using Result = moetrain::testing::CommandOutput;
Result run(const string& args) { return moetrain::testing::run_moetrain(args); }

// A byte-level data directory from the shipped corpus.
string prepare_data(const TempDir& tmp) {
  const Result r = run("prepare " + string(MOETRAIN_SOURCE_DIR) + "/data/tinyshakespeare.txt --out " + tmp.path() +
                       "/data --tokenizer byte --val-tokens 4096");
  INFO(r.output);
  REQUIRE(r.code == 0);
  return tmp.path() + "/data";
}

}  // namespace

TEST_CASE("hostile inputs: sizes, threads, YAML documents and key combinations are refused naming the key",
          "[cli]") {
  TempDir tmp;
  const string data = prepare_data(tmp);
  const string gpt2 = tmp.write("tiny.yaml", kTinyGpt2);
  const string train = "train -c " + gpt2 + " --set data.train=" + data + "/train_*.bin --set data.val= ";
  const string k3 = "train -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml --set data.train=" + data +
                    "/train_*.bin --set data.val= --set run.dir=" + tmp.path() + "/k3 ";
  const string two_docs = tmp.write("two.yaml", string(kTinyGpt2) + "---\nmodel:\n  n_layer: 12\n");
  string warmup_yaml = kTinyGpt2;
  warmup_yaml.replace(warmup_yaml.find("warmup_steps: 1\n"), 16, "warmup_steps: 10\n");
  const string long_warmup = tmp.write("warmup.yaml", warmup_yaml);
  const string trailing_end = tmp.write("end.yaml", string(kTinyGpt2) + "---\n");
  check_cases({
      {"a dimension beyond int64's products", train + "--set model.d_model=9223372036854775807", 2,
       {"model.d_model", "2147483647"}},
      {"a vocabulary of 9e18", train + "--set model.vocab_size=9000000000000000000", 2, {"model.vocab_size"}},
      {"grad_accum of 2^62", train + "--set train.grad_accum=4611686018427387904", 2, {"train.grad_accum"}},
      {"weights larger than the machine", train + "--set model.n_layer=4000 --set model.d_model=65536 "
       "--set model.n_head=64", 4, {"more than this machine's", "moetrain ledger"}},
      {"a second YAML document", "train -c " + two_docs + " --print-config", 2,
       {two_docs, "a second YAML document"}},
      {"warmup longer than the run, both in the file", "train -c " + long_warmup, 2,
       {long_warmup, "train.warmup_steps", "train.max_steps = 4"}},
      {"every layer dense in an MoE model", k3 + "--set model.moe.first_dense_layers=9", 2,
       {"model.moe.first_dense_layers", "model.n_layer = 9"}},
      {"MLA heads without dimensions", k3 + "--set model.mla.qk_nope_head_dim=0 --set model.mla.qk_rope_head_dim=0",
       2, {"model.mla.qk_nope_head_dim", "model.mla.qk_rope_head_dim"}},
      {"an unknown command", "frobnicate", 2, {"unknown command 'frobnicate'", "commands: info"}},
      {"a bad --device", train + "--device tpu", 2, {"--device"}},
  });
  // A run shortened on the command line below its warmup: a warning, and it trains.
  const Result shortened = run(train + "--set train.warmup_steps=3 --set train.max_steps=2 --set run.dir=" +
                               tmp.path() + "/short");
  INFO(shortened.output);
  CHECK(shortened.code == 0);
  CHECK_THAT(shortened.output, Catch::Contains("the run ends during the warmup"));
  // A trailing document marker with nothing after it is one document.
  CHECK(run("train -c " + trailing_end + " --print-config").code == 0);

  // 100,000 threads: lowered to 4 per core with a warning, and the run trains.
  const Result many = run(train + "--set train.threads=100000 --set run.dir=" + tmp.path() + "/threads");
  INFO(many.output);
  CHECK(many.code == 0);
  CHECK_THAT(many.output, Catch::Contains("train.threads") && Catch::Contains("threads, but this process may use"));

  // The common options after the subcommand, and --print-config wherever a config is read.
  for (const string& args : {train + "--threads 1 --print-config", "ledger --threads 1 -c " + gpt2 + " --print-config",
                             "generate -c " + gpt2 + " --print-config", "eval -c " + gpt2 + " --print-config"}) {
    const Result r = run(args);
    INFO(args << "\n" << r.output);
    CHECK(r.code == 0);
    CHECK_THAT(r.output, Catch::Contains("d_model: 32"));
  }
  // --device on generate and eval: cpu runs; cuda needs a GPU (tests/cli/cuda_train_test.cpp
  // compares the two where one is visible) and says so here, exit 2.
  CHECK(run("generate -c " + gpt2 + " --device cpu --prompt ab --max-new-tokens 4").code == 0);
  if (!moetrain::testing::gpu_available()) {
    for (const string& args : {"generate -c " + gpt2 + " --device cuda --prompt ab --max-new-tokens 4",
                               "eval -c " + gpt2 + " --device cuda --data " + tmp.path() + "/none.bin"}) {
      const Result r = run(args);
      INFO(args << "\n" << r.output);
      CHECK(r.code == 2);
      CHECK_THAT(r.output, Catch::Contains("--device cuda: ") && Catch::Contains("or pass --device cpu"));
    }
  }
  CHECK(run("eval -c " + gpt2 + " --device gpu --data x").code == 2);
  // --help shows the defaults (CLI11 writes them after '=').
  const Result help = run("generate --help");
  CHECK_THAT(help.output, Catch::Contains("INT:>= 0=40") && Catch::Contains("INT:>= 1=128") &&
                              Catch::Contains("--threads") && !Catch::Contains("=[]"));
}

TEST_CASE("hostile inputs: an integer tensor is never loaded into a float weight", "[cli]") {
  TempDir tmp;
  const string data = prepare_data(tmp);
  const string yaml = tmp.write("tiny.yaml", kTinyGpt2);
  REQUIRE(run("train -c " + yaml + " --set data.train=" + data + "/train_*.bin --set data.val= --set "
              "train.max_steps=1 --set run.dir=" + tmp.path() + "/run").code == 0);
  const string model = tmp.path() + "/run/model";
  // Past train.seq_len (16) the learned positions were never trained: a warning.
  const Result past = run("generate --checkpoint " + model + " --max-new-tokens 30");
  INFO(past.output);
  CHECK(past.code == 0);
  CHECK_THAT(past.output, Catch::Contains("train.seq_len = 16") && Catch::Contains("never trained"));
  CHECK_THAT(run("generate --checkpoint " + model + " --max-new-tokens 10").output, !Catch::Contains("never trained"));
  // The run's model directory with one weight rewritten as I32.
  {
    const moetrain::SafetensorsFile file = moetrain::SafetensorsFile::open(model + "/model.safetensors");
    std::vector<std::pair<string, moetrain::Tensor>> tensors;
    for (const moetrain::TensorEntry& e : file.entries())
      tensors.emplace_back(e.name, e.name == "h.0.ln_1.weight" ? file.read(e.name).to(moetrain::DType::i32)
                                                               : file.read(e.name));
    moetrain::write_safetensors(tmp.path() + "/bad.safetensors", tensors);
  }
  fs::rename(tmp.path() + "/bad.safetensors", model + "/model.safetensors");
  const Result r = run("generate --checkpoint " + model + " --max-new-tokens 4");
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("h.0.ln_1.weight") && Catch::Contains("i32") && Catch::Contains("f32"));
}

TEST_CASE("hostile inputs: moetrain op checks the input sizes against its memory budget before reading", "[cli]") {
  TempDir tmp;
  // An op input of a few MiB under a 1 MiB budget: refused naming the dataset and its size.
  const string in = tmp.path() + "/in.h5";
  {
    moetrain::hdf5::Writer w(in);
    w.write("/", "gate", moetrain::randn({256, 1024}, moetrain::DType::f64, 1));
    w.write("/", "up", moetrain::randn({256, 1024}, moetrain::DType::f64, 2));
    w.commit();
  }
  const Result r = moetrain::testing::capture_command("MOETRAIN_OP_MEMORY_MB=1 " + string(MOETRAIN_BINARY_DIR) +
                                                      "/moetrain op situ_glu --in " + in + " --out " + tmp.path() +
                                                      "/out.h5");
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains(in + ":/gate") && Catch::Contains("[256, 1024]") &&
                           Catch::Contains("MOETRAIN_OP_MEMORY_MB"));
  CHECK(!fs::exists(tmp.path() + "/out.h5"));
}

TEST_CASE("hostile inputs: a token shard truncated while it is read is an I/O error, not SIGBUS", "[data]") {
  TempDir tmp;
  const string path = tmp.path() + "/s.bin";
  std::vector<uint16_t> tokens(4096);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>(i % 200);
  moetrain::data::write_shard(path, tokens);
  moetrain::data::DataLoaderOptions o;
  o.batch_size = 2;
  o.seq_len = 64;
  o.vocab_size = 256;
  o.order = moetrain::data::LoaderOrder::sequential;
  moetrain::data::DataLoader loader(path, o);
  (void)loader.next();
  fs::resize_file(path, 1024 + 2 * 100);  // the header and 100 tokens left
  std::string message;
  try {
    (void)loader.next();
  } catch (const moetrain::IoError& e) {
    message = e.what();
  }
  CHECK_THAT(message, Catch::Contains(path) && Catch::Contains("truncated while in use"));
}

TEST_CASE("hostile inputs: generate's text is safe for a terminal", "[data]") {
  using moetrain::data::printable_text;
  CHECK(printable_text("to be\tor\nnot") == "to be\tor\nnot");
  CHECK(printable_text(string("a\0b", 3)) == "a\\x00b");
  CHECK(printable_text("\x1b[2J") == "\\x1b[2J");
  CHECK(printable_text("\xff") == "\xEF\xBF\xBD");
  CHECK(printable_text("caf\xc3\xa9") == "caf\xc3\xa9");
}

TEST_CASE("hostile inputs: checkpoints assembled from other saves and silent schedule changes are refused",
          "[cli]") {
  TempDir tmp;
  const string data = prepare_data(tmp);
  const string yaml = tmp.write("tiny.yaml", kTinyGpt2);
  const string run_dir = tmp.path() + "/run";
  const string train = "train -c " + yaml + " --set data.train=" + data + "/train_*.bin --set data.val= --set run.dir=" +
                       run_dir + " --set ckpt.every=2 --set ckpt.keep_last=5 ";
  Result r = run(train);
  INFO(r.output);
  REQUIRE(r.code == 0);
  const string ckpts = run_dir + "/checkpoints";
  REQUIRE(fs::exists(ckpts + "/step_00000002"));
  REQUIRE(fs::exists(ckpts + "/step_00000004"));

  // Resume with a longer cosine: refused naming the key, then applied when asked,
  // with the changed keys listed old -> new.
  r = run(train + "--set train.max_steps=6 --set ckpt.resume=auto");
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("train.max_steps: 4 -> 6") && Catch::Contains("ckpt.schedule_change"));
  // A constant schedule that runs longer changes no lr already planned: accepted.
  const string plain = tmp.write("plain.yaml", string(kTinyGpt2) + "  schedule: constant\n");
  const string train_plain = "train -c " + plain + " --set data.train=" + data + "/train_*.bin --set data.val= " +
                             "--set ckpt.every=2 --set run.dir=" + tmp.path() + "/plain ";
  REQUIRE(run(train_plain).code == 0);
  r = run(train_plain + "--set train.max_steps=6 --set ckpt.resume=auto");
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("train.max_steps: 4 -> 6"));

  // step_4 with step_2's rank file and a manifest recomputed to match it.
  const string s4 = ckpts + "/step_00000004";
  fs::copy_file(ckpts + "/step_00000002/rank_00000.h5", s4 + "/rank_00000.h5", fs::copy_options::overwrite_existing);
  nlohmann::json manifest = nlohmann::json::parse(std::ifstream(s4 + "/manifest.json"));
  for (auto& f : manifest["files"]) {
    f["bytes"] = fs::file_size(s4 + "/" + f["name"].get<string>());
    const Result sum = moetrain::testing::capture_command("sha256sum " + s4 + "/" + f["name"].get<string>(), false);
    f["sha256"] = sum.output.substr(0, 64);
  }
  std::ofstream(s4 + "/manifest.json") << manifest.dump(2);
  r = run(train + "--set ckpt.resume=step_00000004 --set train.max_steps=4");
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("rank_00000.h5") && Catch::Contains("records step = 2") &&
                           Catch::Contains("says 4"));

  // step_2 with an edited config.resolved.yaml (same size, one byte changed): its
  // SHA-256 no longer matches the manifest's.
  const string s2 = ckpts + "/step_00000002";
  {
    std::fstream f(s2 + "/config.resolved.yaml", std::ios::in | std::ios::out | std::ios::binary);
    char c = 0;
    f.get(c);
    f.seekp(0);
    f.put(static_cast<char>(c ^ 0x20));  // "model:" -> "Model:"
  }
  r = run(train + "--set ckpt.resume=step_00000002 --set train.max_steps=4");
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("config.resolved.yaml is corrupt: its SHA-256"));
}
