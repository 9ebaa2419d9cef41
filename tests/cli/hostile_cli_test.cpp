// Issue 35, command-line options and model sources, as a hostile user meets them:
// - `train` with model.init_from: DIR reads DIR/config.json as generate and eval's
//   --init-from do: a YAML key that contradicts it exits 2 naming the key and the
//   config.json, garbage JSON exits 2 naming the file, and a YAML that leaves the
//   model to config.json trains the exported model (its first loss is the export's
//   eval loss on the same batch);
// - every numeric option refuses NaN, infinities, numbers f32 cannot hold, negative
//   values for unsigned ones and integers that would wrap, exit 2 naming the option;
// - weights without config.json (a directory lacking it, a bare .safetensors) and no
//   -c exit 2 saying so; with a YAML that does not fit them, the message says where the
//   shape came from;
// - the train.zero 1 start-up line counts the ranks sharing one stage's optimizer
//   state (2 at pp 2 x dp 2, not the 4 ranks).
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

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

bool has(const string& text, const string& what) { return text.find(what) != string::npos; }

// A tiny hybrid whose config.json says what a YAML could contradict: an untied head,
// SwiGLU, top_k 2 of 4 experts, d_model 16 (transformers' KimiLinear computes it).
const char* kModelYaml = R"(model:
  arch: hybrid
  vocab_size: 256
  d_model: 16
  n_layer: 3
  n_ctx: 64
  layer_mixers: kda,mla,kda
  ffn: swiglu
  d_ff: 24
  attn_res: false
  tie_embeddings: false
  kda: {n_head: 2, head_dim: 4, gate: softplus, full_rank_output_gate: false}
  mla: {n_head: 2, q_lora_rank: 0, kv_lora_rank: 4, qk_nope_head_dim: 4, qk_rope_head_dim: 2, v_head_dim: 4,
        output_gate: false}
  moe: {num_experts: 4, top_k: 2, expert_d_ff: 8, first_dense_layers: 1}
data: {tokenizer: byte}
train: {seq_len: 16}
)";

// An export of kModelYaml's model (random weights, seed train.seed): DIR with
// config.json, model.safetensors and config.resolved.yaml.
string export_model_dir(const TempDir& tmp, const string& name) {
  ModelSource source;
  source.config_path = tmp.write(name + ".yaml", kModelYaml);
  Config config = resolve_config(source);
  std::unique_ptr<LanguageModel> model = build_model(config);
  const string dir = tmp / name;
  export_model(*model, dir, nullptr, &config);
  return dir;
}

// 46 byte tokens: two windows of T = 16 (floor(45 / 16)), so a batch of 2 is the whole
// shard in either order; data/train_000000.bin.
string two_window_shard(const TempDir& tmp) {
  const string text = tmp.write("text.txt", "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJ");
  const Result r = run("prepare " + text + " --out " + tmp / "data --tokenizer byte --val-tokens 0");
  INFO(r.output);
  REQUIRE(r.code == 0);
  return tmp / "data/train_000000.bin";
}

// `moetrain train` of `yaml` (model.init_from and any model keys) for `steps` steps on
// `shard`, batches of 2 x 16 tokens, one thread.
Result train(const TempDir& tmp, const string& name, const string& yaml, const string& shard, int steps = 1) {
  const string config = tmp.write(name + ".yaml", yaml + "data: {tokenizer: byte, train: " + shard + ", val: ''}\n"
                                  "train: {seq_len: 16, batch_size: 2, max_steps: " + std::to_string(steps) +
                                  ", warmup_steps: 0, eval_every: 0, sample_every: 0, threads: 1}\n"
                                  "run: {dir: " + tmp / (name + "_run") + "}\n");
  return run("train -c " + config);
}

}  // namespace

