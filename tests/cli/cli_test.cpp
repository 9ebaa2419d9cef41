// The moetrain binary end to end, as a user runs it: prepare -> train ->
// generate / eval, determinism of runs, and the exit code and message of bad input.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "backend/cuda/runtime.h"
#include "testing.h"

using moetrain::testing::TempDir;
using std::string;
namespace fs = std::filesystem;

namespace {

using Result = moetrain::testing::CommandOutput;

Result run(const string& args, bool merge_stderr = true) { return moetrain::testing::run_moetrain(args, merge_stderr); }

// A fresh directory with byte-level shards of tinyshakespeare and a tiny config.
struct Workspace {
  TempDir tmp;
  string dir = tmp.path();
  string config(const string& extra = "") const {
    string path = dir + "/tiny.yaml";
    moetrain::testing::write_bytes(path, "model:\n  vocab_size: 256\n  n_layer: 2\n  n_head: 2\n  d_model: 32\n  n_ctx: 64\n"
                     "data:\n  train: " + dir + "/data/train_*.bin\n  val: " + dir + "/data/val_*.bin\n"
                     "  tokenizer: byte\n"
                     "train:\n  batch_size: 4\n  seq_len: 32\n  max_steps: 6\n  warmup_steps: 2\n  lr: 3.0e-3\n"
                     "  eval_every: 3\n  eval_batches: 2\n  sample_every: 0\n  sample_tokens: 16\n"
                     "run:\n  dir: " + dir + "/run\n" + extra);
    return path;
  }
  void prepare() const {
    Result r = run("prepare " + string(MOETRAIN_SOURCE_DIR) + "/data/tinyshakespeare.txt --out " + dir +
                   "/data --tokenizer byte --val-tokens 8192");
    INFO(r.output);
    REQUIRE(r.code == 0);
  }
};

}  // namespace

TEST_CASE("cli: prepare, train, generate and eval a tiny byte-level GPT-2", "[cli]") {
  Workspace w;
  w.prepare();
  string cfg = w.config();

  Result printed = run("train -c " + cfg + " --set model.n_layer=3 --print-config", false);
  REQUIRE(printed.code == 0);
  CHECK(printed.output.find("n_layer: 3") != string::npos);
  CHECK(!fs::exists(w.dir + "/run"));  // printing the config trains nothing

  Result trained = run("train -c " + cfg);
  INFO(trained.output);
  REQUIRE(trained.code == 0);
  CHECK(trained.output.find("step 6/6 | loss") != string::npos);
  CHECK(trained.output.find("val loss") != string::npos);
  string metrics = moetrain::testing::read_bytes(w.dir + "/run/metrics.jsonl");
  CHECK(std::count(metrics.begin(), metrics.end(), '\n') == 8);  // 6 steps + 2 validations
  CHECK(metrics.find("{\"step\":6,\"loss\":") != string::npos);
  for (const char* f : {"/run/config.resolved.yaml", "/run/model/model.safetensors", "/run/model/config.json",
                        "/run/model/config.resolved.yaml"})
    CHECK(fs::exists(w.dir + f));

  // Same config, same seed: the same losses, bit for bit.
  Result again = run("train -c " + cfg + " --set run.dir=" + w.dir + "/run2");
  REQUIRE(again.code == 0);
  CHECK(moetrain::testing::metrics_history(w.dir + "/run2") == moetrain::testing::metrics_history(w.dir + "/run"));

  // Greedy generation is bit-reproducible.
  string gen = "generate --checkpoint " + w.dir + "/run/model --prompt 'ROMEO:' --temperature 0 --max-new-tokens 24";
  Result g1 = run(gen, false), g2 = run(gen, false);
  REQUIRE(g1.code == 0);
  CHECK(g1.output.rfind("ROMEO:", 0) == 0);
  CHECK(g1.output.size() > 6);
  CHECK(g1.output == g2.output);
  Result sampled = run("generate --checkpoint " + w.dir + "/run/model --max-new-tokens 8 --num-samples 2 --seed 3", false);
  CHECK(sampled.code == 0);
  CHECK(sampled.output.find("--- sample 2 ---") != string::npos);

  Result ev = run("eval --checkpoint " + w.dir + "/run/model --data '" + w.dir + "/data/val_*.bin' --batches 3", false);
  INFO(ev.output);
  REQUIRE(ev.code == 0);
  CHECK(ev.output.rfind("loss ", 0) == 0);
  double loss = std::stod(ev.output.substr(5));
  CHECK(loss > 0.5);
  CHECK(loss < 5.6);  // below ln(256): the model learned something in 6 steps
}

