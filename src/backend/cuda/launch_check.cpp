// check_launch: the launch limits of launch_check.h.
#include "backend/cuda/launch_check.h"

#include <string>

#include <fmt/format.h>

#include "core/error.h"

namespace moetrain::cuda {

DeviceLaunchLimits hopper_launch_limits() {
  DeviceLaunchLimits l;
  l.shared_optin = 227 * 1024;
  return l;
}

namespace {

std::string advice(std::string_view what) { return what.empty() ? std::string() : fmt::format("; {}", what); }

}  // namespace

bool check_launch(std::string_view kernel, LaunchDims grid, LaunchDims block, int64_t shared_bytes,
                  const DeviceLaunchLimits& device, const KernelLaunchLimits& func, std::string_view what) {
  const char* axis[] = {"x", "y", "z"};
  const int64_t g[] = {grid.x, grid.y, grid.z}, b[] = {block.x, block.y, block.z};
  for (int i = 0; i < 3; ++i) {
    // An empty grid is the caller's to skip (nothing to launch): a zero here is a bug.
    MT_CHECK(g[i] >= 1 && g[i] <= device.max_grid[i], "CUDA launch of {}: grid.{} = {} blocks, the GPU allows 1..{}{}",
             kernel, axis[i], g[i], device.max_grid[i], advice(what));
    MT_CHECK(b[i] >= 1 && b[i] <= device.max_block[i],
             "CUDA launch of {}: block.{} = {} threads, the GPU allows 1..{}{}", kernel, axis[i], b[i],
             device.max_block[i], advice(what));
  }
  MT_CHECK(block.count() <= device.max_threads_per_block,
           "CUDA launch of {}: {} threads per block, the GPU allows {}{}", kernel, block.count(),
           device.max_threads_per_block, advice(what));
  MT_CHECK(block.count() <= func.max_threads_per_block,
           "CUDA launch of {}: {} threads per block, the compiled kernel allows {} (its registers){}", kernel,
           block.count(), func.max_threads_per_block, advice(what));
  MT_CHECK(shared_bytes >= 0, "CUDA launch of {}: {} bytes of dynamic shared memory", kernel, shared_bytes);
  const int64_t total = func.static_shared + shared_bytes;
  MT_CHECK(total <= device.shared_optin,
           "CUDA launch of {}: needs {} bytes of shared memory per block ({} dynamic + {} static), the GPU offers {}{}",
           kernel, total, shared_bytes, func.static_shared, device.shared_optin, advice(what));
  return total > device.shared_default;
}

std::string device_fault_message(std::string_view error_name, std::string_view error_string, int code,
                                 std::string_view during, const char* last_kernel) {
  return fmt::format(
      "CUDA error {} ({}, code {}) while {}: not out of memory. An earlier kernel failed on the device and left "
      "this process's CUDA context unusable; every later CUDA call fails the same way. The last kernel launched: "
      "{}. Rerun the failing case under compute-sanitizer (launch/gpu-recheck.sh; docs/cuda.md, \"Proof on a GPU\")",
      error_name, error_string, code, during, last_kernel ? last_kernel : "none through cuda::launch");
}

}  // namespace moetrain::cuda
