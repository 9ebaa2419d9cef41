// One GPT-2 124M training step (forward, backward, AdamW), fp32, at (B=4, T=64)
// and (B=4, T=256): ms/step, tokens/s and GFLOP/s (6N + 6LTD per token), next to
// the raw OpenBLAS sgemm rate and the PyTorch time for the same step
// (bench/gpt2_step_torch.py, Debian torch, same threads), both measured in this run.
//   build/moetrain_bench_gpt2_step [--steps N] [--no-torch]
#include <cblas.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "backend/cpu/parallel.h"
#include "moetrain.h"
#include "nn/gpt2.h"
#include "optim/adamw.h"

using namespace moetrain;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// sgemm [1024, 768] x [768, 3072]: the machine's BLAS rate on a GPT-2 shape.
double sgemm_gflops() {
  const int m = 1024, k = 768, n = 3072;
  Tensor a = randn({m, k}, DType::f32, 1), b = randn({k, n}, DType::f32, 2), c = empty({m, n});
  auto run = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.f, a.data<float>(), k, b.data<float>(), n, 0.f,
                c.data<float>(), n);
  };
  run();
  int reps = 10;
  auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) run();
  return 2.0 * m * n * k * reps / seconds_since(t0) / 1e9;
}

double torch_ms(int64_t B, int64_t T, int steps) {
  std::string cmd = fmt::format("/usr/bin/python3 {}/bench/gpt2_step_torch.py --batch {} --seq {} --steps {} --threads {}",
                                MOETRAIN_SOURCE_DIR, B, T, steps, cpu::num_threads());
  std::FILE* p = popen(cmd.c_str(), "r");
  if (!p) return -1;
  char line[256] = {0};
  double ms = -1;
  while (std::fgets(line, sizeof line, p))
    if (std::sscanf(line, "torch_ms_per_step %lf", &ms) == 1) break;
  pclose(p);
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 3;
  bool with_torch = true;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--steps" && i + 1 < argc) steps = std::atoi(argv[++i]);
    else if (a == "--no-torch") with_torch = false;
  }
  cpu::init_threads();
  Gpt2Config config;  // GPT-2 small, 124M
  Gpt2 model(config, 1);
  AdamW opt(model.parameters(), {});
  double gemm = sgemm_gflops();
  fmt::print("GPT-2 124M train step, fp32, {} threads; sgemm [1024,768]x[768,3072]: {:.1f} GFLOP/s\n",
             cpu::num_threads(), gemm);
  fmt::print("{:>3} {:>4} {:>10} {:>9} {:>9} {:>10} {:>10} {:>9}\n", "B", "T", "ms/step", "tok/s", "GFLOP/s",
             "of sgemm", "torch ms", "speedup");
  for (auto [B, T] : {std::pair<int64_t, int64_t>{4, 64}, {4, 256}}) {
    Generator gen(7);
    Tensor ids = randint({B, T}, config.vocab_size, DType::i32, gen);
    Tensor targets = randint({B, T}, config.vocab_size, DType::i32, gen);
    auto step = [&] {
      opt.zero_grad();
      model.loss(ids, targets).backward();
      opt.step(1e-4);
    };
    step();  // warm-up: first-touch of every buffer
    auto t0 = Clock::now();
    for (int s = 0; s < steps; ++s) step();
    double sec = seconds_since(t0) / steps;
    double gflops = model.flops_per_token(T) * B * T / sec / 1e9;
    double tms = with_torch ? torch_ms(B, T, steps) : -1;
    fmt::print("{:>3} {:>4} {:>10.1f} {:>9.0f} {:>9.1f} {:>9.0f}% {:>10} {:>9}\n", B, T, sec * 1e3, B * T / sec,
               gflops, 100 * gflops / gemm, tms > 0 ? fmt::format("{:.1f}", tms) : "-",
               tms > 0 ? fmt::format("{:.2f}x", tms / (sec * 1e3)) : "-");
  }
  return 0;
}
