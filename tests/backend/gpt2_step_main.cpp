// moetrain_gpt2_step: GPT-2 124M training steps (B = 4, T = 64: forward,
// backward, AdamW), each timed, for tests/backend/gemm_progress.py, which runs
// several of these at once or with more threads than cores to check that the
// f32 GEMM route keeps making progress (backend/cpu/blas.h). Threads and route
// come from the environment as in the CLI (MOETRAIN_NUM_THREADS, MOETRAIN_GEMM).
//
//   moetrain_gpt2_step [STEPS]     prints "route R threads N kernels K", then per step
//                                  "step I SECONDS loss L" (L in hex), then
//                                  "parameters FNV" (FNV-1a of every parameter's bits
//                                  after the steps): runs compared bit for bit
//                                  (docs/performance.md, Reproducibility)
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "backend/cpu/blas.h"
#include "backend/cpu/parallel.h"
#include "moetrain.h"
#include "nn/gpt2.h"
#include "nn/parameters.h"
#include "optim/adamw.h"

using namespace moetrain;

int main(int argc, char** argv) {
  cpu::reexec_with_short_spin(argv);
  try {
    cpu::init_threads();
    const int steps = argc > 1 ? std::atoi(argv[1]) : 2;
    const std::string blas = cpu::blas_name();  // "...; f32 GEMM: blis (skx)"
    fmt::print("route {} threads {} kernels {}\n", cpu::gemm_route_name(cpu::gemm_route()), cpu::num_threads(),
               blas.substr(blas.rfind(": ") + 2));
    std::fflush(stdout);
    Gpt2Config config;  // GPT-2 small, 124M
    Gpt2 model(config, 1);
    AdamW opt(model.parameters(), {});
    Generator gen(7);
    Tensor ids = randint({4, 64}, config.vocab_size, DType::i32, gen);
    Tensor targets = randint({4, 64}, config.vocab_size, DType::i32, gen);
    for (int s = 1; s <= steps; ++s) {
      const auto t0 = std::chrono::steady_clock::now();
      opt.zero_grad();
      Tensor loss = model.loss(ids, targets);
      loss.backward();
      opt.step(1e-4);
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      fmt::print("step {} {:.3f} loss {:a}\n", s, sec, loss.item<float>());
      std::fflush(stdout);
    }
    uint64_t hash = 14695981039346656037ull;  // FNV-1a, 64-bit, over 32-bit words (f32 parameters)
    for (const NamedParameter& p : model.parameters()) {
      const Tensor t = p.tensor.contiguous();
      const auto* words = static_cast<const uint32_t*>(t.raw_data());
      for (int64_t i = 0; i < t.nbytes() / 4; ++i) hash = (hash ^ words[i]) * 1099511628211ull;
    }
    fmt::print("parameters {:016x}\n", hash);
  } catch (const std::exception& e) {
    fmt::print(stderr, "moetrain_gpt2_step: {}\n", e.what());
    return 1;
  }
  return 0;
}