TEST_CASE("hostile cli: train's model.init_from reads DIR/config.json; a YAML key that contradicts it exits 2 naming "
          "the key and config.json", "[cli]") {
  TempDir tmp;
  const string dir = export_model_dir(tmp, "export");
  const string shard = two_window_shard(tmp);
  const string json = dir + "/config.json";
  // Each contradicts config.json in one key; before train read config.json, the first two trained the YAML's
  // model (a SiTU-GLU, top_k 3) from the export's weights and the third failed on the head's tensors.
  const std::vector<std::pair<string, string>> conflicts = {
      {"model.ffn", "  ffn: situ_glu\n"},
      {"model.moe.top_k", "  moe: {top_k: 3}\n"},
      {"model.tie_embeddings", "  tie_embeddings: true\n"},
      {"model.d_model", "  d_model: 24\n"},
  };
  for (const auto& [key, line] : conflicts) {
    const Result r = train(tmp, "conflict", "model:\n  init_from: " + dir + "\n" + line, shard);
    INFO(key << ": " << r.output);
    CHECK(r.code == 2);
    CHECK(has(r.output, "conflict.yaml:"));
    CHECK(has(r.output, key + " = "));
    CHECK(has(r.output, "conflicts with " + key));
    CHECK(has(r.output, json));
    CHECK_FALSE(fs::exists(tmp / "conflict_run/metrics.jsonl"));
  }
  {  // a mixer schedule given by the period keys is named by the key the YAML set, with the schedule it gives
    const Result r = train(tmp, "schedule", "model:\n  init_from: " + dir + "\n  n_layer: 3\n  attn_every: 3\n", shard);
    INFO(r.output);
    CHECK(r.code == 2);
    CHECK(has(r.output, "schedule.yaml:4:3: model.attn_every = 3: gives the layer schedule kda,kda,mla (with "
                        "model.n_layer = 3), which conflicts with model.layer_mixers = kda,mla,kda in " + json));
  }
  {  // a --set that contradicts config.json is named as the --set
    const string config = tmp.write("set.yaml", "model: {init_from: " + dir + "}\ndata: {tokenizer: byte, train: " +
                                    shard + "}\ntrain: {seq_len: 16, threads: 1}\nrun: {dir: " + tmp / "set_run" +
                                    "}\n");
    const Result r = run("train -c " + config + " --set model.n_layer=2");
    INFO(r.output);
    CHECK(r.code == 2);
    CHECK(has(r.output, "--set model.n_layer=2"));
    CHECK(has(r.output, json));
  }
}

TEST_CASE("hostile cli: train's model.init_from with a config.json that is not JSON exits 2 naming the file", "[cli]") {
  TempDir tmp;
  const string dir = export_model_dir(tmp, "export");
  const string shard = two_window_shard(tmp);
  testing::write_bytes(dir + "/config.json", "{\"model_type\": \"kimi_linear\", oops");
  // The YAML says the whole model, as the export's config.resolved.yaml does: nothing but config.json is wrong.
  const Result r = train(tmp, "garbage", string(kModelYaml).substr(0, string(kModelYaml).find("data:")) +
                                             "  init_from: " + dir + "\n", shard);
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK(has(r.output, dir + "/config.json: not valid JSON"));
  CHECK_FALSE(fs::exists(tmp / "garbage_run/metrics.jsonl"));
}

TEST_CASE("hostile cli: train from a model.init_from directory whose config.json the YAML leaves alone or agrees with "
          "starts from the export: first loss = its eval loss", "[cli]") {
  TempDir tmp;
  const string dir = export_model_dir(tmp, "export");
  const string shard = two_window_shard(tmp);
  const Result e = run("eval --init-from " + dir + " --data " + shard + " --seq-len 16 --batch-size 2 --json");
  INFO(e.output);
  REQUIRE(e.code == 0);
  const double want = nlohmann::json::parse(e.output.substr(e.output.find('{')))["loss"].get<double>();
  // No model keys (the defaults are GPT-2 124M, which these weights do not fit), and the same architecture spelled
  // otherwise (the mixer schedule by period keys, d_ff and top_k as config.json says).
  const std::vector<std::pair<string, string>> yamls = {
      {"alone", "model: {init_from: " + dir + "}\n"},
      {"agrees", "model: {init_from: " + dir + ", arch: hybrid, n_layer: 3, mixer: kda, attn_mixer: mla, "
                 "attn_every: 2, attn_offset: 1, attn_last: false, d_ff: 24, moe: {top_k: 2}, "
                 "tie_embeddings: false}\n"},
  };
  for (const auto& [name, yaml] : yamls) {
    const Result r = train(tmp, name, yaml, shard);
    INFO(name << ": " << r.output);
    CHECK(r.code == 0);
    const std::vector<double> losses = testing::metrics_losses(tmp / (name + "_run"));
    REQUIRE(losses.size() == 1);
    // The same weights on the same two windows; only the order of the rows in the batch (shuffled vs
    // sequential) and so the summation order may differ: f32, 1e-5 relative.
    CHECK(std::abs(losses[0] - want) <= 1e-5 * want);
  }
}

