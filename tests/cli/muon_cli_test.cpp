// train.optimizer muon end to end, as a user meets it: GPT-2 and the tiny k3 hybrid
// train with Muon on the hidden matrices and AdamW on the rest; the checkpoint
// holds each rule's slots (momentum for Muon's parameters, exp_avg and exp_avg_sq
// for AdamW's); a resume continues bit for bit; a resume with another optimizer is
// refused naming train.optimizer; under mpirun zero 1 (whole matrices owned by one
// rank) gives zero 0's losses bit for bit at 2 ranks, and a 4-rank zero 1
// checkpoint (dp 2 x ep 2) resumes resharded on 1 process, on pp 2, and at zero 1 on
// pp 2 x dp 2 and pp 2 x ep 2, all with QK-Clip clipping heads every step.
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <string>

#include "cli_fixtures.h"
#include "io/hdf5.h"
#include "testing.h"

using moetrain::testing::kLocalMpirun;
using moetrain::testing::metrics_losses;
using moetrain::testing::TempDir;
using std::string;
namespace fs = std::filesystem;

namespace {

using Result = moetrain::testing::CommandOutput;

// The tiny k3 hybrid (MLA, KDA, latent MoE, AttnRes), 12 steps, a checkpoint every 6,
// with MuonClip: Muon and QK-Clip at a threshold its MLA heads pass.
struct MuonK3Job : moetrain::testing::TinyK3Runs {
  string tau = "0.005";  // below the tiny model's largest logits (about 0.03 at init): heads clipped every step

  MuonK3Job() : TinyK3Runs(12, 6, 3) {}
  Result train(int np, const string& run, const string& sets) const {
    return TinyK3Runs::train(np, run, "--set train.optimizer=muon --set train.qk_clip=true --set train.qk_clip_tau=" +
                                          tau + " " + sets);
  }
};

using moetrain::testing::worst_relative;

}  // namespace

TEST_CASE("cli: train.optimizer muon trains GPT-2 with each rule's slots in the checkpoint, resumes bit for bit and "
          "refuses a resume with another optimizer", "[cli]") {
  moetrain::testing::TinyGpt2Runs runs;
  const string muon = "--set train.optimizer=muon --set train.lr=0.02 --set train.warmup_steps=2";
  Result r = runs.train("ref", 20, muon);
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("train.optimizer muon: Muon on"));
  const std::vector<double> want = metrics_losses(runs.path("ref"));
  REQUIRE(want.size() == 20);
  CHECK(want.back() < want.front() - 1.0);  // it learns (byte-level loss starts near ln 256 = 5.5)

  moetrain::hdf5::Reader file(runs.path("ref", "checkpoints/step_00000010/rank_00000.h5"));
  const std::vector<string> groups = file.groups("/");
  CHECK(std::find(groups.begin(), groups.end(), "momentum") != groups.end());
  CHECK(file.has_dataset("momentum", "h.0.attn.c_attn.weight"));
  CHECK(file.has_dataset("momentum", "h.1.mlp.c_proj.weight"));
  CHECK(!file.has_dataset("exp_avg", "h.0.attn.c_attn.weight"));
  CHECK(file.has_dataset("exp_avg", "wte.weight"));  // embeddings, norms and biases: AdamW
  CHECK(file.has_dataset("exp_avg_sq", "h.0.ln_1.weight"));
  CHECK(file.has_dataset("exp_avg", "h.0.attn.c_attn.bias"));
  CHECK(!file.has_dataset("momentum", "wte.weight"));

  // Resume from step 10: the same 10 last losses, bit for bit (one process, one thread).
  fs::copy(runs.path("ref"), runs.path("resumed"), fs::copy_options::recursive);
  fs::remove_all(runs.path("resumed", "checkpoints/step_00000020"));
  fs::remove(runs.path("resumed", "metrics.jsonl"));
  r = runs.train("resumed", 20, muon + " --set ckpt.resume=auto");
  INFO(r.output);
  REQUIRE(r.code == 0);
  const std::vector<double> got = metrics_losses(runs.path("resumed"));
  REQUIRE(got.size() == 10);
  for (size_t i = 0; i < got.size(); ++i) CHECK(got[i] == want[10 + i]);

  // Another optimizer cannot take this state.
  fs::copy(runs.path("ref"), runs.path("switched"), fs::copy_options::recursive);
  r = runs.train("switched", 30, "--set ckpt.resume=auto");
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("train.optimizer") && Catch::Contains("is adamw but") &&
                           Catch::Contains("saved with muon"));
}

