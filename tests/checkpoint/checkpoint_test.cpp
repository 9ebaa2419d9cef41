// Training checkpoints in one process: what a save writes (layout, manifest,
// independent SHA-256), that a load restores every tensor and counter bit for bit,
// which checkpoint ckpt.resume picks, and that corruption, truncation and shape
// mismatches are refused with the file, dataset and tensors named.
// Multi-rank saves, resharding and kills are in tests/cli/checkpoint_cli_test.cpp.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <limits>

#include <nlohmann/json.hpp>

#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "core/rng.h"
#include "nn/hybrid.h"
#include "ops/view/view.h"
#include "optim/adamw.h"
#include "testing.h"
#include "train/run_dir.h"
#include "train/distributed.h"
#include "train/model_source.h"

namespace {

using namespace moetrain;
using moetrain::testing::TempDir;
namespace fs = std::filesystem;

// A tiny hybrid model (KDA, MLA, latent MoE with shared experts, AttnRes).
Config tiny_config(const std::string& run_dir, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> o = {"model.n_layer=3",          "model.d_model=32",    "model.attn_res_block_size=2",
                                "model.kda.n_head=2",       "model.kda.head_dim=16", "model.moe.num_experts=4",
                                "model.moe.top_k=2",        "model.moe.expert_d_ff=16", "model.moe.latent_dim=16",
                                "model.d_ff=64",            "train.seed=7",        "run.dir=" + run_dir};
  o.insert(o.end(), extra.begin(), extra.end());
  return Config::load(std::string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml", o);
}

// One AdamW step on random tokens, so parameters, moments and router biases all moved.
void train_step(LanguageModel& model, AdamW& opt, uint64_t seed) {
  Generator g(seed);
  Tensor tokens = randint({2, 9}, 256, DType::i32, g);
  Tensor inputs = slice(tokens, 1, 0, 8).contiguous(), targets = slice(tokens, 1, 1, 9).contiguous();
  opt.zero_grad();
  model.loss(inputs, targets, true).backward();
  for (MoeLayer* m : dynamic_cast<HybridModel&>(model).moe_layers()) {
    m->update_bias(m->stats().tokens_per_expert);
    m->stats().reset();
  }
  opt.step(1e-2);
}

struct Saved {
  TempDir tmp;
  Config config = tiny_config(tmp.path() + "/run");
  Distributed dist = make_distributed(config);
  std::unique_ptr<LanguageModel> model = build_model(config);
  AdamW opt{model->parameters(), {}};
  TrainProgress progress;

  explicit Saved(int64_t steps = 2) {
    for (int64_t s = 0; s < steps; ++s) train_step(*model, opt, 100 + s);
    progress = {steps, 1234, 1, 0, {3, 17}};
  }
  std::string save(int64_t step, int64_t keep_last = 3) {
    progress.step = step;
    SaveOptions o;
    o.keep_last = keep_last;
    return save_checkpoint(dist, config.get_string("run.dir"), *model, opt, progress, config, o).dir;
  }
};

std::vector<std::pair<std::string, Tensor>> state_of(const LanguageModel& model, AdamW& opt) {
  std::vector<std::pair<std::string, Tensor>> out;
  const ParameterList& params = model.parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    out.emplace_back(params[i].name, params[i].tensor);
    out.emplace_back(params[i].name + " exp_avg", opt.exp_avg()[i]);
    out.emplace_back(params[i].name + " exp_avg_sq", opt.exp_avg_sq()[i]);
  }
  for (const NamedParameter& b : model.buffers()) out.emplace_back(b.name, b.tensor);
  return out;
}

void flip_byte(const std::string& path, int64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c = 0;
  f.get(c);
  f.seekp(offset);
  f.put(static_cast<char>(c ^ 0x40));
}

}  // namespace