TEST_CASE("hostile cli: numeric options refuse NaN, infinities, out-of-range and wrapping text, exit 2 naming the "
          "option", "[cli]") {
  TempDir tmp;
  const string dir = export_model_dir(tmp, "export");
  const string shard = two_window_shard(tmp);
  const string gen = "generate --init-from " + dir + " --set data.tokenizer=byte --prompt ab ";
  const string eval = "eval --init-from " + dir + " --data " + shard + " --seq-len 16 ";
  const string ledger = "ledger -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml ";
  struct Case {
    string command, option, value, says;  // runs `command option value`
  };
  // Before these checks, the generate and ledger rows with nan, inf, -1, 2^64 and 1e39 ran to exit 0 (nan and
  // inf sampled uniform bytes, -1 and 2^64 became seed 18446744073709551615, 1e39 an infinite temperature).
  const std::vector<Case> cases = {
      {gen, "--temperature", "nan", "expected a finite number, got 'nan'"},
      {gen, "--temperature", "inf", "expected a finite number, got 'inf'"},
      {gen, "--temperature", "-inf", "expected a finite number, got '-inf'"},
      {gen, "--temperature", "1e39", "outside what f32 can hold"},
      {gen, "--temperature", "1e-40", "outside what f32 can hold"},
      {gen, "--temperature", "1e400", "outside what f32 can hold"},
      {gen, "--seed", "-1", "must be >= 0, got -1"},
      {gen, "--seed", "18446744073709551616", "beyond the largest value, 18446744073709551615"},
      {gen, "--seed", "1e23", "expected a whole number in decimal digits, got '1e23'"},
      {gen, "--seed", "2^64", "expected a whole number in decimal digits, got '2^64'"},
      {gen, "--seed", "0x10", "expected a whole number in decimal digits"},
      {gen, "--seed", "", "expected a whole number in decimal digits, got ''"},
      {gen, "--top-k", "nan", "expected a whole number"},
      {gen, "--top-k", "9223372036854775808", "outside the 64-bit range"},
      {gen, "--max-new-tokens", "99999999999999999999", "outside the 64-bit range"},
      {gen, "--num-samples", "1.5", "expected a whole number"},
      {eval, "--batch-size", "1e3", "expected a whole number"},
      {eval, "--batches", "-99999999999999999999", "outside the 64-bit range"},
      {gen, "--threads", "99999999999999999999", "outside the 64-bit range"},
      {"", "--threads", "nan", "expected a whole number"},  // the top-level option, before the command
      {ledger, "--mfu", "nan", "expected a finite number"},
      {ledger, "--peak-tflops", "inf", "expected a finite number"},
      {ledger, "--top", "1e2", "expected a whole number"},
  };
  for (const Case& c : cases) {
    string args = c.command + c.option + " " + testing::shell_quote(c.value);
    if (c.command.empty()) args += " " + gen;
    const Result r = run(args);
    INFO(args << "\n" << r.output);
    CHECK(r.code == 2);
    CHECK(has(r.output, c.option + ": "));
    CHECK(has(r.output, c.says));
    CHECK(has(r.output, "--help"));
  }
  {  // ledger's sizes are text with a unit: an infinite one is refused as a NaN one always was
    const Result r = run(ledger + "--gpu-memory infGiB");
    INFO(r.output);
    CHECK(r.code == 2);
    CHECK(has(r.output, "--gpu-memory infGiB: expected a size with a unit"));
  }
  {  // the largest seed, a leading zero (decimal, not octal) and a small temperature are read as written
    const string sample = gen + "--temperature 1 --raw ";
    const Result top = run(sample + "--seed 18446744073709551615");
    INFO(top.output);
    CHECK(top.code == 0);
    auto text = [&](const string& seed) { return testing::run_moetrain(sample + "--seed " + seed, false); };
    const Result ten = text("10"), zero_ten = text("010"), eight = text("8");
    REQUIRE(ten.code == 0);
    REQUIRE(eight.code == 0);
    CHECK(zero_ten.output == ten.output);
    CHECK(ten.output != eight.output);
    CHECK(run(gen + "--temperature 1e-30 --seed 3").code == 0);
  }
}

