// train.pp end to end (issue 26): `moetrain train` under mpirun with a pipeline
// gives one process's losses on the same global batch in f64, and a checkpoint
// written at pp 2 x ep 2 resumes at one process, at pp 4 and at pp 2 x dp 2 x ep 2
// (8 ranks, oversubscribed) to the uninterrupted run's losses. The model is
// k3-tiny at 4 layers with AttnRes blocks of 3 (block 1 opens on the last stage at
// pp 2 and pp 4), MoE in layers 1-3 (on every stage) and tied embeddings.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <string>

#include "testing.h"

using moetrain::testing::kLocalMpirun;
using moetrain::testing::metrics_losses;
using moetrain::testing::TempDir;
using std::string;

namespace {

using Result = moetrain::testing::CommandOutput;

struct PipelineJob {
  TempDir tmp;
  string dir = tmp.path();

  PipelineJob() { moetrain::testing::prepare_byte_shards(dir); }
  // `replicas` data-parallel copies of each stage: grad_accum keeps the global batch at 8 micro-batches.
  Result train(int np, int pp, int ep, const string& name, const string& sets = "") const {
    const int replicas = std::max(1, np / pp);
    const string args = "train -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml --set data.train=" + dir +
                        "/data/train_*.bin --set data.val=" + dir + "/data/val_*.bin --set train.max_steps=4 "
                        "--set train.warmup_steps=2 --set train.batch_size=2 --set train.seq_len=16 "
                        "--set train.eval_every=4 --set train.eval_batches=2 --set train.threads=1 "
                        "--set train.log_every=100 --set model.n_layer=4 --set model.attn_res_block_size=3 "
                        "--set model.tie_embeddings=true --set train.dtype=f64 --set ckpt.every=2 --set run.dir=" +
                        dir + "/" + name + " --set train.pp=" + std::to_string(pp) + " --set train.ep=" +
                        std::to_string(ep) + " --set train.grad_accum=" + std::to_string(8 / replicas) + " " + sets;
    const string launcher = np == 1 ? string() : string(kLocalMpirun) + "-np " + std::to_string(np) + " ";
    return moetrain::testing::capture_command(launcher + string(MOETRAIN_BINARY_DIR) + "/moetrain " + args);
  }
};

void check_close(const std::vector<double>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("loss " << i << ": " << got[i] << " vs " << want[i]);
    CHECK(std::abs(got[i] - want[i]) < 1e-10 * std::abs(want[i]));
  }
}

// The validation loss line of a run's output.
string val_loss(const string& out) { return out.substr(out.rfind("val loss"), 16); }

// The one-process run every layout is compared with (4 steps).
Result reference_run(const PipelineJob& job) {
  Result one = job.train(1, 1, 1, "one");
  INFO(one.output);
  REQUIRE(one.code == 0);
  REQUIRE(metrics_losses(job.dir + "/one").size() == 4);
  return one;
}

// Run `from` copied to `name` without its step-4 checkpoint, resumed from step 2 with
// job.train(np, pp, ep, name, sets): its steps 3-4 must be the uninterrupted ones (want).
void check_resume(const PipelineJob& job, const string& from, const string& name, int np, int pp, int ep,
                  const string& sets, const std::vector<double>& want) {
  Result copy = moetrain::testing::capture_command("cp -r " + job.dir + "/" + from + " " + job.dir + "/" + name +
                                                   " && rm -r " + job.dir + "/" + name + "/checkpoints/step_00000004");
  REQUIRE(copy.code == 0);
  Result r = job.train(np, pp, ep, name, "--set ckpt.resume=step_00000002 " + sets);
  INFO("from " << from << " np " << np << " pp " << pp << " ep " << ep << " " << sets << "\n" << r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.find("resumed from") != string::npos);
  const std::vector<double> got = metrics_losses(job.dir + "/" + name);
  REQUIRE(got.size() >= 2);
  check_close({got.end() - 2, got.end()}, {want.end() - 2, want.end()});
}

}  // namespace

