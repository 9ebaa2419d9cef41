// `moetrain info`: what this build and machine offer.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdlib>
#include <string>

#include "backend/cpu/blas.h"
#include "backend/cpu/parallel.h"
#include "backend/cuda/runtime.h"
#include "cli/commands.h"

namespace moetrain::cli {

void add_info_command(CLI::App& app, Commands& commands) {
  CLI::App* cmd = app.add_subcommand("info", "Print the build, BLAS, threads and devices");
  commands.push_back({cmd, [] {
    fmt::print("moetrain {}\n", MOETRAIN_VERSION);
    fmt::print("threads     {} (MOETRAIN_NUM_THREADS or --threads override)\n", cpu::num_threads());
    fmt::print("blas        {}\n", cpu::blas_name());
    const char* gemm = std::getenv("MOETRAIN_GEMM");
    fmt::print("f32 gemm    {} (MOETRAIN_GEMM={}): {}\n", cpu::gemm_route_name(cpu::gemm_route()),
               gemm && *gemm ? gemm : "auto", cpu::gemm_threading());
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    const char* spin = std::getenv("GOMP_SPINCOUNT");
    fmt::print("openmp      {}\n", policy ? fmt::format("OMP_WAIT_POLICY={}", policy)
                                          : spin ? fmt::format("GOMP_SPINCOUNT={}", spin)
                                                 : std::string("libgomp's default spin"));
    if (cuda::built_with_cuda()) {
      int n = cuda::device_count();
      fmt::print("cuda        built in, {} device(s)\n", n);
      for (int i = 0; i < n; ++i) fmt::print("  cuda:{}    {}\n", i, cuda::device_name(i));
    } else {
      fmt::print("cuda        not built (configure with -DMOETRAIN_CUDA=ON and the CUDA toolkit)\n");
    }
    return 0;
  }});
}

}  // namespace moetrain::cli
