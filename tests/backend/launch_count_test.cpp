// The launch counter (core/launch_count.h): its plumbing (what counts, where, and the
// profile's and the bench's line), a hybrid (K3) training step's count on the CPU
// (the same every step), and on a GPU the kernels and cuBLAS calls counted where they
// are launched. train.profile's line is checked in tests/cli/profile_cli_test.cpp.
#include <string>

#include <catch2/catch.hpp>

#include "core/launch_count.h"
#include "moetrain.h"
#include "optim/adamw.h"
#include "testing.h"
#include "train/model_source.h"

using namespace moetrain;
using moetrain::testing::rel_error;
using std::string;

TEST_CASE("launch_count: an op's CPU kernel counts one CPU launch, nothing on the GPU", "[backend][launch]") {
  Tensor a = randn({3, 5}, DType::f32, 1), b = randn({3, 5}, DType::f32, 2);
  const LaunchCounts before = launch_counts();
  Tensor c = add(a, b);
  LaunchCounts d = launch_counts() - before;
  CHECK(d.cpu_kernels == 1);
  CHECK(d.cuda_kernels == 0);
  CHECK(d.cuda_library == 0);
  Tensor m = matmul(a, b, false, true);  // one GEMM kernel on the CPU (one cuBLAS call on a GPU)
  d = launch_counts() - before;
  CHECK(d.cpu_kernels >= 2);
  CHECK(d.cuda_total() == 0);
}

TEST_CASE("launch_count: the per-step line of train.profile and the bench", "[backend][launch]") {
  LaunchCounts c;
  c.cuda_kernels = 10;
  c.cuda_library = 4;
  c.cpu_kernels = 7;
  CHECK(format_launches_per_step(c, 2, true) == "7 (5 kernels + 2 cuBLAS/cuBLASLt calls)");
  CHECK(format_launches_per_step(c, 4, true) == "3.5 (2.5 kernels + 1 cuBLAS/cuBLASLt calls)");
  CHECK(format_launches_per_step(c, 7, false).rfind("1 CPU kernel calls", 0) == 0);
  CHECK(format_launches_per_step(c, 0, false) == "no step counted");
  const LaunchCounts sum = c + c;
  CHECK(sum.cuda_total() == 28);
  CHECK((sum - c).cpu_kernels == 7);
}

namespace {

// k3-tiny's layers (KDA, MLA with its output gate at layer 3, MoE, AttnRes) at a
// size a test runs quickly, in f32.
Config small_k3_config() {
  return Config::load(string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml",
                      {"model.n_layer=4", "model.attn_res_block_size=2", "train.dtype=f32", "model.vocab_size=64"});
}

}  // namespace

TEST_CASE("launch_count: a hybrid step launches the same kernels every step", "[backend][launch][train]") {
  const Config config = small_k3_config();
  std::unique_ptr<LanguageModel> model = build_model(config);
  AdamW opt(model->parameters(), {});
  Generator gen(3);
  const Tensor ids = randint({2, 16}, 64, DType::i32, gen), targets = randint({2, 16}, 64, DType::i32, gen);
  auto step = [&] {  // as the trainer's: loss, backward, clip, update check, AdamW
    const LaunchCounts before = launch_counts();
    opt.zero_grad();
    Tensor loss = model->loss(ids, targets, true);
    loss.backward();
    clip_grad_norm(model->parameters(), 1.0);
    CHECK_FALSE(opt.non_finite_update(1e-3).has_value());
    opt.step(1e-3);
    return (launch_counts() - before).cpu_kernels;
  };
  step();  // the first step makes the optimizer's state
  const int64_t second = step(), third = step();
  INFO("CPU kernel launches per step: " << second << ", then " << third);
  CHECK(second == third);
  CHECK(second > 100);  // every layer's ops are counted, not a handful
}

TEST_CASE("launch_count: CUDA kernels and cuBLAS calls are counted where they launch", "[backend][launch][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  Tensor a = randn({64, 32}, DType::f32, 1).to(kCuda), b = randn({64, 32}, DType::f32, 2).to(kCuda);
  cuda::synchronize(0);
  LaunchCounts before = launch_counts();
  Tensor c = add(a, b);
  LaunchCounts d = launch_counts() - before;
  CHECK(d.cuda_kernels == 1);
  CHECK(d.cuda_library == 0);
  CHECK(d.cpu_kernels == 0);
  before = launch_counts();
  Tensor m = matmul(a, b, false, true);
  d = launch_counts() - before;
  CHECK(d.cuda_library >= 1);
  CHECK(d.cpu_kernels == 0);
  // The same kernel again, now through the launch path's per-thread cache: still one each.
  before = launch_counts();
  for (int i = 0; i < 3; ++i) c = add(c, b);
  CHECK((launch_counts() - before).cuda_kernels == 3);
  CHECK(rel_error(c.to(kCpu), add(add(add(add(a, b).to(kCpu), b.to(kCpu)), b.to(kCpu)), b.to(kCpu))) < 1e-6);
}
