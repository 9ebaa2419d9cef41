// train.overlap_grad_sync end to end: `moetrain train` under mpirun with the
// gradient buckets summed during backward gives the losses of the blocking sums:
// bit for bit on two ranks (a sum of two is the same in any order), within
// f32 rounding on four (MPI may add four ranks' buckets in another order when
// the buckets differ). The tiny k3 model routes tokens to 16 experts, so some
// experts get no gradient on some ranks; grad_accum 2 overlaps the second
// micro-batch only.
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

  OverlapJob() {
    Result r = moetrain::testing::run_moetrain("prepare " + string(MOETRAIN_SOURCE_DIR) +
                                               "/data/tinyshakespeare.txt --out " + dir +
                                               "/data --tokenizer byte --val-tokens 8192");
    INFO(r.output);
    REQUIRE(r.code == 0);
  }
  Result train(int np, const string& name, const string& sets) const {
    const string args = "train -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml --set data.train=" + dir +
                        "/data/train_*.bin --set data.val= --set train.max_steps=8 --set train.warmup_steps=2 "
                        "--set train.batch_size=2 --set train.seq_len=16 --set train.eval_every=0 "
                        "--set train.threads=1 --set train.log_every=100 --set model.n_layer=4 "
                        "--set model.attn_res_block_size=2 --set ckpt.every=0 --set run.dir=" +
                        dir + "/" + name + " " + sets;
    return moetrain::testing::capture_command(string(kLocalMpirun) + "-np " + std::to_string(np) + " " +
                                              string(MOETRAIN_BINARY_DIR) + "/moetrain " + args);
  }
};

}  // namespace

TEST_CASE("cli: overlapped gradient sync trains to the losses of the blocking one (mpirun -np 2 and 4)",
          "[cli][slow]") {
  OverlapJob job;
  struct Layout {
    int np, ep, accum;
  };
  for (Layout l : {Layout{2, 1, 2}, Layout{2, 2, 1}, Layout{4, 2, 2}}) {
    const string sets = "--set train.ep=" + std::to_string(l.ep) + " --set train.grad_accum=" + std::to_string(l.accum);
    const string name = "np" + std::to_string(l.np) + "ep" + std::to_string(l.ep);
    Result off = job.train(l.np, name + "_off", sets + " --set train.overlap_grad_sync=false");
    Result on = job.train(l.np, name + "_on", sets + " --set train.overlap_grad_sync=true");
    INFO(name << "\n--- off\n" << off.output << "\n--- on\n" << on.output);
    REQUIRE(off.code == 0);
    REQUIRE(on.code == 0);
    const std::vector<double> want = metrics_losses(job.dir + "/" + name + "_off");
    const std::vector<double> got = metrics_losses(job.dir + "/" + name + "_on");
    REQUIRE(want.size() == 8);
    REQUIRE(got.size() == 8);
    if (l.np == 2) {
      CHECK(metrics_history(job.dir + "/" + name + "_on") == metrics_history(job.dir + "/" + name + "_off"));
    } else {
      for (size_t i = 0; i < want.size(); ++i) CHECK(std::abs(got[i] - want[i]) <= 1e-5 * std::abs(want[i]));
    }
  }
}