TEST_CASE("hostile cli: weights without config.json and no -c exit 2 saying so; a YAML that does not fit them is "
          "named", "[cli]") {
  TempDir tmp;
  const string dir = export_model_dir(tmp, "export");
  fs::create_directories(tmp / "bare");
  fs::copy_file(dir + "/model.safetensors", tmp / "bare/model.safetensors");
  const string file = tmp / "bare/model.safetensors";
  const string shard = two_window_shard(tmp);
  for (const string& path : {tmp / "bare", file}) {
    for (const string& command : std::vector<string>{"generate --prompt ab", "eval --data " + shard}) {
      const Result r = run(command + " --init-from " + path);
      INFO(command << " --init-from " << path << "\n" << r.output);
      CHECK(r.code == 2);
      CHECK(has(r.output, "--init-from: " + path));
      CHECK(has(r.output, "config.json"));
      CHECK(has(r.output, "-c CONFIG"));
      CHECK_FALSE(has(r.output, "missing tensor"));  // refused before the weights meet GPT-2 124M
    }
  }
  {  // a YAML that describes the weights loads the bare file; one that does not is named
    const string fits = tmp.write("fits.yaml", kModelYaml);
    const Result ok = run("generate -c " + fits + " --init-from " + file + " --prompt ab --max-new-tokens 2");
    INFO(ok.output);
    CHECK(ok.code == 0);
    const string other = tmp.write("other.yaml", "model: {arch: hybrid, d_model: 32, vocab_size: 256}\n"
                                                 "data: {tokenizer: byte}\n");
    const Result r = run("generate -c " + other + " --init-from " + file + " --prompt ab");
    INFO(r.output);
    CHECK(r.code == 2);
    CHECK(has(r.output, "has no config.json, so the model's shape came from the config"));
    CHECK(has(r.output, "model.d_model = 32 (" + other + ":"));
  }
}

TEST_CASE("hostile cli: train.zero 1 at pp 2 x dp 2 shards each stage's AdamW state over its 2 replicas",
          "[cli][slow]") {
  TempDir tmp;
  moetrain::testing::prepare_byte_shards(tmp.path());
  const string args = "train -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml --set data.train=" +
                      tmp / "data/train_*.bin --set data.val= --set train.max_steps=2 --set train.warmup_steps=1 "
                      "--set train.batch_size=2 --set train.seq_len=16 --set train.eval_every=0 --set train.threads=1 "
                      "--set model.n_layer=2 --set model.tie_embeddings=false --set train.pp=2 --set train.zero=1 "
                      "--set run.dir=" + tmp / "run";
  const Result r = testing::capture_command(string(testing::kLocalMpirun) + "-np 4 " + string(MOETRAIN_BINARY_DIR) +
                                            "/moetrain " + args);
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(has(r.output, "pp 2 x dp 2"));
  CHECK(has(r.output, "sharded over the 2 replicas of the replicated parameters)"));
}
