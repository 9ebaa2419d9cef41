// train.overlap_grad_sync end to end: `moetrain train` under mpirun -np 2 with
// the gradient buckets summed during backward gives the metrics of the blocking
// sums bit for bit (a sum of two is the same in any order). The tiny k3 model
// routes tokens to 16 experts, EP 2 shards them (expert shards and replicated
// parameters in separate groups), so some experts get no gradient on some ranks;
// grad_accum 2 overlaps the second micro-batch only. Four ranks, where MPI may
// add in another order, are covered at the bucket level ([comm][mpi]); one
// layout here keeps CI's time.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>

#include "testing.h"

using moetrain::testing::kLocalMpirun;
using moetrain::testing::metrics_history;
using moetrain::testing::metrics_losses;
using moetrain::testing::TempDir;
using std::string;

namespace {

using Result = moetrain::testing::CommandOutput;

struct OverlapJob {
  TempDir tmp;
  string dir = tmp.path();

  OverlapJob() { moetrain::testing::prepare_byte_shards(dir); }
  Result train(int np, const string& name, const string& sets) const {
    const string args = "train -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml --set data.train=" + dir +
                        "/data/train_*.bin --set data.val= --set train.max_steps=4 --set train.warmup_steps=2 "
                        "--set train.batch_size=2 --set train.seq_len=16 --set train.eval_every=0 "
                        "--set train.threads=1 --set train.log_every=100 --set model.n_layer=4 "
                        "--set model.attn_res_block_size=2 --set ckpt.every=0 --set run.dir=" +
                        dir + "/" + name + " " + sets;
    return moetrain::testing::capture_command(string(kLocalMpirun) + "-np " + std::to_string(np) + " " +
                                              string(MOETRAIN_BINARY_DIR) + "/moetrain " + args);
  }
};

}  // namespace

TEST_CASE("cli: overlapped gradient sync trains to the metrics of the blocking one (mpirun -np 2, EP 2, accum 2)",
          "[cli][slow]") {
  OverlapJob job;
  const string sets = "--set train.ep=2 --set train.grad_accum=2";
  Result off = job.train(2, "off", sets + " --set train.overlap_grad_sync=false");
  Result on = job.train(2, "on", sets + " --set train.overlap_grad_sync=true");
  INFO("--- off\n" << off.output << "\n--- on\n" << on.output);
  REQUIRE(off.code == 0);
  REQUIRE(on.code == 0);
  REQUIRE(metrics_losses(job.dir + "/off").size() == 4);
  CHECK(metrics_history(job.dir + "/on") == metrics_history(job.dir + "/off"));
  CHECK(on.output.find("started during backward") != string::npos);
}
