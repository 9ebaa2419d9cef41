// `moetrain export` (src/cli/export.cpp): a model directory as `moetrain train` writes
// it (<run>/model) in, an export directory out that `--checkpoint` and
// `model.init_from` load; bad input exits 2 with a message naming the path.
#include <filesystem>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "checkpoint/export.h"
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

ParameterList state_of(const LanguageModel& m) {
  ParameterList s = m.parameters();
  const ParameterList b = m.buffers();
  s.insert(s.end(), b.begin(), b.end());
  return s;
}

}  // namespace

TEST_CASE("cli: export writes a sharded bf16 Kimi-named directory that --checkpoint and init_from load", "[cli]") {
  TempDir tmp;
  // <run>/model of k3-tiny (9 layers: KDA, MLA, 16-expert latent MoE, AttnRes), as train writes it.
  ModelSource source;
  source.config_path = string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml";
  source.overrides = {"train.seed=5"};
  Config config = resolve_config(source);
  std::unique_ptr<LanguageModel> model = build_model(config);
  export_model(*model, tmp / "run/model");
  config.save(tmp / "run/model/config.resolved.yaml");

  Result r = run("export --checkpoint " + tmp / "run/model" + " --out " + tmp / "out" +
                 " --dtype bf16 --max-shard-size 1MB --no-progress");
  INFO(r.output);
  REQUIRE(r.code == 0);
  nlohmann::json index = nlohmann::json::parse(testing::read_bytes(tmp / "out/model.safetensors.index.json"));
  CHECK(index["weight_map"].contains("model.layers.8.block_sparse_moe.experts.15.w2.weight"));
  CHECK(index["weight_map"].contains("model.layers.4.self_attention_res_proj.weight"));
  CHECK(fs::exists(tmp / "out/model-00001-of-00002.safetensors"));
  CHECK(fs::exists(tmp / "out/config.json"));
  CHECK(fs::exists(tmp / "out/config.resolved.yaml"));

  // --checkpoint: the bf16 values converted to f32.
  ModelSource back;
  back.checkpoint = tmp / "out";
  std::unique_ptr<LanguageModel> loaded = build_model(resolve_config(back));
  const ParameterList a = state_of(*model), b = state_of(*loaded);
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].name);
    bool f32 = a[i].name.ends_with("A_log") || a[i].name.ends_with("dt_bias") || a[i].name.ends_with("_bias");
    CHECK(testing::bitwise_equal(b[i].tensor, f32 ? a[i].tensor : a[i].tensor.to(DType::bf16).to(DType::f32)));
  }
  // model.init_from with the YAML: the same weights.
  ModelSource init = source;
  init.overrides.push_back("model.init_from=" + tmp / "out");
  std::unique_ptr<LanguageModel> again = build_model(resolve_config(init));
  CHECK(testing::bitwise_equal(state_of(*again)[7].tensor, b[7].tensor));

  // The f32 export of the training directory holds the same bytes as the training export.
  Result same = run("export --checkpoint " + tmp / "run/model" + " --out " + tmp / "f32 --no-progress");
  REQUIRE(same.code == 0);
  CHECK(testing::read_bytes(tmp / "f32/model.safetensors") == testing::read_bytes(tmp / "run/model/model.safetensors"));
  Result h5 = run("export --checkpoint " + tmp / "run/model" + " --out " + tmp / "h5 --format hdf5 --no-progress");
  REQUIRE(h5.code == 0);
  CHECK(fs::exists(tmp / "h5/model.h5"));

  // Errors: exit 2, the path in the message.
  Result missing = run("export --checkpoint " + tmp / "nope" + " --out " + tmp / "x");
  CHECK(missing.code == 2);
  CHECK(missing.output.find(tmp / "nope") != string::npos);
  Result busy = run("export --checkpoint " + tmp / "run/model" + " --out " + tmp / "out");
  CHECK(busy.code == 2);
  CHECK(busy.output.find(tmp / "out") != string::npos);
  CHECK(busy.output.find("--force") != string::npos);
  Result self = run("export --checkpoint " + tmp / "run/model" + " --out " + tmp / "run/model --force");
  CHECK(self.code == 2);
  CHECK(self.output.find("is the --checkpoint directory") != string::npos);
  Result format = run("export --checkpoint " + tmp / "run/model" + " --out " + tmp / "y --format onnx");
  CHECK(format.code == 2);
  CHECK(format.output.find("'onnx'") != string::npos);
  Result size = run("export --checkpoint " + tmp / "run/model" + " --out " + tmp / "y --max-shard-size 5XB");
  CHECK(size.code == 2);
  CHECK(!fs::exists(tmp / "y"));
  Result forced = run("export --checkpoint " + tmp / "run/model" + " --out " + tmp / "out --force --no-progress");
  CHECK(forced.code == 0);
  CHECK(fs::exists(tmp / "out/model.safetensors"));
  CHECK(!fs::exists(tmp / "out/model.safetensors.index.json"));
}
