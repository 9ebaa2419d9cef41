// Whole training runs on CUDA against the CPU run of the same config: the hybrid
// K3 model (KDA, gated MLA, latent MoE, AttnRes), end to end through the CLI; eval
// and generate of its model with --device cuda against --device cpu.
// Skips with one line where no GPU is visible.
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "testing.h"

using std::string;
using Result = moetrain::testing::CommandOutput;

TEST_CASE("cli: k3-tiny trains on CUDA, f32 and bf16, with the CPU run's first 20 losses; eval and generate --device cuda", "[cli][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  moetrain::testing::TempDir tmp;
  const string dir = tmp.path();
  Result prepared = moetrain::testing::run_moetrain("prepare " + string(MOETRAIN_SOURCE_DIR) +
                                                    "/data/tinyshakespeare.txt --out " + dir +
                                                    "/data --tokenizer byte --val-tokens 8192");
  INFO(prepared.output);
  REQUIRE(prepared.code == 0);
  const string args = "train -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml --set data.train=" + dir +
                      "/data/train_*.bin --set data.val= --set train.max_steps=20 --set train.warmup_steps=5 "
                      "--set train.batch_size=4 --set train.seq_len=96 --set train.eval_every=0 "
                      "--set train.log_every=1 --set ckpt.every=0";
  Result cpu = moetrain::testing::run_moetrain(args + " --set run.dir=" + dir + "/cpu");
  INFO(cpu.output);
  REQUIRE(cpu.code == 0);
  Result gpu = moetrain::testing::run_moetrain(args + " --set train.device=cuda --set run.dir=" + dir + "/cuda");
  INFO(gpu.output);
  REQUIRE(gpu.code == 0);
  CHECK_THAT(gpu.output, Catch::Contains("training on cuda:"));
  std::vector<double> a = moetrain::testing::metrics_losses(dir + "/cpu"),
                      b = moetrain::testing::metrics_losses(dir + "/cuda");
  REQUIRE(a.size() == 20);
  REQUIRE(b.size() == a.size());
  // f32 on both, other summation orders; a router tie broken the other way moves
  // one token's experts, which the tolerance leaves room for.
  for (size_t i = 0; i < a.size(); ++i) CHECK(b[i] == Approx(a[i]).epsilon(2e-3));

  // generate and eval --device cuda on the CPU run's model: the same loss (f32, other
  // summation orders) and, greedy, the same first bytes of text.
  const string model = " --checkpoint " + dir + "/cpu/model";
  const string eval = "eval" + model + " --data '" + dir + "/data/train_*.bin' --batches 4 --batch-size 2 --json";
  Result eval_cpu = moetrain::testing::run_moetrain(eval), eval_gpu = moetrain::testing::run_moetrain(eval +
                                                                                                       " --device cuda");
  INFO(eval_cpu.output << "\n" << eval_gpu.output);
  REQUIRE(eval_cpu.code == 0);
  REQUIRE(eval_gpu.code == 0);
  auto loss_of = [](const string& out) { return std::stod(out.substr(out.find("\"loss\": ") + 8)); };
  CHECK(loss_of(eval_gpu.output) == Approx(loss_of(eval_cpu.output)).epsilon(1e-4));
  const string generate = "generate" + model + " --prompt ROMEO: --temperature 0 --max-new-tokens 16";
  Result text_cpu = moetrain::testing::run_moetrain(generate), text_gpu = moetrain::testing::run_moetrain(
                                                                   generate + " --device cuda");
  INFO(text_cpu.output << "\n" << text_gpu.output);
  REQUIRE(text_gpu.code == 0);
  CHECK_THAT(text_gpu.output, Catch::Contains("model on cuda:"));
  const string first = text_cpu.output.substr(text_cpu.output.find("ROMEO:"), 14);
  CHECK_THAT(text_gpu.output, Catch::Contains(first));

  // Mixed precision (bf16 compute, f32 masters): within bf16's rounding of the f32 run.
  Result bf16 = moetrain::testing::run_moetrain(args + " --set train.device=cuda --set train.dtype=bf16 --set run.dir=" +
                                                dir + "/bf16");
  INFO(bf16.output);
  REQUIRE(bf16.code == 0);
  std::vector<double> c = moetrain::testing::metrics_losses(dir + "/bf16");
  REQUIRE(c.size() == a.size());
  for (size_t i = 0; i < a.size(); ++i) CHECK(c[i] == Approx(a[i]).epsilon(3e-2));
}