TEST_CASE("cli: gradient accumulation of 2 x 2 sequences matches batches of 4", "[cli]") {
  Workspace w;
  w.prepare();
  string cfg = w.config();
  REQUIRE(run("train -c " + cfg + " --set train.eval_every=0").code == 0);
  REQUIRE(run("train -c " + cfg + " --set train.eval_every=0 --set train.batch_size=2 --set train.grad_accum=2 "
              "--set run.dir=" + w.dir + "/run_accum").code == 0);
  // The same windows in the same order; only float rounding differs.
  std::stringstream a(moetrain::testing::read_bytes(w.dir + "/run/metrics.jsonl")), b(moetrain::testing::read_bytes(w.dir + "/run_accum/metrics.jsonl"));
  string la, lb;
  int lines = 0;
  while (std::getline(a, la) && std::getline(b, lb)) {
    double x = std::stod(la.substr(la.find("\"loss\":") + 7)), y = std::stod(lb.substr(lb.find("\"loss\":") + 7));
    CHECK(x == Approx(y).epsilon(1e-5));
    ++lines;
  }
  CHECK(lines == 6);
}

TEST_CASE("cli: bad input exits with code 2 and one line naming the file", "[cli][errors]") {
  Workspace w;
  w.prepare();

  SECTION("unknown config key") {
    string cfg = w.dir + "/bad.yaml";
    moetrain::testing::write_bytes(cfg, "model:\n  n_layre: 2\n");
    Result r = run("train -c " + cfg);
    CHECK(r.code == 2);
    CHECK(r.output.find("bad.yaml:2:3") != string::npos);
    CHECK(r.output.find("did you mean 'model.n_layer'") != string::npos);
    CHECK(r.output.find("\n") == r.output.size() - 1);  // one line
  }
  SECTION("no shards match data.train") {
    Result r = run("train -c " + w.config() + " --set data.train=" + w.dir + "/nothing_*.bin");
    CHECK(r.code == 2);
    CHECK(r.output.find("nothing_*.bin") != string::npos);
  }
  SECTION("truncated shard") {
    fs::create_directories(w.dir + "/trunc");
    string full = moetrain::testing::read_bytes(w.dir + "/data/val_000000.bin");
    moetrain::testing::write_bytes(w.dir + "/trunc/train_000000.bin", full.substr(0, full.size() - 100));
    Result r = run("train -c " + w.config() + " --set data.train=" + w.dir + "/trunc/train_000000.bin");
    CHECK(r.code == 2);
    CHECK(r.output.find("trunc/train_000000.bin") != string::npos);
  }
  SECTION("wrong magic") {
    fs::create_directories(w.dir + "/magic");
    string full = moetrain::testing::read_bytes(w.dir + "/data/val_000000.bin");
    full[0] = 'X';
    moetrain::testing::write_bytes(w.dir + "/magic/train_000000.bin", full);
    Result r = run("train -c " + w.config() + " --set data.train=" + w.dir + "/magic/train_000000.bin");
    CHECK(r.code == 2);
    CHECK(r.output.find("magic") != string::npos);
    CHECK(r.output.find("magic/train_000000.bin") != string::npos);
  }
  SECTION("token id beyond the vocabulary") {
    // GPT-2 shards (ids up to 50256) fed to a 256-token byte model.
    fs::create_directories(w.dir + "/gpt2");
    moetrain::testing::write_bytes(w.dir + "/gpt2/text.txt", "Hello there, general Kenobi. You are a bold one.\n");
    REQUIRE(run("prepare " + w.dir + "/gpt2/text.txt --out " + w.dir + "/gpt2 --val-tokens 0").code == 0);
    Result r = run("train -c " + w.config() + " --set data.train=" + w.dir + "/gpt2/train_000000.bin --set train.seq_len=4");
    CHECK(r.code == 2);
    CHECK(r.output.find("gpt2/train_000000.bin") != string::npos);
    CHECK(r.output.find("offset") != string::npos);
  }
  SECTION("missing tokenizer files") {
    Result r = run("train -c " + w.config() + " --set data.tokenizer=gpt2 --set data.tokenizer_dir=" + w.dir +
                   "/no_tokenizer --set model.vocab_size=50257");
    CHECK(r.code == 2);
    CHECK(r.output.find("no_tokenizer") != string::npos);
  }
  SECTION("malformed safetensors") {
    moetrain::testing::write_bytes(w.dir + "/bad.safetensors", string("\x10\0\0\0\0\0\0\0{\"a\":", 13));
    Result r = run("generate -c " + w.config() + " --init-from " + w.dir + "/bad.safetensors");
    CHECK(r.code == 2);
    CHECK(r.output.find("bad.safetensors") != string::npos);
  }
  SECTION("no model given") {
    Result r = run("generate --prompt hi");
    CHECK(r.code == 2);
    CHECK(r.output.find("--checkpoint") != string::npos);
  }
}

