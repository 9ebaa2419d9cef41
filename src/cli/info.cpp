// `moetrain info`: what this build and machine offer.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdlib>
#include <memory>
#include <string>

#include "backend/cpu/blas.h"
#include "backend/cpu/denormals.h"
#include "backend/cpu/isa.h"
#include "backend/cpu/onednn.h"
#include "backend/cpu/parallel.h"
#include "backend/cuda/runtime.h"
#include "cli/commands.h"

namespace moetrain::cli {

// --require-cuda without a visible CUDA device (sysexits' EX_UNAVAILABLE): distinct
// from the loader's 127 (a shared library missing), which tests/launch/gpu_bundle_test.sh
// tells apart; moetrain_bench_cuda exits with it too.
constexpr int kExitNoDevice = 69;

namespace {

// What `moetrain info` prints; with require_cuda, kExitNoDevice when no CUDA device is visible.
int print_info(bool require_cuda) {
  fmt::print("moetrain {}\n", MOETRAIN_VERSION);
  fmt::print("threads     {} (MOETRAIN_NUM_THREADS or --threads override)\n", cpu::num_threads());
  fmt::print("blas        {}\n", cpu::blas_name());
  const char* gemm = std::getenv("MOETRAIN_GEMM");
  fmt::print("f32 gemm    {} (MOETRAIN_GEMM={}): {}\n", cpu::gemm_route_name(cpu::gemm_route()),
             gemm && *gemm ? gemm : "auto", cpu::gemm_threading());
  fmt::print("gemm why    {}\n", cpu::gemm_route_reason());
  fmt::print("bf16 gemm   {}, ISA {} (bf16 x bf16 -> f32 on a GPT-2 shape: {})\n", cpu::onednn::version(),
             cpu::onednn::effective_isa(), cpu::onednn::matmul_impl(256, 768, 768));
  fmt::print("denormals   {}\n", cpu::denormal_description());
  const char* isa = std::getenv("MOETRAIN_ISA");
  fmt::print("vector isa  {} (MOETRAIN_ISA={}{}; CPU: {}): the copy our own vector kernels run (KDA, MoE experts,\n"
             "            SiTU-GLU, elementwise, norms, softmax, attention; AdamW and the decay gate: avx2 or generic)\n",
             cpu::vector_isa_name(cpu::vector_isa()), isa && *isa ? isa : "auto",
             gemm && std::string(gemm) == "portable" ? ", capped at avx2 by MOETRAIN_GEMM=portable" : "",
             cpu::vector_isa_name(cpu::cpu_vector_isa()));
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  const char* spin = std::getenv("GOMP_SPINCOUNT");
  fmt::print("openmp      {}\n", policy ? fmt::format("OMP_WAIT_POLICY={}", policy)
                                 : spin ? fmt::format("GOMP_SPINCOUNT={}", spin)
                                        : std::string("libgomp's default spin"));
  const int devices = cuda::built_with_cuda() ? cuda::device_count() : 0;
  if (cuda::built_with_cuda()) {
    fmt::print("cuda        built in, {} device(s)\n", devices);
    for (int i = 0; i < devices; ++i) fmt::print("  cuda:{}    {}\n", i, cuda::device_name(i));
  } else {
    fmt::print("cuda        not built (configure with -DMOETRAIN_CUDA=ON and the CUDA toolkit)\n");
  }
  if (require_cuda && devices == 0) {
    fmt::print(stderr, "moetrain: no CUDA device is visible (--require-cuda)\n");
    return kExitNoDevice;
  }
  return 0;
}

}  // namespace

void add_info_command(CLI::App& app, Commands& commands) {
  CLI::App* cmd = app.add_subcommand("info", "Print the build, BLAS, threads and devices");
  auto require_cuda = std::make_shared<bool>(false);
  cmd->add_flag("--require-cuda", *require_cuda,
                "exit 69 (after printing) when no CUDA device is visible: launch/gpu-check.sh's device query");
  commands.push_back({cmd, [require_cuda] { return print_info(*require_cuda); }});
}

}  // namespace moetrain::cli