TEST_CASE("checkpoint: a save writes the documented layout and a load restores everything bit for bit",
          "[checkpoint]") {
  Saved s;
  const std::string dir = s.save(2);
  CHECK(fs::path(dir).filename() == "step_00000002");
  for (const char* f : {"rank_00000.h5", "manifest.json", "COMMIT", "config.resolved.yaml"})
    CHECK(fs::exists(fs::path(dir) / f));
  CHECK(moetrain::testing::read_bytes(checkpoints_dir(s.config.get_string("run.dir")) + "/latest") ==
        "step_00000002\n");
  // The manifest's SHA-256 and size, checked by an independent tool.
  const auto manifest = nlohmann::json::parse(moetrain::testing::read_bytes(dir + "/manifest.json"));
  CHECK(manifest["step"] == 2);
  CHECK(manifest["world"] == 1);
  CHECK(manifest["num_experts"] == 4);
  const auto& file = manifest["files"][0];
  CHECK(file["name"] == "rank_00000.h5");
  CHECK(file["bytes"] == static_cast<int64_t>(fs::file_size(dir + "/rank_00000.h5")));
  auto sum = moetrain::testing::capture_command("sha256sum " + dir + "/rank_00000.h5", false);
  REQUIRE(sum.code == 0);
  CHECK(sum.output.substr(0, 64) == file["sha256"].get<std::string>());
  CHECK(file["experts"] == nlohmann::json::array({0, 4}));

  // A model with other weights (seed) and a fresh optimizer get everything back.
  Config other = tiny_config(s.tmp.path() + "/run", {"train.seed=99"});
  std::unique_ptr<LanguageModel> model = build_model(other);
  AdamW opt(model->parameters(), {});
  auto before = state_of(*model, opt);
  for (auto& [name, t] : before) t = t.clone();
  const TrainProgress p = load_checkpoint(s.dist, dir, *model, &opt, other);
  CHECK(p.step == 2);
  CHECK(p.tokens == 1234);
  CHECK(p.skipped == 1);
  CHECK(p.loader == data::LoaderState{3, 17});
  CHECK(opt.steps() == 2);
  const auto want = state_of(*s.model, s.opt), got = state_of(*model, opt);
  REQUIRE(got.size() == want.size());
  int64_t changed = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    INFO(got[i].first);
    CHECK(moetrain::testing::bitwise_equal(got[i].second, want[i].second));
    changed += moetrain::testing::bitwise_equal(before[i].second, want[i].second) ? 0 : 1;
  }
  INFO(changed << " of " << got.size() << " tensors differed before the load");
  CHECK(changed > static_cast<int64_t>(got.size()) / 4);  // the load really replaced the state (norms start at 1 anyway)
  // The router biases moved in training and came back.
  const ParameterList buffers = model->buffers();
  REQUIRE(!buffers.empty());
  CHECK(moetrain::testing::max_abs_diff(buffers[0].tensor, zeros_like(buffers[0].tensor)) > 0);
}

// The checkpoint directory a run with `config` starts from ("" for step 0).
std::string find_checkpoint(const std::string& run, const Config& config, bool = true) {
  RunDirectory dir(run);
  const StartPlan plan = dir.plan(CheckpointOptions::from(config), config);
  return plan.from ? plan.from->dir : "";
}

TEST_CASE("checkpoint: resume auto picks the newest committed step and ignores unfinished saves", "[checkpoint]") {
  Saved s;
  const std::string run = s.config.get_string("run.dir"), root = checkpoints_dir(run);
  CHECK(find_checkpoint(run, tiny_config(run, {"ckpt.resume=auto"}), false).empty());  // nothing yet
  CHECK(find_checkpoint(run, s.config, false).empty());                                 // resume: none
  s.save(10);
  s.save(20);
  // A save that died before its rename, and a directory without COMMIT.
  fs::create_directories(root + "/step_00000030.tmp.abc");
  moetrain::testing::write_bytes(root + "/step_00000030.tmp.abc/COMMIT", "step_00000030\n");
  fs::create_directories(root + "/step_00000040");
  moetrain::testing::write_bytes(root + "/latest", "step_00000040\n");  // `latest` is for people only
  CHECK(find_checkpoint(run, tiny_config(run, {"ckpt.resume=auto"}), false) == root + "/step_00000020");
  CHECK(find_checkpoint(run, tiny_config(run, {"ckpt.resume=step_00000010"}), false) == root + "/step_00000010");
  CHECK_THAT(moetrain::testing::error_of([&] { find_checkpoint(run, tiny_config(run, {"ckpt.resume=step_00000040"})); }),
             Catch::Contains("step_00000040 has no COMMIT"));
  CHECK_THAT(moetrain::testing::error_of([&] { find_checkpoint(run, tiny_config(run, {"ckpt.resume=step_00000050"})); }),
             Catch::Contains("step_00000050 does not exist (complete checkpoints: step_00000010, step_00000020)"));
  CHECK_THAT(moetrain::testing::error_of([&] { find_checkpoint(run, tiny_config(run, {"ckpt.resume=latest"})); }),
             Catch::Contains("ckpt.resume = latest") && Catch::Contains("none, auto or a checkpoint name"));
  // The next save deletes leftovers and keeps the newest keep_last.
  s.save(50, 2);
  CHECK(!fs::exists(root + "/step_00000030.tmp.abc"));
  CHECK(!fs::exists(root + "/step_00000010"));
  CHECK(fs::exists(root + "/step_00000020"));
  CHECK(fs::exists(root + "/step_00000050"));
}

