// train.activation_checkpointing and train.recompute_modules on the hybrid model end to end
// (docs/training.md#activation-recomputation): the same layout with and without recomputation
// (whole layers; the act and experts modules) gives the same metrics history bit for bit
// (losses, gradient norms, MoE load, max logits: everything but the timings), on one process
// and under mpirun at pp 2 x ep 2 and pp 2 x dp 2 x ep 2 (the reductions run in the same
// order in both runs of a layout, so bitwise equality is what the code guarantees).
#include <catch2/catch.hpp>

#include <string>

#include "cli_fixtures.h"
#include "testing.h"

using moetrain::testing::metrics_history;
using moetrain::testing::TinyK3Runs;
using std::string;

TEST_CASE("cli: hybrid training with layers recomputed equals training that stores them, bit for bit",
          "[cli][slow]") {
  TinyK3Runs job(3, 0, 1);
  struct Layout {
    int np, pp, ep, grad_accum;
    bool attn_res;
  };
  // MoE with an aux loss, capacity and the z-loss, so every recomputed path carries a gradient.
  const string common = "--set model.moe.aux_loss_weight=0.01 --set model.moe.z_loss_weight=0.001 "
                        "--set model.moe.capacity_factor=1.5 --set train.qk_clip=true ";
  for (Layout l : {Layout{1, 1, 1, 4, true}, Layout{1, 1, 1, 4, false}, Layout{4, 2, 2, 4, true},
                   Layout{4, 2, 2, 4, false}, Layout{8, 2, 2, 2, true}}) {
    DYNAMIC_SECTION("np " << l.np << " pp " << l.pp << " ep " << l.ep << (l.attn_res ? " attn_res" : " plain")) {
      const string layout = common + "--set train.pp=" + std::to_string(l.pp) + " --set train.ep=" +
                            std::to_string(l.ep) + " --set train.grad_accum=" + std::to_string(l.grad_accum) +
                            " --set model.attn_res=" + (l.attn_res ? "true" : "false");
      const string tag = std::to_string(l.np) + std::to_string(l.pp) + std::to_string(l.ep) + (l.attn_res ? "r" : "p");
      auto stored = job.train(l.np, "stored" + tag, layout);
      INFO(stored.output);
      REQUIRE(stored.code == 0);
      auto again = job.train(l.np, "again" + tag, layout + " --set train.activation_checkpointing=true");
      INFO(again.output);
      REQUIRE(again.code == 0);
      auto selective = job.train(l.np, "selective" + tag, layout + " --set train.recompute_modules=act,experts");
      INFO(selective.output);
      REQUIRE(selective.code == 0);
      const string want = metrics_history(job.dir + "/stored" + tag);
      REQUIRE(want.find("\"loss\"") != string::npos);
      CHECK(metrics_history(job.dir + "/again" + tag) == want);
      CHECK(metrics_history(job.dir + "/selective" + tag) == want);
    }
  }
}

TEST_CASE("cli: recomputation under train.overlap_grad_sync equals the stored run, bit for bit", "[cli][slow]") {
  // 2 ranks (dp 2): gradient buckets are summed while backward runs, as the grad-ready
  // hook reports each parameter; a recomputed block's inputs read by two ops each (the
  // plain stream's hidden state, the experts' rows) used to be reported twice (exit 2).
  TinyK3Runs job(2, 0, 1);
  for (bool attn_res : {true, false}) {
    DYNAMIC_SECTION((attn_res ? "attn_res" : "plain")) {
      const string common = string("--set train.overlap_grad_sync=true --set train.grad_accum=2 --set model.attn_res=") +
                            (attn_res ? "true" : "false");
      const string tag = attn_res ? "r" : "p";
      auto stored = job.train(2, "ov_stored" + tag, common);
      INFO(stored.output);
      REQUIRE(stored.code == 0);
      auto again = job.train(2, "ov_again" + tag,
                             common + " --set train.activation_checkpointing=true --set train.recompute_modules=act,experts");
      INFO(again.output);
      REQUIRE(again.code == 0);
      const string want = metrics_history(job.dir + "/ov_stored" + tag);
      REQUIRE(want.find("\"loss\"") != string::npos);
      CHECK(metrics_history(job.dir + "/ov_again" + tag) == want);
    }
  }
}

TEST_CASE("cli: train.recompute_modules refuses names it does not know and GPT-2, naming the key", "[cli]") {
  TinyK3Runs job(1, 0, 1);
  auto bad = job.train(1, "bad", "--set train.recompute_modules=act,norms");
  CHECK(bad.code == 2);
  CHECK(bad.output.find("train.recompute_modules") != string::npos);
  CHECK(bad.output.find("'norms' is not a module") != string::npos);
  auto gpt2 = moetrain::testing::run_moetrain(moetrain::testing::tiny_gpt2_train_args(job.dir, job.dir + "/gpt2", 1) +
                                              " --set train.recompute_modules=act");
  CHECK(gpt2.code == 2);
  CHECK(gpt2.output.find("train.recompute_modules") != string::npos);
  CHECK(gpt2.output.find("model.arch gpt2 recomputes whole blocks only") != string::npos);
}
