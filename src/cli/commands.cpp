#include "cli/commands.h"

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "backend/cpu/blas.h"
#include "backend/cpu/parallel.h"
#include "backend/cuda/runtime.h"

namespace moetrain::cli {

namespace {

// `moetrain info`: what this build and machine offer.
int run_info() {
  fmt::print("moetrain {}\n", MOETRAIN_VERSION);
  fmt::print("threads     {} (MOETRAIN_NUM_THREADS overrides)\n", cpu::num_threads());
  fmt::print("blas        {}\n", cpu::blas_name());
  if (cuda::built_with_cuda()) {
    int n = cuda::device_count();
    fmt::print("cuda        built in, {} device(s)\n", n);
    for (int i = 0; i < n; ++i) fmt::print("  cuda:{}    {}\n", i, cuda::device_name(i));
  } else {
    fmt::print("cuda        not built (configure with -DMOETRAIN_CUDA=ON and the CUDA toolkit)\n");
  }
  return 0;
}

}  // namespace

int run(int argc, char** argv) {
  CLI::App app{"moetrain: train GPT-2 and Kimi-K3-style hybrid MoE models"};
  app.set_version_flag("--version", std::string("moetrain ") + MOETRAIN_VERSION);
  app.require_subcommand(1);
  int threads = 0;
  app.add_option("--threads", threads, "CPU threads for kernels and BLAS (default: cores / local ranks)")
      ->check(CLI::PositiveNumber);
  auto* info = app.add_subcommand("info", "Print the build, BLAS, threads and devices");
  CLI11_PARSE(app, argc, argv);

  cpu::init_threads();
  if (threads > 0) cpu::set_num_threads(threads);
  if (info->parsed()) return run_info();
  return 0;
}

}  // namespace moetrain::cli