TEST_CASE("checkpoint: a flipped byte or a truncated file is refused, naming the file and the dataset",
          "[checkpoint]") {
  Saved s;
  const std::string dir = s.save(2);
  const std::string file = dir + "/rank_00000.h5";
  const std::string good = moetrain::testing::read_bytes(file);
  std::unique_ptr<LanguageModel> model = build_model(s.config);
  AdamW opt(model->parameters(), {});
  const auto load = [&] { load_checkpoint(s.dist, dir, *model, &opt, s.config); };

  // A byte in the middle of the tensor data: the SHA-256 differs and Fletcher32 names the dataset.
  flip_byte(file, static_cast<int64_t>(good.size()) / 2);
  std::string e = moetrain::testing::error_of(load);
  CHECK_THAT(e, Catch::Contains(file + " is corrupt: its SHA-256"));
  CHECK_THAT(e, Catch::Contains("; dataset /") && Catch::Contains("fails to read"));
  CHECK_THAT(e, Catch::Contains("Fletcher32") || Catch::Contains("checksum"));

  moetrain::testing::write_bytes(file, good.substr(0, good.size() - 1000));
  e = moetrain::testing::error_of(load);
  CHECK_THAT(e, Catch::Contains(file + " has " + std::to_string(good.size() - 1000) + " bytes, manifest.json says " +
                                std::to_string(good.size()) + " (truncated"));

  moetrain::testing::write_bytes(file, good);
  moetrain::testing::write_bytes(dir + "/manifest.json", "{\"format\": \"moetrain-checkpoint\"");
  CHECK_THAT(moetrain::testing::error_of(load), Catch::Contains("manifest.json is not a valid manifest"));
}

TEST_CASE("checkpoint: loading into another shape lists every missing, unexpected and mismatched tensor",
          "[checkpoint]") {
  Saved s(1);
  const std::string dir = s.save(1);
  // Wider experts and no shared experts (unexpected tensors).
  Config other = tiny_config(s.tmp.path() + "/run", {"model.moe.expert_d_ff=24", "model.moe.num_shared_experts=0"});
  std::unique_ptr<LanguageModel> model = build_model(other);
  AdamW opt(model->parameters(), {});
  std::string e = moetrain::testing::error_of([&] { load_checkpoint(s.dist, dir, *model, &opt, other); });
  CHECK_THAT(e, Catch::Contains("checkpoint " + dir + " does not match the model of this config (0 tensors missing, "));
  CHECK_THAT(e, Catch::Contains("not in the model: params/model.layers.1.mlp.shared_experts."));
  CHECK_THAT(e, Catch::Contains("shape differs: params/model.layers.1.mlp.experts.w1.weight: checkpoint [4, 16, 16], "
                                "model [4, 24, 16]"));
  CHECK_THAT(e, Catch::Contains("shape differs: exp_avg_sq/model.layers.2.mlp.experts.w2.weight: checkpoint "
                                "[4, 16, 16], model [4, 16, 24]"));
  // One more layer: its tensors are missing from the checkpoint.
  Config deeper = tiny_config(s.tmp.path() + "/run", {"model.n_layer=4"});
  model = build_model(deeper);
  AdamW opt2(model->parameters(), {});
  e = moetrain::testing::error_of([&] { load_checkpoint(s.dist, dir, *model, &opt2, deeper); });
  CHECK_THAT(e, Catch::Contains("missing in the checkpoint: params/model.layers.3."));
  CHECK_THAT(e, Catch::Contains("config.resolved.yaml"));
}

