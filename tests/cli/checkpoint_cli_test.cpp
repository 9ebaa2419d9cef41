// Checkpoints end to end, as a user meets them: a job killed on one rank (or
// while it saves) resumes from its last complete checkpoint and continues bit for
// bit; SIGUSR1 saves and exits; a checkpoint from EP 4 resumes at EP 2 and on one
// process; corrupt or mismatched checkpoints end with exit 2 and the file named.
// A tiny k3 model (3 KDA + 1 MLA layers, 16 experts top 4, 2 shared) on bytes,
// one thread per rank, under mpirun -np 4.
#include <catch2/catch.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <fmt/format.h>

#include "testing.h"

using moetrain::testing::kLocalMpirun;
using moetrain::testing::metrics_history;
using moetrain::testing::metrics_losses;
using moetrain::testing::TempDir;
using std::string;
namespace fs = std::filesystem;

namespace {

using Result = moetrain::testing::CommandOutput;

struct Job {
  TempDir tmp;
  string dir = tmp.path();

  Job() { moetrain::testing::prepare_byte_shards(dir); }
  // `moetrain train` of the tiny k3 model for `steps` steps, a checkpoint every 10.
  string train_args(int steps = 60) const {
    return "train -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml --set data.train=" + dir +
           "/data/train_*.bin --set data.val= --set train.max_steps=" + std::to_string(steps) +
           " --set train.warmup_steps=5 --set train.batch_size=2 --set train.seq_len=16 --set train.eval_every=0 "
           "--set train.threads=1 --set train.log_every=100 --set model.n_layer=4 --set model.attn_res_block_size=2 "
           "--set ckpt.every=10";
  }
  string moetrain() const { return string(MOETRAIN_BINARY_DIR) + "/moetrain "; }
  Result mpirun(int np, const string& args) const {
    return moetrain::testing::capture_command(string(kLocalMpirun) + "-np " + std::to_string(np) + " " + moetrain() +
                                              args);
  }
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST_CASE("cli: a job killed on one rank, or while saving, resumes from its last checkpoint bit for bit "
          "(mpirun -np 4, EP 2 x DP 2 and EP 4)", "[cli][slow]") {
  Job job;
  for (int ep : {2, 4}) {
    const string args = job.train_args() + " --set train.ep=" + std::to_string(ep);
    const string ref = job.dir + "/ref" + std::to_string(ep);
    Result r = job.mpirun(4, args + " --set run.dir=" + ref);
    INFO("reference, ep " << ep << "\n" << r.output);
    REQUIRE(r.code == 0);
    const string want = metrics_history(ref);
    REQUIRE(metrics_losses(ref).size() == 60);

    struct Fault {
      string sets;       // the fault injected
      string resumed;    // the checkpoint the rerun must start from
    };
    std::vector<Fault> faults = {{"--set fault.kind=kill --set fault.rank=1 --set fault.step=37", "step_00000030"}};
    if (ep == 2) {
      faults.push_back({"--set fault.kind=kill_during_ckpt --set fault.rank=1 --set fault.step=40 "
                        "--set fault.phase=before_commit", "step_00000030"});
      faults.push_back({"--set fault.kind=kill_during_ckpt --set fault.rank=0 --set fault.step=40 "
                        "--set fault.phase=before_rename", "step_00000030"});
      faults.push_back({"--set fault.kind=kill_during_ckpt --set fault.rank=0 --set fault.step=40 "
                        "--set fault.phase=before_latest", "step_00000040"});
      // Saves in a background thread: the same checkpoints, the same continuation.
      faults.push_back({"--set ckpt.async=true --set fault.kind=kill --set fault.rank=1 --set fault.step=37",
                        "step_00000030"});
      faults.push_back({"--set ckpt.async=true --set fault.kind=kill_during_ckpt --set fault.rank=1 "
                        "--set fault.step=40 --set fault.phase=before_commit", "step_00000030"});
    }
    for (size_t i = 0; i < faults.size(); ++i) {
      const string run = job.dir + "/ep" + std::to_string(ep) + "_fault" + std::to_string(i);
      INFO("ep " << ep << ", " << faults[i].sets);
      const auto t0 = std::chrono::steady_clock::now();
      Result killed = job.mpirun(4, args + " --set run.dir=" + run + " " + faults[i].sets);
      INFO(killed.output);
      CHECK(killed.code != 0);
      CHECK(seconds_since(t0) < 60);  // the job ends when a rank dies; the watchdog is not needed
      CHECK(killed.output.find("fault injection (a testing aid)") != string::npos);

      Result resumed = job.mpirun(4, args + " --set run.dir=" + run + " --set ckpt.resume=auto");
      INFO(resumed.output);
      REQUIRE(resumed.code == 0);
      CHECK(resumed.output.find("resumed from " + run + "/checkpoints/" + faults[i].resumed + " (step ") !=
            string::npos);
      CHECK(metrics_history(run) == want);  // steps 1..60 (those after the checkpoint recomputed) equal to the bit
      CHECK(moetrain::testing::read_bytes(run + "/checkpoints/latest") == "step_00000060\n");
    }
  }
}

TEST_CASE("cli: a checkpoint from EP 4 resumes at EP 2 and on one process within tolerance, and exports",
          "[cli][slow]") {
  // Same data stream and global batch: world x grad_accum = 4 micro-batches per
  // step in every layout. Experts and their AdamW moments are resharded by global
  // expert index. Only summation orders differ (f32): losses agree to 1e-5 relative.
  Job job;
  const string args = job.train_args(30);
  const string ref = job.dir + "/ep4";
  Result r = job.mpirun(4, args + " --set train.ep=4 --set run.dir=" + ref);
  INFO(r.output);
  REQUIRE(r.code == 0);
  const std::vector<double> want = metrics_losses(ref);
  REQUIRE(want.size() == 30);
  // The start-up lines say what rank 0 holds and what the model has, not one as the other.
  CHECK_THAT(r.output, Catch::Contains("parameters on rank 0 (the replicated ones + its 1/4 of the routed experts"));
  CHECK_THAT(r.output, Catch::Contains("parameters in the model ("));
  // `moetrain export` of the last checkpoint (experts gathered from the 4 rank files)
  // evaluates exactly like the model the training run wrote at its end.
  Result exported = moetrain::testing::run_moetrain("export --checkpoint " + ref + "/checkpoints/step_00000030 --out " +
                                                    job.dir + "/exported --no-progress");
  INFO(exported.output);
  REQUIRE(exported.code == 0);
  auto eval = [&](const string& model_dir) {
    Result e = moetrain::testing::run_moetrain("eval --checkpoint " + model_dir + " --data '" + job.dir +
                                               "/data/val_*.bin' --batches 4", false);
    INFO(e.output);
    REQUIRE(e.code == 0);
    return e.output;
  };
  CHECK(eval(job.dir + "/exported") == eval(ref + "/model"));
  struct Layout {
    int np, ep, accum;
  };
  for (Layout l : {Layout{4, 2, 1}, Layout{2, 2, 2}, Layout{1, 1, 4}}) {
    const string run = job.dir + "/np" + std::to_string(l.np) + "ep" + std::to_string(l.ep);
    fs::copy(ref, run, fs::copy_options::recursive);
    const string sets = args + " --set run.dir=" + run + " --set ckpt.resume=step_00000020 --set train.ep=" +
                        std::to_string(l.ep) + " --set train.grad_accum=" + std::to_string(l.accum);
    Result res = l.np == 1 ? moetrain::testing::run_moetrain(sets) : job.mpirun(l.np, sets);
    INFO("np " << l.np << " ep " << l.ep << "\n" << res.output);
    REQUIRE(res.code == 0);
    CHECK(res.output.find("resumed from " + run + "/checkpoints/step_00000020 (step 20") != string::npos);
    const std::vector<double> got = metrics_losses(run);
    REQUIRE(got.size() == 30);
    for (size_t i = 0; i < 20; ++i) CHECK(got[i] == want[i]);  // the history before the checkpoint, kept
    double worst = 0;
    for (size_t i = 20; i < 30; ++i) worst = std::max(worst, std::abs(got[i] - want[i]) / want[i]);
    CHECK(worst < 1e-5);
  }
}

TEST_CASE("cli: SIGUSR1 to mpirun saves a checkpoint on every rank and exits 0; the resumed run is exact",
          "[cli][slow]") {
  Job job;
  const string args = job.train_args(60) + " --set train.ep=2 --set ckpt.every=0";
  const string ref = job.dir + "/ref", run = job.dir + "/signalled";
  Result r = job.mpirun(4, args + " --set run.dir=" + ref);
  INFO(r.output);
  REQUIRE(r.code == 0);
  // mpirun forwards SIGUSR1 to the ranks; send it once a few steps are logged.
  Result sig = moetrain::testing::capture_command(
      "{ " + string(kLocalMpirun) + "-np 4 " + job.moetrain() + args + " --set run.dir=" + run + " > " + job.dir +
      "/signalled.log 2>&1 & pid=$!; i=0; while [ \"$( (wc -l < " + run + "/metrics.jsonl) 2>/dev/null || echo 0)\" "
      "-lt 5 ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; kill -USR1 $pid; wait $pid; echo \"rc=$?\"; }");
  const string log = moetrain::testing::read_bytes(job.dir + "/signalled.log");
  INFO(sig.output << log);
  CHECK(sig.output.find("rc=0") != string::npos);
  CHECK(log.find("SIGUSR1: saving a checkpoint at step ") != string::npos);
  const std::vector<double> partial = metrics_losses(run);
  REQUIRE(!partial.empty());
  REQUIRE(partial.size() < 60);
  CHECK(fs::exists(run + "/checkpoints/step_" + fmt::format("{:08d}", partial.size()) + "/COMMIT"));
  CHECK(!fs::exists(run + "/model"));  // the run is not finished: no final export

  Result resumed = job.mpirun(4, args + " --set run.dir=" + run + " --set ckpt.resume=auto");
  INFO(resumed.output);
  REQUIRE(resumed.code == 0);
  CHECK(metrics_history(run) == metrics_history(ref));
}

TEST_CASE("cli: resuming from a corrupt or mismatched checkpoint exits 2 naming the file, dataset or tensors",
          "[cli]") {
  Job job;
  const string run = job.dir + "/run";
  const string args = job.train_args(20) + " --set run.dir=" + run;
  Result r = moetrain::testing::run_moetrain(args);
  INFO(r.output);
  REQUIRE(r.code == 0);
  const string file = run + "/checkpoints/step_00000020/rank_00000.h5";
  const string good = moetrain::testing::read_bytes(file);
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(good.size() / 2));
    f.put(static_cast<char>(good[good.size() / 2] ^ 0x01));
  }
  Result corrupt = moetrain::testing::run_moetrain(args + " --set ckpt.resume=auto");
  INFO(corrupt.output);
  CHECK(corrupt.code == 2);
  CHECK(corrupt.output.find(file + " is corrupt") != string::npos);
  CHECK(corrupt.output.find("dataset /") != string::npos);
  CHECK(corrupt.output.find("resumed from") == string::npos);