TEST_CASE("cli: command-line mistakes exit 2 with one line naming the mistake and the --help to run",
          "[cli][errors]") {
  struct Case {
    string args, mistake, hint;
  };
  const Case cases[] = {
      {"frobnicate", "unknown command 'frobnicate'", "run 'moetrain --help'"},
      {"", "A subcommand is required", "run 'moetrain --help'"},
      {"train --bogus", "--bogus", "run 'moetrain train --help' for the options"},
      {"generate --max-new-tokens 0", "--max-new-tokens", "run 'moetrain generate --help' for the options"},
      {"generate --temperature warm", "warm", "run 'moetrain generate --help' for the options"},
      {"eval --checkpoint x", "--data is required", "run 'moetrain eval --help' for the options"},
      {"--threads -1 info", "--threads: must be >= 0, got -1", "--help' for the options"},
      {"info --threads x", "--threads", "run 'moetrain info --help'"},
  };
  for (const Case& c : cases) {
    Result r = run(c.args);
    INFO("moetrain " << c.args << "\n" << r.output);
    CHECK(r.code == 2);
    CHECK(std::count(r.output.begin(), r.output.end(), '\n') == 1);  // one line
    CHECK(r.output.find(c.mistake) != string::npos);
    CHECK(r.output.find(c.hint) != string::npos);
  }
  // Asking for help or the version is no mistake.
  Result help = run("--help", false), train_help = run("train --help", false), version = run("--version", false);
  CHECK(help.code == 0);
  CHECK(help.output.find("Subcommands:") != string::npos);
  CHECK(train_help.code == 0);
  CHECK(train_help.output.find("--print-config") != string::npos);
  CHECK(version.code == 0);
  CHECK(version.output.rfind("moetrain ", 0) == 0);
}

TEST_CASE("cli: generate refuses --max-new-tokens beyond the model's context up front, naming the largest that fits",
          "[cli][errors]") {
  Workspace w;  // n_ctx 64, byte tokenizer: the prompt 'ab' is 2 tokens, so 64 - 2 + 1 = 63 new tokens fit
  const string gen = "generate -c " + w.config() + " --prompt ab --temperature 0";
  Result over = run(gen + " --max-new-tokens 64");
  INFO(over.output);
  CHECK(over.code == 2);
  CHECK(std::count(over.output.begin(), over.output.end(), '\n') == 1);
  CHECK(over.output.find("--max-new-tokens 64 does not fit") != string::npos);
  CHECK(over.output.find("context of 64 positions") != string::npos);
  CHECK(over.output.find("pass --max-new-tokens 63 or less") != string::npos);
  Result fits = run(gen + " --max-new-tokens 63", false);
  CHECK(fits.code == 0);
  CHECK(fits.output.size() == 2 + 63 + 1);  // the prompt, 63 bytes, a newline (bytes have no stop token)
  // Without --max-new-tokens the default (128) is lowered to what fits, and the log says so.
  Result defaulted = run(gen);
  INFO(defaulted.output);
  CHECK(defaulted.code == 0);
  CHECK(defaulted.output.find("63 new tokens") != string::npos);
  CHECK(run(gen, false).output == fits.output);
  Result long_prompt = run("generate -c " + w.config() + " --prompt " + string(64, 'x'));
  CHECK(long_prompt.code == 2);
  CHECK(long_prompt.output.find("the prompt is 64 tokens") != string::npos);
}

