// `--set` with --init-from (docs/export.md#importing-config-json-and-transformers-save-format):
// the conflict check compares the resolved values, YAML and --set together, with the
// config.json. A --set that changes the architecture config.json describes is refused like a
// YAML key (exit 2, naming the key, the --set and the config.json) in eval and generate
// (export takes no --set); a YAML key that --set brings back into agreement is accepted; --set keys that do
// not describe the architecture (the tokenizer, the KDA chunk size) are taken as before.
#include <cstring>
#include <filesystem>

#include <catch2/catch.hpp>

#include "checkpoint/export.h"
#include "config/config.h"
#include "moetrain.h"
#include "testing.h"
#include "train/model_source.h"

using namespace moetrain;
using moetrain::testing::TempDir;
using std::string;

namespace {

using SetConflictResult = moetrain::testing::CommandOutput;

// A hybrid transformers' KimiLinear computes (exported as kimi_linear).
const char* kSetConflictKimiYaml = R"(model:
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
  moe: {num_experts: 4, top_k: 2, expert_d_ff: 8, first_dense_layers: 1, routed_scaling_factor: 2.0}
data: {tokenizer: byte}
train: {seq_len: 32}
)";

const char* kSetConflictGpt2Yaml = R"(model: {arch: gpt2, vocab_size: 256, n_layer: 2, n_head: 2, d_model: 16, n_ctx: 64}
data: {tokenizer: byte}
train: {seq_len: 32}
)";

string set_conflict_model(const TempDir& tmp, const string& name, const string& yaml) {
  ModelSource source;
  source.config_path = tmp.write(name + ".yaml", yaml);
  Config config = resolve_config(source);
  std::unique_ptr<LanguageModel> model = build_model(config);
  const string dir = tmp / (name + "/model");
  export_model(*model, dir, nullptr, &config);
  return dir;
}

// A shard of random bytes for eval.
string set_conflict_shard(const TempDir& tmp) {
  std::vector<uint16_t> tokens(200);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint16_t>((i * 37 + 11) % 256);
  string bytes(1024, '\0');
  const int32_t header[3] = {20240520, 1, static_cast<int32_t>(tokens.size())};
  std::memcpy(bytes.data(), header, sizeof(header));
  bytes.append(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2);
  return tmp.write("val_000.bin", bytes);
}

SetConflictResult set_conflict_run(const string& args) { return moetrain::testing::run_moetrain(args); }

}  // namespace

TEST_CASE("cli: --set that contradicts --init-from's config.json is refused in eval and generate",
          "[cli][hf][config]") {
  TempDir tmp;
  const string kimi = set_conflict_model(tmp, "kimi", kSetConflictKimiYaml);
  const string data = set_conflict_shard(tmp);
  const std::vector<std::pair<string, string>> conflicts = {
      {"model.kda.gate", "lower_bound"}, {"model.moe.router_score", "softmax"}, {"model.mla.rope", "true"},
      {"model.moe.top_k", "1"}, {"model.moe.routed_scaling_factor", "3.0"}};
  for (const auto& [key, value] : conflicts) {
    DYNAMIC_SECTION(key << "=" << value) {
      const string set = " --set " + key + "=" + value;
      for (const string& cmd : {"eval --init-from " + kimi + " --data " + data + " --seq-len 16" + set,
                                "generate --init-from " + kimi + " --max-new-tokens 2 --temperature 0" + set}) {
        SetConflictResult r = set_conflict_run(cmd);
        INFO(cmd << "\n" << r.output);
        CHECK(r.code == 2);
        CHECK(r.output.find("--set " + key + "=" + value) != string::npos);
        CHECK(r.output.find("conflicts with " + key) != string::npos);
        CHECK(r.output.find("config.json") != string::npos);
      }
    }
  }
  // GPT-2's layer norm epsilon.
  const string gpt2 = set_conflict_model(tmp, "gpt2", kSetConflictGpt2Yaml);
  SetConflictResult r =
      set_conflict_run("eval --init-from " + gpt2 + " --data " + data + " --seq-len 16 --set model.layer_norm_eps=0.1");
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK(r.output.find("conflicts with model.layer_norm_eps") != string::npos);
}

TEST_CASE("cli: --set that agrees with config.json, or brings a YAML key back to it, is accepted",
          "[cli][hf][config]") {
  TempDir tmp;
  const string kimi = set_conflict_model(tmp, "kimi", kSetConflictKimiYaml);
  const string data = set_conflict_shard(tmp);
  const string eval = "eval --init-from " + kimi + " --data " + data + " --seq-len 16 --json";
  SetConflictResult plain = set_conflict_run(eval);
  INFO(plain.output);
  REQUIRE(plain.code == 0);
  // The same values, and keys that do not describe the architecture.
  SetConflictResult same = set_conflict_run(eval + " --set model.kda.gate=softplus --set model.kda.chunk_size=8");
  INFO(same.output);
  CHECK(same.code == 0);
  // A YAML that says lower_bound, brought back to config.json's softplus by --set.
  const string yaml = tmp.write("lb.yaml", "model: {arch: hybrid, kda: {gate: lower_bound}}\ndata: {tokenizer: byte}\n");
  SetConflictResult back = set_conflict_run("eval -c " + yaml + " --init-from " + kimi + " --data " + data +
                                            " --seq-len 16 --json --set model.kda.gate=softplus");
  INFO(back.output);
  CHECK(back.code == 0);
  CHECK(back.output == plain.output);
  // Without the --set, the YAML key is refused, naming the YAML.
  SetConflictResult yaml_only =
      set_conflict_run("eval -c " + yaml + " --init-from " + kimi + " --data " + data + " --seq-len 16");
  INFO(yaml_only.output);
  CHECK(yaml_only.code == 2);
  CHECK(yaml_only.output.find("lb.yaml") != string::npos);
}