TEST_CASE("cli: train.qk_clip records each layer's largest logit, clips at a low tau, and at a high one changes no "
          "bit of a Muon run", "[cli]") {
  moetrain::testing::TinyGpt2Runs runs;
  const string muon = "--set train.optimizer=muon --set train.lr=0.02 --set train.warmup_steps=2";
  Result plain = runs.train("plain", 6, muon);
  REQUIRE(plain.code == 0);
  Result high = runs.train("high", 6, muon + " --set train.qk_clip=true --set train.qk_clip_tau=1e6");
  INFO(high.output);
  REQUIRE(high.code == 0);
  CHECK(metrics_losses(runs.path("high")) == metrics_losses(runs.path("plain")));
  const string m = moetrain::testing::read_bytes(runs.path("high", "metrics.jsonl"));
  CHECK_THAT(m, Catch::Contains("\"max_logit\":") && Catch::Contains("\"max_logit_layers.0\":") &&
                    Catch::Contains("\"max_logit_layers.1\":") && Catch::Contains("\"qk_clipped_heads\":0"));
  CHECK_THAT(high.output, Catch::Contains("| max logit "));
  Result low = runs.train("low", 6, muon + " --set train.qk_clip=true --set train.qk_clip_tau=1e-3");
  INFO(low.output);
  REQUIRE(low.code == 0);
  CHECK_THAT(moetrain::testing::read_bytes(runs.path("low", "metrics.jsonl")),
             !Catch::Contains("\"qk_clipped_heads\":0"));
  CHECK_THAT(low.output, Catch::Contains("heads clipped"));
  CHECK(metrics_losses(runs.path("low")) != metrics_losses(runs.path("plain")));
  // Bad values are refused naming the key.
  Result bad = runs.train("bad", 2, "--set train.qk_clip_tau=0");
  CHECK(bad.code == 2);
  CHECK_THAT(bad.output, Catch::Contains("train.qk_clip_tau"));
  bad = runs.train("bad", 2, "--set train.optimizer=lion");
  CHECK(bad.code == 2);
  CHECK_THAT(bad.output, Catch::Contains("train.optimizer") && Catch::Contains("muon"));
  bad = runs.train("bad", 2, "--set train.muon_momentum=1");
  CHECK(bad.code == 2);
  CHECK_THAT(bad.output, Catch::Contains("train.muon_momentum"));
}