  moetrain::testing::write_bytes(file, good.substr(0, good.size() / 3));
  Result truncated = moetrain::testing::run_moetrain(args + " --set ckpt.resume=auto");
  INFO(truncated.output);
  CHECK(truncated.code == 2);
  CHECK(truncated.output.find(file + " has " + std::to_string(good.size() / 3) + " bytes") != string::npos);

  moetrain::testing::write_bytes(file, good);
  Result mismatch = moetrain::testing::run_moetrain(args + " --set ckpt.resume=step_00000010 "
                                                    "--set model.moe.expert_d_ff=48");
  INFO(mismatch.output);
  CHECK(mismatch.code == 2);
  CHECK(mismatch.output.find("does not match the model of this config (0 tensors missing, 0 unexpected, ") !=
        string::npos);
  CHECK(mismatch.output.find("shape differs: params/model.layers.1.mlp.experts.w1.weight: checkpoint [16, 32, 32], "
                             "model [16, 48, 32]") != string::npos);
}

TEST_CASE("cli: a full disk during a checkpoint save exits 5 and leaves the earlier checkpoint intact", "[cli]") {
  // run.dir on a 1 MiB tmpfs: the checkpoint of step 3 fits, the one of step 6 does not.
  Job job;
  const string mnt = job.dir + "/small";
  fs::create_directories(mnt);
  if (moetrain::testing::run_command("mount -t tmpfs -o size=1m tmpfs " + mnt + " 2>/dev/null") != 0) {
    WARN("skipped: cannot mount a tmpfs here (needs root)");
    return;
  }
  struct Unmount {
    string path;
    ~Unmount() { moetrain::testing::run_command("umount " + path); }
  } unmount{mnt};
  const string config = job.dir + "/tiny.yaml";
  moetrain::testing::write_bytes(config, "model:\n  vocab_size: 256\n  n_layer: 2\n  n_head: 2\n  d_model: 32\n"
                                 "  n_ctx: 64\ndata:\n  train: " + job.dir + "/data/train_*.bin\n  val: ''\n"
                                 "  tokenizer: byte\ntrain:\n  batch_size: 4\n  seq_len: 32\n  max_steps: 6\n"
                                 "  eval_every: 0\nckpt:\n  every: 3\n");
  Result full = moetrain::testing::run_moetrain("train -c " + config + " --set run.dir=" + mnt + "/run");
  INFO(full.output);
  CHECK(full.code == 5);
  CHECK(full.output.find("No space left on device") != string::npos);
  CHECK(fs::exists(mnt + "/run/checkpoints/step_00000003/COMMIT"));
  CHECK(!fs::exists(mnt + "/run/checkpoints/step_00000006"));
  // The committed checkpoint is whole: a copy on a roomy disk resumes from it and finishes.
  fs::copy(mnt + "/run", job.dir + "/run", fs::copy_options::recursive);
  Result resumed = moetrain::testing::run_moetrain("train -c " + config + " --set run.dir=" + job.dir +
                                                   "/run --set ckpt.resume=auto");
  INFO(resumed.output);
  CHECK(resumed.code == 0);
  CHECK(resumed.output.find("resumed from " + job.dir + "/run/checkpoints/step_00000003 (step 3") != string::npos);
}
