// The Hugging Face side of the CLI (docs/export.md): `moetrain export` says when
// transformers' own classes lack a model (model_type moetrain_hybrid and one line naming
// the features), --init-from reads a kimi_linear config.json without -c (a YAML key
// that contradicts it is an error naming the key), and GPT-2 config.json fields that
// change the math and that moetrain does not compute exit 2 naming the field.
#include <filesystem>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "checkpoint/export.h"
#include "config/config.h"
#include "moetrain.h"
#include "nn/gpt2.h"
#include "testing.h"
#include "train/model_source.h"

using namespace moetrain;
using moetrain::testing::TempDir;
using nlohmann::json;
using std::string;
namespace fs = std::filesystem;

namespace {

using Result = moetrain::testing::CommandOutput;
Result run(const string& args) { return moetrain::testing::run_moetrain(args); }

// A hybrid transformers' KimiLinear computes: KDA (softplus, low-rank gate), MLA
// without gate or RoPE, SwiGLU, sigmoid MoE with a shared expert, no AttnRes.
const char* kKimiYaml = R"(model:
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

// <dir>/model as `moetrain train` writes it, from YAML text (plus --set overrides).
string model_dir(const TempDir& tmp, const string& name, const string& yaml, const std::vector<string>& overrides = {}) {
  ModelSource source;
  source.config_path = tmp.write(name + ".yaml", yaml);
  source.overrides = overrides;
  Config config = resolve_config(source);
  std::unique_ptr<LanguageModel> model = build_model(config);
  const string dir = tmp / (name + "/model");
  export_model(*model, dir, nullptr, &config);
  return dir;
}

size_t count(const string& text, const string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

TEST_CASE("cli: export says moetrain_hybrid and names the features transformers' KimiLinear lacks", "[cli][hf]") {
  TempDir tmp;
  const string kimi = model_dir(tmp, "kimi", kKimiYaml);
  Result r = run("export --checkpoint " + kimi + " --out " + tmp / "kimi_out --no-progress");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.find("moetrain_hybrid") == string::npos);
  CHECK(json::parse(testing::read_bytes(tmp / "kimi_out/config.json"))["model_type"] == "kimi_linear");

  const string k3 = model_dir(tmp, "k3", kKimiYaml, {"model.attn_res=true", "model.mla.output_gate=true",
                                                     "model.kda.gate=lower_bound"});
  r = run("export --checkpoint " + k3 + " --out " + tmp / "k3_out --no-progress");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(count(r.output, "model_type moetrain_hybrid") == 1);  // one line
  CHECK(r.output.find("trust_remote_code=True") != string::npos);  // how to load it
  for (const char* feature : {"KDA lower-bound gate", "MLA output gate", "Block AttnRes"})
    CHECK(r.output.find(feature) != string::npos);
  json cfg = json::parse(testing::read_bytes(tmp / "k3_out/config.json"));
  CHECK(cfg["model_type"] == "moetrain_hybrid");
  CHECK(cfg["architectures"][0] == "MoetrainHybridForCausalLM");

  // Both read back from their config.json alone (no -c), to the same logits.
  for (const string& dir : {tmp / "kimi_out", tmp / "k3_out"}) {
    INFO(dir);
    Result g = run("generate --init-from " + dir + " --set data.tokenizer=byte --prompt ab --max-new-tokens 4 "
                   "--temperature 0");
    CHECK(g.code == 0);
    ModelSource from_json, from_yaml;
    from_json.init_from = dir;
    from_yaml.checkpoint = dir;
    Tensor ids = full({1, 5}, 7.0, DType::i32);
    CHECK(testing::max_abs_diff(build_model(resolve_config(from_json))->forward(ids, false),
                                build_model(resolve_config(from_yaml))->forward(ids, false)) == 0);
  }
}

TEST_CASE("cli: --init-from a kimi_linear directory with a YAML that contradicts it names the key", "[cli][hf]") {
  TempDir tmp;
  const string kimi = model_dir(tmp, "kimi", kKimiYaml);
  // The same architecture spelled otherwise is no conflict (the schedule by period keys, d_ff 0 = 4 * d_model).
  const string same = tmp.write("same.yaml", "model: {arch: hybrid, n_layer: 3, mixer: kda, attn_mixer: mla, "
                                             "attn_every: 2, attn_offset: 1, attn_last: false, d_model: 16}\n");
  Result ok = run("generate -c " + same + " --init-from " + kimi + " --set data.tokenizer=byte --prompt a "
                  "--max-new-tokens 2 --temperature 0");
  INFO(ok.output);
  CHECK(ok.code == 0);
  const string other = tmp.write("other.yaml", "model: {arch: hybrid, d_model: 32}\n");
  Result r = run("generate -c " + other + " --init-from " + kimi + " --set data.tokenizer=byte --prompt a");
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK(r.output.find("other.yaml") != string::npos);
  CHECK(r.output.find("model.d_model") != string::npos);
  CHECK(r.output.find("conflicts with model.d_model = 16") != string::npos);
}

TEST_CASE("cli: GPT-2 config.json fields moetrain does not compute exit 2 naming the field", "[cli][hf][errors]") {
  TempDir tmp;
  Gpt2Config c;
  c.vocab_size = 256;
  c.n_layer = 1;
  c.n_head = 2;
  c.d_model = 8;
  c.n_ctx = 16;
  c.d_ff = 12;
  Gpt2 model(c, 1);
  ExportOptions o;
  export_model_dir(model, {}, tmp / "gpt2", o);
  const json base = json::parse(testing::read_bytes(tmp / "gpt2/config.json"));
  auto with = [&](const string& field, const json& value) {
    const string dir = tmp / ("gpt2_" + field);
    fs::create_directories(dir);
    fs::copy_file(tmp / "gpt2/model.safetensors", dir + "/model.safetensors");
    json j = base;
    j[field] = value;
    testing::write_bytes(dir + "/config.json", j.dump());
    return dir;
  };
  for (const auto& [field, value] : std::vector<std::pair<string, json>>{{"tie_word_embeddings", false},
                                                                        {"scale_attn_weights", false},
                                                                        {"scale_attn_by_inverse_layer_idx", true},
                                                                        {"add_cross_attention", true},
                                                                        {"activation_function", "gelu"}}) {
    DYNAMIC_SECTION(field) {
      Result r = run("generate --init-from " + with(field, value) + " --set data.tokenizer=byte --prompt a");
      INFO(r.output);
      CHECK(r.code == 2);
      CHECK(r.output.find(field) != string::npos);
      CHECK(r.output.find("config.json") != string::npos);
    }
  }
  // Honoured: n_inner, layer_norm_epsilon; reorder_and_upcast_attn only reorders f32 math.
  const string ok = with("reorder_and_upcast_attn", true);
  json j = json::parse(testing::read_bytes(ok + "/config.json"));
  j["layer_norm_epsilon"] = 1e-3;
  testing::write_bytes(ok + "/config.json", j.dump());
  ModelSource source;
  source.init_from = ok;
  Config config = resolve_config(source);
  CHECK(config.get_number("model.layer_norm_eps") == 1e-3);
  CHECK(config.get_int("model.d_ff") == 12);
  CHECK(config.where("model.d_ff") == ok + "/config.json");
}