TEST_CASE("checkpoint: mixed precision saves the f32 master weights; f32 and bf16 runs load each other",
          "[checkpoint][bf16]") {
  // bf16 parameters are storage only on the CPU: the step here gets made-up bf16 grads.
  Saved s;
  s.opt.convert_to_bf16([](const NamedParameter& p) { return !stays_f32_in_mixed_precision(p); });
  const ParameterList& params = s.model->parameters();
  int64_t bf16_params = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& t = params[i].tensor;
    bf16_params += t.dtype() == DType::bf16;
    Tensor g = randn(t.shape(), DType::f32, 500 + i);
    t.set_grad(t.dtype() == DType::bf16 ? g.to(DType::bf16) : g);
  }
  REQUIRE(bf16_params > 0);
  s.opt.step(1e-2);
  const std::string dir = s.save(3);

  // An f32 run resumes from it: its parameters are the masters, the moments f32.
  Config other = tiny_config(s.tmp.path() + "/run", {"train.seed=99"});
  std::unique_ptr<LanguageModel> f32_model = build_model(other);
  AdamW f32_opt(f32_model->parameters(), {});
  load_checkpoint(s.dist, dir, *f32_model, &f32_opt, other);
  for (size_t i = 0; i < params.size(); ++i) {
    INFO(params[i].name);
    CHECK(f32_model->parameters()[i].tensor.dtype() == DType::f32);
    CHECK(moetrain::testing::bitwise_equal(f32_model->parameters()[i].tensor, s.opt.master_or_parameter(i)));
    CHECK(moetrain::testing::bitwise_equal(f32_opt.exp_avg_sq()[i], s.opt.exp_avg_sq()[i]));
  }

  // A bf16 run resumes as the trainer does: load into the f32 model, then convert.
  std::unique_ptr<LanguageModel> model = build_model(other);
  AdamW opt(model->parameters(), {});
  load_checkpoint(s.dist, dir, *model, &opt, other);
  opt.convert_to_bf16([](const NamedParameter& p) { return !stays_f32_in_mixed_precision(p); });
  // Or into a model converted already: the load writes the masters and re-rounds the parameters.
  std::unique_ptr<LanguageModel> converted = build_model(other);
  AdamW converted_opt(converted->parameters(), {});
  converted_opt.convert_to_bf16([](const NamedParameter& p) { return !stays_f32_in_mixed_precision(p); });
  load_checkpoint(s.dist, dir, *converted, &converted_opt, other);
  for (size_t i = 0; i < params.size(); ++i) {
    INFO(params[i].name);
    CHECK(moetrain::testing::bitwise_equal(model->parameters()[i].tensor, params[i].tensor));
    CHECK(moetrain::testing::bitwise_equal(opt.master_or_parameter(i), s.opt.master_or_parameter(i)));
    CHECK(moetrain::testing::bitwise_equal(converted->parameters()[i].tensor, params[i].tensor));
    CHECK(moetrain::testing::bitwise_equal(converted_opt.master_or_parameter(i), s.opt.master_or_parameter(i)));
    CHECK(moetrain::testing::bitwise_equal(opt.exp_avg()[i], s.opt.exp_avg()[i]));
  }
}

TEST_CASE("checkpoint: a tensor with NaN or infinity is never saved, and a checkpoint holding one is never loaded",
          "[checkpoint]") {
  Saved s;
  const std::string good = s.save(2);
  NamedParameter& p = s.model->parameters()[3];
  const Tensor kept = p.tensor.detach().clone();
  p.tensor.data<float>()[1] = std::numeric_limits<float>::quiet_NaN();
  const std::string refused = moetrain::testing::error_of<NumericalError>([&] { s.save(3); });
  CHECK_THAT(refused, Catch::Contains("checkpoint step_00000003: refusing to save params/" + p.name) &&
                          Catch::Contains("1 of " + std::to_string(p.tensor.numel()) + " values are NaN or infinite"));
  CHECK(!fs::exists(checkpoints_dir(s.config.get_string("run.dir")) + "/step_00000003"));
  {
    NoGradGuard no_grad;
    copy_(p.tensor, kept);
  }

  // A checkpoint that holds one anyway (an older build, an edited file): the
  // dataset rewritten with h5py and the manifest's size and SHA-256 made to match.
  const std::string file = good + "/rank_00000.h5", name = "params/" + p.name;
  const std::string script =
      "import h5py, hashlib, json, os, sys\n"
      "d, f, name = sys.argv[1], sys.argv[2], sys.argv[3]\n"
      "with h5py.File(f, 'r+') as h:\n"
      "    x = h[name][...]; x.flat[0] = float('inf'); h[name][...] = x\n"
      "m = json.load(open(d + '/manifest.json'))\n"
      "data = open(f, 'rb').read()\n"
      "m['files'][0]['bytes'] = len(data); m['files'][0]['sha256'] = hashlib.sha256(data).hexdigest()\n"
      "json.dump(m, open(d + '/manifest.json', 'w'))\n";
  moetrain::testing::write_bytes(s.tmp / "poison.py", script);
  REQUIRE(moetrain::testing::run_command("/usr/bin/python3 " + s.tmp / "poison.py" + " " + good + " " + file + " " +
                                         name) == 0);
  std::unique_ptr<LanguageModel> model = build_model(s.config);
  AdamW opt(model->parameters(), {});
  const std::string e = moetrain::testing::error_of([&] { load_checkpoint(s.dist, good, *model, &opt, s.config); });
  CHECK_THAT(e, Catch::Contains("checkpoint " + good + ": " + name) &&
                    Catch::Contains("holds 1 NaN or infinite values") && Catch::Contains("resume from an earlier"));
}