TEST_CASE("cli: ledger reproduces the parameter counts of docs/model.md#shipped-configs", "[cli]") {
  struct Row {
    const char* config;
    int64_t total, active;
  };
  // docs/model.md#shipped-configs (k3-* rows, gpt2-small) and docs/model.md#published-configs (Kimi-K3: "2.8T total / 104B activated").
  for (const Row& row : {Row{"gpt2-small", 124439808, 124439808}, Row{"k3-tiny", 820940, 509644},
                         Row{"k3-shakespeare", 2610968, 1546008},
                         Row{"k3-small", 67105636, 25326436}, Row{"k3-scaled", 14488248212, 534781844},
                         Row{"k3-scaled-lite", 3648149258, 153343754}}) {
    INFO(row.config);
    Result r = run("ledger --json -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/" + row.config + ".yaml", false);
    REQUIRE(r.code == 0);
    CHECK(r.output.find("\"total\": " + std::to_string(row.total) + "\n") != string::npos);
    CHECK(r.output.find("\"active\": " + std::to_string(row.active) + ",") != string::npos);
  }
  Result k3 = run("ledger --json --ep 64 -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/kimi-k3.yaml", false);
  REQUIRE(k3.code == 0);
  auto number = [&](const string& key) {
    size_t at = k3.output.find("\"" + key + "\": ");
    REQUIRE(at != string::npos);
    return std::stod(k3.output.substr(at + key.size() + 4));
  };
  CHECK(number("total") > 2.75e12);
  CHECK(number("total") < 2.85e12);
  CHECK(number("active") > 103.5e9);
  CHECK(number("active") < 104.5e9);
  CHECK(number("params_per_rank") < number("total") / 25);  // experts (98%) are sharded 64 ways
  Result text = run("ledger -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml", false);
  CHECK(text.output.find("experts") != string::npos);
  CHECK(text.output.find("attn_res") != string::npos);
  Result bad = run("ledger --ep 3 -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml");
  CHECK(bad.code == 2);
  CHECK(bad.output.find("k3-tiny.yaml") != string::npos);
  CHECK(bad.output.find("model.moe.num_experts") != string::npos);
}

TEST_CASE("cli: ledger counts bf16 runs' activations at 2 bytes where they are bf16", "[cli]") {
  auto number = [](const string& output, const string& key) {
    size_t at = output.find("\"" + key + "\": ");
    REQUIRE(at != string::npos);
    return std::stod(output.substr(at + key.size() + 4));
  };
  for (const char* config : {"gpt2-small", "k3-tiny"}) {
    INFO(config);
    const string path = string(MOETRAIN_SOURCE_DIR) + "/configs/" + config + ".yaml";
    Result f32 = run("ledger --json -c " + path, false), bf16 = run("ledger --json --set train.dtype=bf16 -c " + path, false);
    REQUIRE(f32.code == 0);
    REQUIRE(bf16.code == 0);
    const double a32 = number(f32.output, "activation_bytes_per_rank"), a16 = number(bf16.output, "activation_bytes_per_rank");
    // The wide tensors and the logits halve (the cross-entropy reads bf16 logits);
    // KDA internals and router scores stay f32, so GPT-2 halves exactly, k3-tiny less.
    CHECK(a16 < a32);
    if (string(config) == "gpt2-small") CHECK(a16 == Approx(a32 / 2).epsilon(1e-12));
    else CHECK(a16 > a32 / 2);
    // Weights + grads in bf16 and an f32 master: the same 16 bytes per parameter.
    CHECK(number(bf16.output, "state_bytes_per_rank") == number(f32.output, "state_bytes_per_rank"));
  }
}

