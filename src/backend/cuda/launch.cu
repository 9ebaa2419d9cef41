// The CUDA side of cuda::launch (launch.cuh): the device's and each kernel's
// limits, cached, and the shared-memory opt-in.
#include "backend/cuda/launch.cuh"

#include <array>
#include <map>
#include <mutex>
#include <utility>

#include "backend/cuda/runtime.h"

namespace moetrain::cuda {

namespace {

int current_device() {
  int device = 0;
  MT_CUDA_CHECK(cudaGetDevice(&device));
  MT_CHECK(device >= 0 && device < kMaxDevices, "CUDA device {} beyond the {} this process supports", device,
           kMaxDevices);
  return device;
}

int attribute(cudaDeviceAttr a, int device) {
  int v = 0;
  MT_CUDA_CHECK(cudaDeviceGetAttribute(&v, a, device));
  return v;
}

struct KernelState {
  KernelLaunchLimits limits;
  int64_t opted_in_bytes = 0;  // cudaFuncAttributeMaxDynamicSharedMemorySize as set by us
};

std::mutex g_mutex;
std::array<std::once_flag, kMaxDevices> g_device_once;
std::array<DeviceLaunchLimits, kMaxDevices> g_device_limits;
std::map<std::pair<const void*, int>, KernelState> g_kernels;  // (kernel, device)

KernelState& kernel_state(const void* kernel, int device) {  // g_mutex held
  auto [it, added] = g_kernels.try_emplace({kernel, device});
  if (added) {
    cudaFuncAttributes f{};
    const cudaError_t err = cudaFuncGetAttributes(&f, kernel);
    if (err != cudaSuccess) g_kernels.erase(it);
    MT_CUDA_CHECK(err);
    it->second.limits.max_threads_per_block = f.maxThreadsPerBlock;
    it->second.limits.static_shared = static_cast<int64_t>(f.sharedSizeBytes);
  }
  return it->second;
}

}  // namespace

const DeviceLaunchLimits& device_launch_limits() {
  const int d = current_device();
  std::call_once(g_device_once[static_cast<size_t>(d)], [d] {
    DeviceLaunchLimits& l = g_device_limits[static_cast<size_t>(d)];
    l.max_grid[0] = attribute(cudaDevAttrMaxGridDimX, d);
    l.max_grid[1] = attribute(cudaDevAttrMaxGridDimY, d);
    l.max_grid[2] = attribute(cudaDevAttrMaxGridDimZ, d);
    l.max_block[0] = attribute(cudaDevAttrMaxBlockDimX, d);
    l.max_block[1] = attribute(cudaDevAttrMaxBlockDimY, d);
    l.max_block[2] = attribute(cudaDevAttrMaxBlockDimZ, d);
    l.max_threads_per_block = attribute(cudaDevAttrMaxThreadsPerBlock, d);
    l.shared_default = attribute(cudaDevAttrMaxSharedMemoryPerBlock, d);
    l.shared_optin = attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, d);
  });
  return g_device_limits[static_cast<size_t>(d)];
}

KernelLaunchLimits kernel_launch_limits(const void* kernel) {
  const int d = current_device();
  std::lock_guard<std::mutex> lock(g_mutex);
  return kernel_state(kernel, d).limits;
}

void opt_in_shared_memory(const void* kernel, int64_t bytes) {
  const int d = current_device();
  std::lock_guard<std::mutex> lock(g_mutex);
  KernelState& k = kernel_state(kernel, d);
  if (bytes <= k.opted_in_bytes) return;
  MT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  k.opted_in_bytes = bytes;
}

}  // namespace moetrain::cuda