TEST_CASE("cli: Muon on the k3 hybrid: zero 1 gives zero 0's losses bit for bit at 2 ranks; a 4-rank zero 1 "
          "checkpoint (whole matrices per rank) resumes resharded on 1 process, on pp 2, and at zero 1 on pp 2 x dp 2 and pp 2 x ep 2", "[cli][slow]") {
  MuonK3Job job;
  // One process: the reference; Muon's matrices and AdamW's vectors both in the file.
  Result r = job.train(1, "one", "");
  INFO(r.output);
  REQUIRE(r.code == 0);
  const std::vector<double> one = metrics_losses(job.dir + "/one");
  REQUIRE(one.size() == 12);
  CHECK(one.back() < one.front());
  const string metrics = moetrain::testing::read_bytes(job.dir + "/one/metrics.jsonl");
  CHECK_THAT(metrics, Catch::Contains("\"max_logit_layers.3\":"));  // the MLA layer
  CHECK_THAT(metrics, Catch::Contains("\"qk_clipped_heads\":2"));

  // 2 ranks (dp 2): zero 0 and zero 1. The gradient sums are a + b either way and
  // each matrix's update runs on its owner alone, so the losses agree exactly.
  r = job.train(2, "z0", "");
  INFO(r.output);
  REQUIRE(r.code == 0);
  r = job.train(2, "z1", "--set train.zero=1");
  INFO(r.output);
  REQUIRE(r.code == 0);
  const std::vector<double> z0 = metrics_losses(job.dir + "/z0"), z1 = metrics_losses(job.dir + "/z1");
  REQUIRE(z0.size() == 12);
  REQUIRE(z1.size() == 12);
  for (size_t i = 0; i < z0.size(); ++i) CHECK(z1[i] == z0[i]);

  // 4 ranks, dp 2 x ep 2, zero 1: the experts' matrices owned whole over each dp group.
  r = job.train(4, "ref", "--set train.ep=2 --set train.zero=1");
  INFO(r.output);
  REQUIRE(r.code == 0);
  const std::vector<double> want = metrics_losses(job.dir + "/ref");
  REQUIRE(want.size() == 12);
  // Resharded from step 6: one process at zero 0 (grad_accum 4 stands for the 4
  // replicas), pp 2 x dp 1 at zero 0 and pp 2 x dp 2 at zero 1: the same model up
  // to summation order (f32; 1e-5 relative, as the other reshard tests).
  struct Layout {
    int np;
    string sets;
  };
  for (const Layout& l : {Layout{1, "--set train.grad_accum=4"}, Layout{2, "--set train.pp=2 --set train.grad_accum=4"},
                          Layout{4, "--set train.pp=2 --set train.zero=1 --set train.grad_accum=2"},
                          Layout{4, "--set train.pp=2 --set train.ep=2 --set train.zero=1 --set train.grad_accum=2"}}) {
    const string name = "np" + std::to_string(l.np) + (l.sets.find("zero=1") != string::npos ? "z1" : "") +
                        (l.sets.find("ep=2") != string::npos ? "ep2" : "");
    fs::copy(job.dir + "/ref", job.dir + "/" + name, fs::copy_options::recursive);
    fs::remove_all(job.dir + "/" + name + "/checkpoints/step_00000012");
    fs::remove(job.dir + "/" + name + "/metrics.jsonl");
    r = job.train(l.np, name, l.sets + " --set ckpt.resume=auto");
    INFO(name << "\n" << r.output);
    REQUIRE(r.code == 0);
    const std::vector<double> got = metrics_losses(job.dir + "/" + name);
    REQUIRE(got.size() == 6);
    std::vector<double> tail(want.begin() + 6, want.end());
    CHECK(worst_relative(got, tail, 0) < 1e-5);
  }
}

TEST_CASE("cli: MuonClip (train.optimizer muon, train.qk_clip) trains every shipped config that fits one process "
          "for 2 steps, clipping heads", "[cli][slow]") {
  TempDir tmp;
  moetrain::testing::prepare_byte_shards(tmp.path());
  // The configs too large for one process: their Muon/AdamW split is the ledger's
  // (configs tested by qk_clip_sites_test and the ledger tests).
  for (const string& config : moetrain::testing::one_process_configs()) {
    const string run = tmp.path() + "/" + config;
    const Result r = moetrain::testing::run_moetrain(
        moetrain::testing::short_config_run_args(config, tmp.path(), run) +
        " --set train.optimizer=muon --set train.qk_clip=true --set train.qk_clip_tau=1e-4");
    INFO(config << "\n" << r.output);
    REQUIRE(r.code == 0);
    const std::vector<double> losses = metrics_losses(run);
    REQUIRE(losses.size() == 2);
    for (double l : losses) CHECK(std::isfinite(l));
    CHECK_THAT(moetrain::testing::read_bytes(run + "/metrics.jsonl"), Catch::Contains("\"max_logit\":") &&
                                                                          !Catch::Contains("\"qk_clipped_heads\":0"));
  }
}