TEST_CASE("cli: ledger prints a pipeline layout and --plan prints only layouts that fit", "[cli]") {
  const string configs = string(MOETRAIN_SOURCE_DIR) + "/configs/";
  Result staged = run("ledger --pp 3 --ep 4 --dp 2 --zero 1 --micro-batches 4 -c " + configs + "k3-tiny.yaml", false);
  REQUIRE(staged.code == 0);
  CHECK(staged.output.find("pp 3 x dp 2 x ep 4, zero 1") != string::npos);
  CHECK(staged.output.find("<- worst") != string::npos);
  CHECK(staged.output.find("fits") != string::npos);
  CHECK(staged.output.find("bubble 33.3%") != string::npos);  // (3 - 1) / (4 + 3 - 1)

  // docs/parallelism.md#planning-a-cluster-k3-on-h200s
  const string k3 = "--set train.dtype=bf16 --set train.activation_checkpointing=true -c " + configs + "kimi-k3.yaml";
  Result plan = run("ledger --json --plan 1024 --global-batch 4096 " + k3, false);
  REQUIRE(plan.code == 0);
  const nlohmann::json j = nlohmann::json::parse(plan.output);
  REQUIRE(!j["feasible"].empty());
  for (const auto& l : j["feasible"]) {
    const auto& o = l["layout"];
    CHECK(o["pp"].get<int64_t>() * o["dp"].get<int64_t>() * o["ep"].get<int64_t>() == 1024);
    CHECK(l["bytes_per_rank"].get<double>() <= l["gpu_usable_bytes"].get<double>());
    CHECK(l["gpu_usable_bytes"].get<double>() == 130.0 * (1 << 30));  // 140 GiB less the 10 GiB reserve
  }
  Result text = run("ledger --plan 1024 --global-batch 4096 --top 3 " + k3, false);
  REQUIRE(text.code == 0);
  CHECK(text.output.find(std::to_string(j["feasible"].size()) + " of " + std::to_string(j["searched"].get<int64_t>()) +
                         " layouts fit; the 3 fastest") != string::npos);
  Result none = run("ledger --plan 256 --set train.dtype=bf16 -c " + configs + "kimi-k3.yaml", false);
  CHECK(none.code == 1);
  CHECK(none.output.find("nothing fits") != string::npos);

  for (const auto& [args, flag] : std::vector<std::pair<string, string>>{{"--pp 10", "--pp 10"},
                                                                         {"--gpu-memory 141", "--gpu-memory"},
                                                                         {"--zero 2", "--zero 2"},
                                                                         {"--inter-bw 50GiB/min", "--inter-bw"},
                                                                         {"--plan 8 --pp 2", "--pp excludes --plan"}}) {
    INFO(args);
    Result bad = run("ledger " + args + " -c " + configs + "k3-tiny.yaml");
    CHECK(bad.code == 2);
    CHECK(bad.output.find(flag) != string::npos);
  }
}

