// train.cuda_graph (docs/cuda.md#cuda-graphs): refused where nothing can be captured;
// on a GPU, a run whose steps replay a CUDA graph gives the eager run's losses
// (the [cuda] case skips with one line where no GPU is visible).
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "testing.h"

using std::string;
using Result = moetrain::testing::CommandOutput;

namespace {

string k3_tiny_args(const string& dir, int steps, const string& config = "k3-tiny") {
  return "train -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/" + config + ".yaml --set data.train=" + dir +
         "/data/train_*.bin --set data.val= --set train.max_steps=" + std::to_string(steps) +
         " --set train.warmup_steps=2 --set train.batch_size=2 --set train.seq_len=64 --set train.eval_every=0 "
         "--set train.log_every=1 --set ckpt.every=0";
}

Result prepare(const string& dir) {
  return moetrain::testing::run_moetrain("prepare " + string(MOETRAIN_SOURCE_DIR) + "/data/tinyshakespeare.txt --out " +
                                         dir + "/data --tokenizer byte --val-tokens 8192");
}

}  // namespace

TEST_CASE("cli: train.cuda_graph on is refused where no graph can be captured; a bad value names the key",
          "[cli][cuda_graph]") {
  moetrain::testing::TempDir tmp;
  const string dir = tmp.path();
  Result prepared = prepare(dir);
  INFO(prepared.output);
  REQUIRE(prepared.code == 0);
  Result on_cpu = moetrain::testing::run_moetrain(k3_tiny_args(dir, 2) + " --set train.cuda_graph=on --set run.dir=" +
                                                  dir + "/on");
  INFO(on_cpu.output);
  CHECK(on_cpu.code == 2);
  CHECK_THAT(on_cpu.output, Catch::Contains("train.cuda_graph") && Catch::Contains("train.device is cpu"));
  Result bad = moetrain::testing::run_moetrain(k3_tiny_args(dir, 2) + " --set train.cuda_graph=yes --set run.dir=" +
                                               dir + "/bad");
  INFO(bad.output);
  CHECK(bad.code == 2);
  CHECK_THAT(bad.output, Catch::Contains("train.cuda_graph"));
  // auto and off on the CPU: the same run, nothing captured.
  Result off = moetrain::testing::run_moetrain(k3_tiny_args(dir, 2) + " --set train.cuda_graph=off --set run.dir=" +
                                               dir + "/off");
  Result automatic = moetrain::testing::run_moetrain(k3_tiny_args(dir, 2) + " --set run.dir=" + dir + "/auto");
  REQUIRE(off.code == 0);
  REQUIRE(automatic.code == 0);
  CHECK(moetrain::testing::metrics_losses(dir + "/off") == moetrain::testing::metrics_losses(dir + "/auto"));
  CHECK_THAT(automatic.output, !Catch::Contains("cuda_graph"));
}

namespace {

// `config` with `extra` on the GPU, train.cuda_graph off and on: the graphed run
// logs its capture and gives the eager run's losses.
void graph_matches_eager(const string& config, const string& extra) {
  moetrain::testing::TempDir tmp;
  const string dir = tmp.path();
  Result prepared = prepare(dir);
  INFO(prepared.output);
  REQUIRE(prepared.code == 0);
  const int steps = 5;  // the capture at step 2, then replays
  const string args = k3_tiny_args(dir, steps, config) + " --set train.device=cuda" + extra;
  Result eager = moetrain::testing::run_moetrain(args + " --set train.cuda_graph=off --set run.dir=" + dir + "/eager");
  Result graphed = moetrain::testing::run_moetrain(args + " --set train.cuda_graph=on --set run.dir=" + dir + "/graph");
  INFO(eager.output << "\n" << graphed.output);
  REQUIRE(eager.code == 0);
  REQUIRE(graphed.code == 0);
  CHECK_THAT(graphed.output, Catch::Contains("train.cuda_graph: the forward and backward captured"));
  const std::vector<double> a = moetrain::testing::metrics_losses(dir + "/eager"),
                            b = moetrain::testing::metrics_losses(dir + "/graph");
  REQUIRE(a.size() == static_cast<size_t>(steps));
  REQUIRE(b.size() == a.size());
  // The same kernels in the same order: the same losses (the bound leaves room for
  // a library that sums in another order between calls, as the capture's check does).
  for (size_t i = 0; i < a.size(); ++i) CHECK(b[i] == Approx(a[i]).epsilon(1e-6));
}

}  // namespace

TEST_CASE("cli: k3-tiny bf16 (grad_accum 2, QK-Clip) replayed from a CUDA graph gives the eager run's losses",
          "[cli][cuda][cuda_graph]") {
  if (!moetrain::testing::gpu_available()) return;
  graph_matches_eager("k3-tiny", " --set train.dtype=bf16 --set train.grad_accum=2 --set train.qk_clip=true");
}

TEST_CASE("cli: GPT-2 bf16 replayed from a CUDA graph gives the eager run's losses", "[cli][cuda][cuda_graph]") {
  if (!moetrain::testing::gpu_available()) return;
  graph_matches_eager("gpt2-shakespeare", " --set model.n_layer=2 --set train.dtype=bf16");
}

TEST_CASE("cli: f32 experts cannot be captured: train.cuda_graph on refuses naming the copy, auto trains eagerly",
          "[cli][cuda][cuda_graph]") {
  if (!moetrain::testing::gpu_available()) return;
  moetrain::testing::TempDir tmp;
  const string dir = tmp.path();
  Result prepared = prepare(dir);
  INFO(prepared.output);
  REQUIRE(prepared.code == 0);
  // f32 experts read their offsets to the host (a wait per layer, the accuracy reference).
  const string f32 = k3_tiny_args(dir, 3) + " --set train.device=cuda";
  Result refused = moetrain::testing::run_moetrain(f32 + " --set train.cuda_graph=on --set run.dir=" + dir + "/on");
  INFO(refused.output);
  CHECK(refused.code == 2);
  CHECK_THAT(refused.output, Catch::Contains("a copy from the GPU to the host"));
  Result fallback = moetrain::testing::run_moetrain(f32 + " --set run.dir=" + dir + "/auto");
  INFO(fallback.output);
  CHECK(fallback.code == 0);
  CHECK_THAT(fallback.output, Catch::Contains("train.cuda_graph auto: the step runs eagerly"));
  CHECK(moetrain::testing::metrics_losses(dir + "/auto").size() == 3);
}
