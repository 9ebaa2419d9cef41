// Non-finite weights as a user meets them. A weight file with a NaN or an infinity
// (poked into the bytes of a model.safetensors by the test) is refused by eval,
// generate, train's model.init_from and export: exit 2 naming the file and the
// tensor. A model whose values cannot be written finitely (f32 beyond bf16's range,
// exported in bf16) is refused by export: exit 3 naming the tensor, nothing written.
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "config/config.h"
#include "moetrain.h"
#include "testing.h"
#include "train/model_source.h"

using namespace moetrain;
using moetrain::testing::TempDir;
using std::string;
namespace fs = std::filesystem;

namespace {

using Result = moetrain::testing::CommandOutput;
Result run(const string& args) { return moetrain::testing::run_moetrain(args); }

const char* kTinyGpt2 = "model:\n  vocab_size: 256\n  n_layer: 2\n  n_head: 2\n  d_model: 32\n  n_ctx: 64\n"
                        "data:\n  tokenizer: byte\n";

// Sets element `index` of the F32 tensor `name` of a safetensors file to `value`, by
// the format alone: u64 little-endian header length N, the JSON header, the data
// buffer at 8 + N (data_offsets relative to it).
void poke_f32(const string& path, const string& name, int64_t index, float value) {
  string bytes = moetrain::testing::read_bytes(path);
  REQUIRE(bytes.size() >= 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[static_cast<size_t>(i)]);
  const nlohmann::json header = nlohmann::json::parse(bytes.substr(8, n));
  REQUIRE(header.contains(name));
  REQUIRE(header[name]["dtype"] == "F32");
  const auto begin = header[name]["data_offsets"][0].get<uint64_t>();
  std::memcpy(&bytes[8 + n + begin + 4 * static_cast<uint64_t>(index)], &value, 4);
  moetrain::testing::write_bytes(path, bytes);
}

// The one line of `output` holding `needle` (the error; info lines come before it).
string line_with(const string& output, const string& needle) {
  const size_t at = output.find(needle);
  if (at == string::npos) return "";
  const size_t begin = output.rfind('\n', at), end = output.find('\n', at);
  return output.substr(begin == string::npos ? 0 : begin + 1, end == string::npos ? string::npos : end - begin - 1);
}

struct Workspace {
  TempDir tmp;
  string config;  // tiny GPT-2 on bytes with tmp/data
  Workspace() {
    Result r = run("prepare " + string(MOETRAIN_SOURCE_DIR) + "/data/tinyshakespeare.txt --out " + tmp / "data" +
                   " --tokenizer byte --val-tokens 8192");
    INFO(r.output);
    REQUIRE(r.code == 0);
    config = tmp.write("tiny.yaml", string(kTinyGpt2) + "  train: " + tmp / "data/train_*.bin" + "\n  val: " +
                       tmp / "data/val_*.bin" + "\ntrain:\n  batch_size: 2\n  seq_len: 16\n  max_steps: 2\n"
                       "  eval_every: 0\n");
  }
  // <tmp>/<name>: a model directory as `moetrain train` writes it, from `model`.
  string model_dir(const string& name, const LanguageModel& model, const Config& c) const {
    export_model(model, tmp / name);
    c.save(tmp / (name + "/config.resolved.yaml"));
    return tmp / name;
  }
};

}  // namespace

TEST_CASE("cli: eval, generate, train's init_from and export refuse a weight file holding NaN or inf (exit 2 naming "
          "the file and the tensor)", "[cli]") {
  Workspace w;
  Config config = Config::load(w.config);
  std::unique_ptr<LanguageModel> model = build_model(config);
  const string good = w.model_dir("good", *model, config);
  const string nan = w.model_dir("nan", *model, config), inf = w.model_dir("inf", *model, config);
  poke_f32(nan + "/model.safetensors", "h.1.mlp.c_fc.weight", 7, std::numeric_limits<float>::quiet_NaN());
  poke_f32(inf + "/model.safetensors", "wte.weight", 0, -std::numeric_limits<float>::infinity());
  const string data = " --data '" + w.tmp / "data/val_*.bin" + "' --batches 1";

  // The same command on the intact copy works: what fails below is the value.
  Result ok = run("eval --checkpoint " + good + data);
  INFO(ok.output);
  REQUIRE(ok.code == 0);

  struct Case {
    string command, file, tensor;
  };
  const Case cases[] = {
      {"eval --checkpoint " + nan + data, nan, "h.1.mlp.c_fc.weight [128, 32]: 1 of 4096 values are NaN or infinite"},
      {"eval --checkpoint " + inf + data, inf, "wte.weight [256, 32]: 1 of 8192 values are NaN or infinite"},
      {"generate --checkpoint " + nan + " --max-new-tokens 4", nan, "h.1.mlp.c_fc.weight"},
      {"generate -c " + w.config + " --init-from " + nan + "/model.safetensors --max-new-tokens 4",
       nan + "/model.safetensors", "h.1.mlp.c_fc.weight"},
      {"train -c " + w.config + " --set model.init_from=" + inf + " --set run.dir=" + w.tmp / "run", inf,
       "wte.weight"},
      {"export --checkpoint " + nan + " --out " + w.tmp / "exported --no-progress", nan, "h.1.mlp.c_fc.weight"},
  };
  for (const Case& c : cases) {
    INFO(c.command);
    Result r = run(c.command);
    INFO(r.output);
    CHECK(r.code == 2);
    const string error = line_with(r.output, c.tensor);
    CHECK(error.find(c.file) != string::npos);
    CHECK(error.find("non-finite") != string::npos);
  }
  CHECK(!fs::exists(w.tmp / "run/model"));
  CHECK(!fs::exists(w.tmp / "exported"));
}

TEST_CASE("cli: export refuses a tensor that rounds to infinity in bf16 (exit 3 naming it) and writes nothing",
          "[cli]") {
  Workspace w;
  Config config = Config::load(w.config);
  std::unique_ptr<LanguageModel> model = build_model(config);
  for (NamedParameter& p : model->parameters())
    if (p.name == "h.0.attn.c_proj.weight") p.tensor.data<float>()[3] = 3.4e38f;  // finite; bf16's largest is 3.39e38
  const string big = w.model_dir("big", *model, config);

  Result bf16 = run("export --checkpoint " + big + " --out " + w.tmp / "out --dtype bf16 --no-progress");
  INFO(bf16.output);
  CHECK(bf16.code == 3);
  const string error = line_with(bf16.output, "h.0.attn.c_proj.weight");
  CHECK(error.find("export to " + w.tmp / "out") != string::npos);
  CHECK(error.find("bf16") != string::npos);
  CHECK(error.find("1 of 1024 values are NaN or infinite") != string::npos);
  CHECK(!fs::exists(w.tmp / "out"));
  for (const string& name : w.tmp.listing()) CHECK(name.rfind("out", 0) != 0);  // no out.tmp.<pid> either

  Result f32 = run("export --checkpoint " + big + " --out " + w.tmp / "out --no-progress");
  INFO(f32.output);
  CHECK(f32.code == 0);
}