// [slow]: not rerun under the sanitizers (launch/test.sh); the k3 paths run there in smaller tests.
TEST_CASE("cli: k3-tiny (with its MoE) trains on bytes and decodes with constant KDA state", "[cli][slow]") {
  Workspace w;
  w.prepare();
  string args = "train -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml --set data.train=" + w.dir +
                "/data/train_*.bin --set data.val=" + w.dir + "/data/val_*.bin --set run.dir=" + w.dir +
                "/k3 --set train.max_steps=30 --set train.warmup_steps=10 --set train.batch_size=4 "
                "--set train.seq_len=64 --set train.eval_every=30 --set train.eval_batches=2";
  Result trained = run(args);
  INFO(trained.output);
  REQUIRE(trained.code == 0);
  CHECK(trained.output.find("| moe max/mean ") != string::npos);  // the console's MoE load summary
  std::stringstream metrics(moetrain::testing::read_bytes(w.dir + "/k3/metrics.jsonl"));
  std::vector<double> losses;
  for (string line; std::getline(metrics, line);)
    if (line.find("\"loss\":") != string::npos) losses.push_back(std::stod(line.substr(line.find("\"loss\":") + 7)));
  REQUIRE(losses.size() == 30);
  CHECK(losses.front() > 5.0);            // ~ln(256) = 5.55 at init
  CHECK(losses.back() < losses.front() - 1.5);  // learned the byte statistics
  CHECK(metrics.str().find("\"moe7_dead_experts\":") != string::npos);  // 8 MoE layers (1..8), per-layer load
  // The router biases (buffers moved by the aux-loss-free update) are saved with the weights.
  CHECK(moetrain::testing::read_bytes(w.dir + "/k3/model/model.safetensors")
            .find("model.layers.8.block_sparse_moe.gate.e_score_correction_bias") != string::npos);

  Result g = run("generate --checkpoint " + w.dir + "/k3/model --prompt 'ROMEO:' --temperature 0 "
                 "--max-new-tokens 64 --stats");
  INFO(g.output);
  REQUIRE(g.code == 0);
  // Lines "  <tokens> <bytes>": the 6 KDA layers hold a constant state, the 3 MLA
  // layers (r_kv 32 + rope 16) x 4 bytes = 576 bytes per token.
  std::stringstream lines(g.output.substr(g.output.find("decode cache (hybrid)")));
  string header;
  std::getline(lines, header);
  std::vector<std::pair<int64_t, int64_t>> points;
  for (int64_t t, b; lines >> t >> b;) points.emplace_back(t, b);
  REQUIRE(points.size() >= 3);
  for (size_t i = 1; i < points.size(); ++i)
    CHECK(points[i].second - points[i - 1].second == 576 * (points[i].first - points[i - 1].first));
}

TEST_CASE("cli: k3-tiny under mpirun (EP 4, DP 2 x EP 2, DP 2) gives one process's losses and model", "[cli][slow]") {
  // Twenty AdamW steps of k3-tiny with its MoE (16 experts, top 4), f32, one thread
  // per rank. One process with 4 micro-batches per step is the reference: world x
  // grad_accum = 4 micro-batches in every run, rank r taking batches r, r + world, ...
  // of the same stream. Losses agree to 1e-5 relative: summation orders differ
  // (gradients are summed over ranks; at EP 4 each expert's rows of all four
  // micro-batches go through one GEMM), and an ulp of difference can flip a
  // near-tied router choice. Measured: 3.1e-6 at EP 4, 2e-8 at EP 2 x DP 2 and DP 2.
  // The exported models (experts gathered from the ranks) evaluate to the same
  // validation loss.
  Workspace w;
  w.prepare();
  const string base = "train -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml --set data.train=" + w.dir +
                      "/data/train_*.bin --set data.val= --set train.max_steps=20 --set train.warmup_steps=5 "
                      "--set train.batch_size=4 --set train.seq_len=32 --set train.eval_every=0 --set train.threads=1 "
                      "--set train.log_every=20";
  const string mpirun = moetrain::testing::kLocalMpirun;
  const auto losses = moetrain::testing::metrics_losses;
  auto val_loss = [&](const string& run_dir) {
    Result r = run("eval --checkpoint " + run_dir + "/model --data '" + w.dir + "/data/val_*.bin' --batches 4", false);
    REQUIRE(r.code == 0);
    return std::stod(r.output.substr(r.output.find("loss ") + 5));
  };
  Result one = run(base + " --set train.grad_accum=4 --set run.dir=" + w.dir + "/one");
  INFO(one.output);
  REQUIRE(one.code == 0);
  const std::vector<double> want = losses(w.dir + "/one");
  REQUIRE(want.size() == 20);
  const double want_val = val_loss(w.dir + "/one");
  struct Grid {
    int np, ep, accum;
  };
  for (Grid g : {Grid{4, 4, 1}, Grid{4, 2, 1}, Grid{2, 1, 2}}) {
    const string dir = w.dir + "/np" + std::to_string(g.np) + "ep" + std::to_string(g.ep);
    Result r = moetrain::testing::capture_command(
        mpirun + "-np " + std::to_string(g.np) + " " + string(MOETRAIN_BINARY_DIR) + "/moetrain " + base +
        " --set train.ep=" + std::to_string(g.ep) + " --set train.grad_accum=" + std::to_string(g.accum) +
        " --set run.dir=" + dir);
    INFO("np " << g.np << " ep " << g.ep << "\n" << r.output);
    REQUIRE(r.code == 0);
    CHECK(r.output.find("dp " + std::to_string(g.np / g.ep) + " x ep " + std::to_string(g.ep)) != string::npos);
    const std::vector<double> got = losses(dir);
    REQUIRE(got.size() == want.size());
    double worst = 0;
    for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]) / want[i]);
    CHECK(worst < 1e-5);
    CHECK(std::abs(val_loss(dir) - want_val) < 1e-5 * want_val);
  }
  // A bad expert-parallel setting ends the whole job with the key named (no hang).
  Result bad = moetrain::testing::capture_command(mpirun + "-np 2 " + string(MOETRAIN_BINARY_DIR) + "/moetrain " +
                                                  base + " --set train.ep=4 --set run.dir=" + w.dir + "/bad");
  CHECK(bad.code != 0);
  CHECK(bad.output.find("--set train.ep=4: train.ep = 4: does not divide the 2 ranks") != string::npos);
}