TEST_CASE("cli: pipeline training equals one process and its checkpoints reshard (pp 2/4, ep 2, dp 2)",
          "[cli][slow]") {
  PipelineJob job;
  const Result one = reference_run(job);
  const std::vector<double> want = metrics_losses(job.dir + "/one");

  Result pipe = job.train(4, 2, 2, "pipe");
  INFO(pipe.output);
  REQUIRE(pipe.code == 0);
  CHECK(pipe.output.find("4 rank(s): pp 2 x dp 1 x ep 2") != string::npos);
  check_close(metrics_losses(job.dir + "/pipe"), want);
  // The validation loss (the pipelined view of the model) and the written model are the whole model's.
  CHECK(one.output.find("val loss") != string::npos);
  CHECK(val_loss(pipe.output) == val_loss(one.output));

  // Resume the pp 2 x ep 2 checkpoint of step 2 in other layouts: steps 3-4 as uninterrupted.
  struct Layout {
    int np, pp, ep;
  };
  for (Layout l : {Layout{1, 1, 1}, Layout{4, 4, 1}, Layout{8, 2, 2}})
    check_resume(job, "pipe", "resume" + std::to_string(l.np) + std::to_string(l.pp) + std::to_string(l.ep), l.np,
                 l.pp, l.ep, "", want);
}

TEST_CASE("cli: virtual pipeline stages (train.pp_virtual) equal one process; checkpoints resume across V",
          "[cli][slow]") {
  // 4 layers over pp 2 x V 2: rank 0 holds layers 0 and 2, rank 1 layers 1 and 3 (block 1 opens at layer 3).
  PipelineJob job;
  const Result one = reference_run(job);
  const std::vector<double> want = metrics_losses(job.dir + "/one");
  for (int ep : {1, 2}) {
    const string name = "virtual" + std::to_string(ep);
    Result r = job.train(2 * ep, 2, ep, name, "--set train.pp_virtual=2");
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK(r.output.find("layers 0-0, 2-2 and the embedding") != string::npos);
    check_close(metrics_losses(job.dir + "/" + name), want);
    CHECK(val_loss(r.output) == val_loss(one.output));
  }
  // The pp 2 x V 2 checkpoint of step 2 resumes with V 1, at one process and at pp 4 (one layer a rank);
  // a V 1 checkpoint resumes with V 2.
  Result plain = job.train(2, 2, 1, "plain");
  REQUIRE(plain.code == 0);
  struct Resume {
    string from;
    int np, pp, V;
  };
  for (const Resume& l : {Resume{"virtual1", 2, 2, 1}, Resume{"virtual1", 1, 1, 1}, Resume{"virtual1", 4, 4, 1},
                          Resume{"plain", 2, 2, 2}})
    check_resume(job, l.from, "resume_" + l.from + std::to_string(l.np) + std::to_string(l.pp) + std::to_string(l.V),
                 l.np, l.pp, 1, "--set train.pp_virtual=" + std::to_string(l.V), want);
}

TEST_CASE("cli: train.pp refuses layouts it cannot run, naming the key", "[cli]") {
  PipelineJob job;
  Result odd = job.train(2, 3, 1, "odd");  // 2 ranks into 3 stages
  CHECK(odd.code == 2);
  CHECK(odd.output.find("train.pp") != string::npos);
  Result deep = job.train(1, 1, 1, "deep", "--set train.pp=1 --set model.n_layer=2 --set train.pp=2");
  CHECK(deep.code == 2);
  CHECK(deep.output.find("does not divide") != string::npos);
  Result too_many = job.train(8, 8, 1, "too_many");  // 4 layers over 8 stages
  CHECK(too_many.code == 2);
  CHECK(too_many.output.find("exceeds the model's 4 layers") != string::npos);
  Result lone = job.train(1, 1, 1, "lone", "--set train.pp_virtual=2");  // nothing to interleave
  CHECK(lone.code == 2);
  CHECK(lone.output.find("train.pp_virtual") != string::npos);
  CHECK(lone.output.find("needs train.pp > 1") != string::npos);
  Result thin = job.train(2, 2, 1, "thin", "--set train.pp_virtual=3");  // 6 virtual stages, 4 layers
  CHECK(thin.code == 2);
  CHECK(thin.output.find("6 virtual stages, more than the model's 4 layers") != string::npos);
  Result odd_m = job.train(2, 2, 1, "odd_m", "--set train.pp_virtual=2 --set train.grad_accum=3");
  CHECK(odd_m.code == 2);
  CHECK(odd_m.output.find("train.grad_accum") != string::npos);
  CHECK(odd_m.output.find("not a multiple of train.pp = 2") != string::npos);
  Result gpt2 = moetrain::testing::run_moetrain("train -c " + string(MOETRAIN_SOURCE_DIR) +
                                                "/configs/gpt2-shakespeare.yaml --set train.pp=2 --set run.dir=" + job.dir +
                                                "/gpt2");
  CHECK(gpt2.code == 2);
  CHECK(gpt2.output.find("model.arch hybrid") != string::npos);
}
