// moetrain_hybrid exports carry transformers remote code (python/moetrain_hf/, named by
// config.json's auto_map; docs/export.md#running-a-moetrain_hybrid-export-in-transformers).
// Without Python: the files are in the export, byte for byte the repository's, with auto_map,
// and only there (a kimi_linear export, which transformers' own class runs, has neither).
// With transformers (tests/reference/hf_remote_code.py; testing::hf_python in cli_fixtures.h: CI's is
// launch/test.sh's build/venv-hf-ci; skipped with one line when there is none): every
// shipped hybrid config (shrunk) and single-feature variant, trained 3 steps and exported,
// loads with AutoModelForCausalLM(trust_remote_code=True) and matches `moetrain eval` to 1e-5
// relative and `moetrain generate --temperature 0` for 100 tokens with and without its cache
// (with capacity, with it only); bf16 and sharded exports; save_pretrained (as loaded, fine-tuned,
// from_config) read back by --init-from.
#include <catch2/catch.hpp>

#include <filesystem>

#include <nlohmann/json.hpp>

#include "checkpoint/export.h"
#include "cli_fixtures.h"
#include "config/config.h"
#include "moetrain.h"
#include "testing.h"
#include "train/model_source.h"

using namespace moetrain;
using moetrain::testing::TempDir;
using std::string;
namespace fs = std::filesystem;

namespace {

const char* kRemoteCodeYaml = R"(model:
  arch: hybrid
  vocab_size: 256
  d_model: 16
  n_layer: 3
  n_ctx: 64
  layer_mixers: kda,mla,kda
  ffn: swiglu
  d_ff: 24
  attn_res: false
  kda: {n_head: 2, head_dim: 4, gate: softplus, full_rank_output_gate: false}
  mla: {n_head: 2, q_lora_rank: 0, kv_lora_rank: 4, qk_nope_head_dim: 4, qk_rope_head_dim: 2, v_head_dim: 4,
        output_gate: false}
  moe: {num_experts: 4, top_k: 2, expert_d_ff: 8, first_dense_layers: 1}
data: {tokenizer: byte}
train: {seq_len: 32}
)";

string remote_code_export(const TempDir& tmp, const string& name, const std::vector<string>& overrides) {
  ModelSource source;
  source.config_path = tmp.write(name + ".yaml", kRemoteCodeYaml);
  source.overrides = overrides;
  Config config = resolve_config(source);
  std::unique_ptr<LanguageModel> model = build_model(config);
  const string dir = tmp / (name + "/model");
  export_model(*model, dir, nullptr, &config);
  return dir;
}

}  // namespace

TEST_CASE("hf: a moetrain_hybrid export carries the remote code and auto_map; a kimi_linear one does not",
          "[cli][export][hf]") {
  TempDir tmp;
  const string k3 = remote_code_export(tmp, "k3", {"model.attn_res=true", "model.ffn=situ_glu"});
  const nlohmann::json cfg = nlohmann::json::parse(testing::read_bytes((fs::path(k3) / "config.json").string()));
  REQUIRE(cfg["model_type"] == "moetrain_hybrid");
  CHECK(cfg["auto_map"]["AutoConfig"] == "configuration_moetrain_hybrid.MoetrainHybridConfig");
  CHECK(cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_moetrain_hybrid.MoetrainHybridForCausalLM");
  for (const char* f : {"configuration_moetrain_hybrid.py", "modeling_moetrain_hybrid.py"}) {
    INFO(f);
    REQUIRE(fs::exists(fs::path(k3) / f));
    CHECK(testing::read_bytes((fs::path(k3) / f).string()) ==
          testing::read_bytes((fs::path(MOETRAIN_SOURCE_DIR) / "python/moetrain_hf" / f).string()));
  }
  // `moetrain export` of it writes them too (and the export reads back).
  moetrain::testing::CommandOutput r =
      moetrain::testing::run_moetrain("export --checkpoint " + k3 + " --out " + tmp / "k3_out --no-progress");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(fs::exists(tmp / "k3_out/modeling_moetrain_hybrid.py"));
  r = moetrain::testing::run_moetrain("generate --checkpoint " + tmp / "k3_out --max-new-tokens 4 --temperature 0");
  CHECK(r.code == 0);

  const string kimi = remote_code_export(tmp, "kimi", {});
  const nlohmann::json kcfg = nlohmann::json::parse(testing::read_bytes((fs::path(kimi) / "config.json").string()));
  CHECK(kcfg["model_type"] == "kimi_linear");
  CHECK_FALSE(kcfg.contains("auto_map"));
  CHECK_FALSE(fs::exists(fs::path(kimi) / "modeling_moetrain_hybrid.py"));
}

TEST_CASE("hf: moetrain_hybrid exports run in transformers (remote code) with moetrain's loss and greedy text",
          "[cli][export][hf][reference]") {
  const string python = moetrain::testing::hf_python("yaml");
  if (python.empty()) {
    WARN("skipped: no Python with torch, transformers >= 4.47, safetensors and yaml ("
         << moetrain::testing::kHfPythonHint << ")");
    return;
  }
  TempDir tmp;
  const string cmd = moetrain::testing::shell_quote(python) + " " + string(MOETRAIN_SOURCE_DIR) +
                     "/tests/reference/hf_remote_code.py " + string(MOETRAIN_BINARY_DIR) + "/moetrain " + tmp.path();
  moetrain::testing::CommandOutput r = moetrain::testing::capture_command(cmd);
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK(r.output.find("all remote-code checks agree") != string::npos);
}