TEST_CASE("cli: a non-finite gradient skips the step on every rank (train.nan_policy), or ends the run with exit 3",
          "[cli][slow]") {
  // With a constant learning rate, 3 steps whose third gets a NaN gradient
  // (fault.kind = nan_grad, a testing aid) must leave exactly the weights of 2
  // steps: the skipped step changes neither parameters nor optimizer state. One
  // process, and under mpirun with the NaN on rank 1 only.
  Workspace w;
  w.prepare();
  const string cfg = w.config("");
  const string common = "train -c " + cfg + " --set train.schedule=constant --set train.warmup_steps=0 "
                        "--set train.eval_every=0 --set train.threads=1 ";
  const string fault = "--set fault.kind=nan_grad --set fault.step=3 ";
  const string mpirun = "mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader "
                        "--mca btl_vader_single_copy_mechanism none -x OMP_NUM_THREADS=1 -np 2 " +
                        string(MOETRAIN_BINARY_DIR) + "/moetrain ";
  auto weights = [&](const string& run_dir) { return moetrain::testing::read_bytes(run_dir + "/model/model.safetensors"); };
  for (bool mpi : {false, true}) {
    INFO("mpirun " << mpi);
    auto train = [&](const string& args) {
      return mpi ? moetrain::testing::capture_command(mpirun + common + args) : run(common + args);
    };
    const string tag = mpi ? "mpi" : "one";
    Result two = train("--set train.max_steps=2 --set run.dir=" + w.dir + "/two" + tag);
    INFO(two.output);
    REQUIRE(two.code == 0);
    Result skipped = train("--set train.max_steps=3 " + fault + "--set fault.rank=" + (mpi ? "1" : "0") +
                           " --set run.dir=" + w.dir + "/skip" + tag);
    INFO(skipped.output);
    REQUIRE(skipped.code == 0);
    CHECK(skipped.output.find("step 3: loss") != string::npos);
    CHECK(skipped.output.find("step skipped on every rank") != string::npos);
    CHECK(moetrain::testing::read_bytes(w.dir + "/skip" + tag + "/metrics.jsonl").find("\"skipped\":true") !=
          string::npos);
    CHECK(weights(w.dir + "/skip" + tag) == weights(w.dir + "/two" + tag));
  }
  Result abort = run(common + "--set train.max_steps=4 " + fault + "--set train.nan_policy=abort --set run.dir=" + w.dir +
                     "/abort");
  CHECK(abort.code == 3);
  CHECK(abort.output.find("step 3: loss") != string::npos);
  CHECK(abort.output.find("train.nan_policy = abort") != string::npos);
  Result limit = run(common + "--set train.max_steps=4 " + fault + "--set train.max_consecutive_skips=0 --set run.dir=" +
                     w.dir + "/limit");
  CHECK(limit.code == 3);
  CHECK(limit.output.find("train.max_consecutive_skips = 0") != string::npos);
}

