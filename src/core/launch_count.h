// The launch counter: how many kernels a step launches, counted on the host with one
// relaxed atomic increment per launch (docs/cuda.md, "The launch path and the launch
// counter"). A step of a small model is bound by the host when it launches thousands of
// short kernels; this says how many it launches, so fusions can be checked by number.
//
//   const LaunchCounts before = launch_counts();
//   ...one step...
//   const LaunchCounts step = launch_counts() - before;
//
// Three counts, by where the work is started:
//  - cuda_kernels: our kernels, counted in cuda::launch (backend/cuda/launch.cuh), the
//    one place every CUDA kernel of the library is launched from;
//  - cuda_library: cuBLAS and cuBLASLt calls (backend/cuda/cublas.cpp, cublaslt.cpp),
//    each counted as one launch (a library call may launch more than one kernel);
//  - cpu_kernels: the kernels the ops pick on the CPU through MT_ON_DEVICE
//    (ops/common/on_device.h), the seam where a CUDA run launches the op's kernel. It
//    is the same count of op kernels as on a GPU for the ops that go through that
//    seam, so a CPU run shows what a fusion removes without a GPU (the CPU side of
//    the few ops that call their kernels directly is not counted).
// Plain C++ (no CUDA header): compiled in every build. The counters are process-wide
// and only grow; readers take differences.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace moetrain {

struct LaunchCounts {
  int64_t cuda_kernels = 0;
  int64_t cuda_library = 0;
  int64_t cpu_kernels = 0;
  // Launches on a GPU (kernels and library calls together).
  int64_t cuda_total() const { return cuda_kernels + cuda_library; }
};

inline LaunchCounts operator-(const LaunchCounts& a, const LaunchCounts& b) {
  return {a.cuda_kernels - b.cuda_kernels, a.cuda_library - b.cuda_library, a.cpu_kernels - b.cpu_kernels};
}
inline LaunchCounts operator+(const LaunchCounts& a, const LaunchCounts& b) {
  return {a.cuda_kernels + b.cuda_kernels, a.cuda_library + b.cuda_library, a.cpu_kernels + b.cpu_kernels};
}

namespace launch_count_detail {
// Relaxed: a count, not a synchronisation; a reader on another thread may see an
// increment late, never torn.
inline std::atomic<int64_t> g_cuda_kernels{0};
inline std::atomic<int64_t> g_cuda_library{0};
inline std::atomic<int64_t> g_cpu_kernels{0};
}  // namespace launch_count_detail

inline void count_cuda_kernel_launch() {
  launch_count_detail::g_cuda_kernels.fetch_add(1, std::memory_order_relaxed);
}
inline void count_cuda_library_call() {
  launch_count_detail::g_cuda_library.fetch_add(1, std::memory_order_relaxed);
}
inline void count_cpu_kernel_call() { launch_count_detail::g_cpu_kernels.fetch_add(1, std::memory_order_relaxed); }

inline LaunchCounts launch_counts() {
  using namespace launch_count_detail;
  return {g_cuda_kernels.load(std::memory_order_relaxed), g_cuda_library.load(std::memory_order_relaxed),
          g_cpu_kernels.load(std::memory_order_relaxed)};
}

// `counts` over `steps` steps as a line of the profile and the bench: on a GPU
// (on_gpu) "3046 (2710 kernels + 336 cuBLAS/cuBLASLt calls)", on the CPU "2710 CPU
// kernel calls (...)"; a mean that is not whole keeps one decimal (launch_count.cpp).
std::string format_launches_per_step(const LaunchCounts& counts, int64_t steps, bool on_gpu);

}  // namespace moetrain