TEST_CASE("cli: train.device = cuda without a usable GPU exits 2 naming the key", "[cli][errors]") {
  if (moetrain::cuda::device_count() > 0) return;  // a GPU machine runs the [cuda] case below instead
  Workspace w;
  w.prepare();
  Result r = run("train -c " + w.config() + " --set train.device=cuda --set train.max_steps=1");
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("train.device") &&
                           (Catch::Contains("no CUDA device is visible") || Catch::Contains("built without CUDA")));
}

// train.dtype: bf16 with train.device: cpu trains (it was refused before issue 38):
// tests/cli/bf16_cpu_cli_test.cpp.

TEST_CASE("cli: a tiny GPT-2 trains in bf16 mixed precision on CUDA near the CPU f32 losses; its checkpoint resumes "
          "an f32 run", "[cli][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  Workspace w;
  w.prepare();
  string cfg = w.config();
  Result cpu = run("train -c " + cfg);
  INFO(cpu.output);
  REQUIRE(cpu.code == 0);
  Result gpu = run("train -c " + cfg + " --set train.device=cuda --set train.dtype=bf16 --set ckpt.every=3 "
                   "--set run.dir=" + w.dir + "/run_bf16");
  INFO(gpu.output);
  REQUIRE(gpu.code == 0);
  CHECK_THAT(gpu.output, Catch::Contains("training on cuda:") && Catch::Contains("mixed precision: bf16 parameters"));
  std::vector<double> a = moetrain::testing::metrics_losses(w.dir + "/run"),
                      b = moetrain::testing::metrics_losses(w.dir + "/run_bf16");
  REQUIRE(a.size() == b.size());
  REQUIRE(a.size() >= 6);
  // bf16 weights and activations (8-bit mantissas, relative rounding 2^-9 per value)
  // against f32: the losses (~5.5 nats at the start) agree to about 1%.
  for (size_t i = 0; i < a.size(); ++i) CHECK(b[i] == Approx(a[i]).epsilon(2e-2));
  // The checkpoint and the exported model hold the f32 master weights.
  const string ckpt = w.dir + "/run_bf16/checkpoints/step_00000003";
  CHECK_THAT(moetrain::testing::read_bytes(ckpt + "/manifest.json"), Catch::Contains("\"dtype\": \"f32\""));
  // An f32 CPU run resumes from the bf16 run's step 3 and ends near the f32 run.
  Result resumed = run("train -c " + cfg + " --set run.dir=" + w.dir + "/run_bf16 --set ckpt.resume=step_00000003");
  INFO(resumed.output);
  REQUIRE(resumed.code == 0);
  CHECK_THAT(resumed.output, Catch::Contains("resumed from"));
  std::vector<double> c = moetrain::testing::metrics_losses(w.dir + "/run_bf16");
  REQUIRE(c.size() == a.size());
  for (size_t i = 3; i < a.size(); ++i) CHECK(c[i] == Approx(a[i]).epsilon(2e-2));
}

TEST_CASE("cli: a tiny GPT-2 trains on CUDA with the CPU run's losses", "[cli][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  Workspace w;
  w.prepare();
  string cfg = w.config();
  Result cpu = run("train -c " + cfg);
  INFO(cpu.output);
  REQUIRE(cpu.code == 0);
  Result gpu = run("train -c " + cfg + " --set train.device=cuda --set run.dir=" + w.dir + "/run_cuda");
  INFO(gpu.output);
  REQUIRE(gpu.code == 0);
  CHECK_THAT(gpu.output, Catch::Contains("training on cuda:"));
  std::vector<double> a = moetrain::testing::metrics_losses(w.dir + "/run"),
                      b = moetrain::testing::metrics_losses(w.dir + "/run_cuda");
  REQUIRE(a.size() == b.size());
  REQUIRE(a.size() >= 6);
  for (size_t i = 0; i < a.size(); ++i) CHECK(b[i] == Approx(a[i]).epsilon(1e-3));  // f32, other summation orders
}
