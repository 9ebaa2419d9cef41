// The CUDA side of cuda::launch (launch.cuh): the device's and each kernel's
// limits, cached, the shared-memory opt-in, and the device attributes kernels ask for.
//
// The launch path (docs/cuda.md, "The launch path and the launch counter"): a thread's
// device is bound once (runtime.h: set_device, current_device, a thread_local), and
// each thread keeps a small direct-mapped cache from a kernel's address to its record
// (limits, shared memory opted in). A launch of a kernel that has run before on the
// thread reads the bound device, compares it with the cache's, and finds the record
// in its slot: no cudaGetDevice, no lock, no map lookup. The first launch of a kernel
// on a thread (or one whose slot another kernel took) takes the lock and the map once.
#include "backend/cuda/launch.cuh"

#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <utility>

#include "backend/cuda/runtime.h"

namespace moetrain::cuda {

namespace {

int query_attribute(cudaDeviceAttr a, int device) {
  int v = 0;
  MT_CUDA_CHECK(cudaDeviceGetAttribute(&v, a, device));
  return v;
}

struct KernelState {
  KernelLaunchLimits limits;                   // fixed once made
  std::atomic<int64_t> opted_in_bytes{0};      // cudaFuncAttributeMaxDynamicSharedMemorySize as set by us
};

std::mutex g_mutex;  // g_kernels, and the opt-in calls
std::array<std::once_flag, kMaxDevices> g_device_once;
std::array<DeviceLaunchLimits, kMaxDevices> g_device_limits;
std::map<std::pair<const void*, int>, KernelState> g_kernels;  // (kernel, device); nodes never move

KernelState& kernel_state_locked(const void* kernel, int device) {  // g_mutex held
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

const DeviceLaunchLimits& limits_of_device(int d) {
  MT_CHECK(d >= 0 && d < kMaxDevices, "CUDA device {} beyond the {} this process supports", d, kMaxDevices);
  std::call_once(g_device_once[static_cast<size_t>(d)], [d] {
    DeviceLaunchLimits& l = g_device_limits[static_cast<size_t>(d)];
    l.max_grid[0] = query_attribute(cudaDevAttrMaxGridDimX, d);
    l.max_grid[1] = query_attribute(cudaDevAttrMaxGridDimY, d);
    l.max_grid[2] = query_attribute(cudaDevAttrMaxGridDimZ, d);
    l.max_block[0] = query_attribute(cudaDevAttrMaxBlockDimX, d);
    l.max_block[1] = query_attribute(cudaDevAttrMaxBlockDimY, d);
    l.max_block[2] = query_attribute(cudaDevAttrMaxBlockDimZ, d);
    l.max_threads_per_block = query_attribute(cudaDevAttrMaxThreadsPerBlock, d);
    l.shared_default = query_attribute(cudaDevAttrMaxSharedMemoryPerBlock, d);
    l.shared_optin = query_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, d);
  });
  return g_device_limits[static_cast<size_t>(d)];
}

// Per thread: the device its slots are for, that device's limits, and kernel -> record.
constexpr size_t kLaunchCacheSlots = 256;
struct LaunchCache {
  int device = -1;
  const DeviceLaunchLimits* limits = nullptr;
  struct Slot {
    const void* kernel = nullptr;
    KernelState* state = nullptr;
  };
  std::array<Slot, kLaunchCacheSlots> slots{};
};
thread_local LaunchCache t_launch_cache;

LaunchCache& launch_cache() {
  LaunchCache& c = t_launch_cache;
  const int d = current_device();
  if (d != c.device) [[unlikely]] {  // first launch on this thread, or the thread changed device
    c.limits = &limits_of_device(d);
    c.slots = {};
    c.device = d;
  }
  return c;
}

KernelState& kernel_state(LaunchCache& c, const void* kernel) {
  // Kernels are functions, at least 16 bytes apart: the address's low bits say little.
  LaunchCache::Slot& slot = c.slots[(reinterpret_cast<uintptr_t>(kernel) >> 4) % kLaunchCacheSlots];
  if (slot.kernel == kernel) [[likely]] return *slot.state;
  std::lock_guard<std::mutex> lock(g_mutex);
  KernelState& k = kernel_state_locked(kernel, c.device);
  slot = {kernel, &k};
  return k;
}

// Device attributes, per device: value + 1 once asked (0: not yet).
constexpr int kAttributeSlots = 256;
std::array<std::array<std::atomic<int>, kAttributeSlots>, kMaxDevices> g_attributes{};

}  // namespace

void prepare_launch(const char* name, const char* what, const void* kernel, LaunchDims grid, LaunchDims block,
                    int64_t shared_bytes) {
  LaunchCache& c = launch_cache();
  KernelState& k = kernel_state(c, kernel);
  if (check_launch(name, grid, block, shared_bytes, *c.limits, k.limits, what ? what : "") &&
      shared_bytes > k.opted_in_bytes.load(std::memory_order_relaxed)) [[unlikely]] {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (shared_bytes > k.opted_in_bytes.load(std::memory_order_relaxed)) {
      MT_CUDA_CHECK(
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes)));
      k.opted_in_bytes.store(shared_bytes, std::memory_order_relaxed);
    }
  }
}

int device_attribute(cudaDeviceAttr attribute) {
  const int d = current_device();
  const int a = static_cast<int>(attribute);
  if (a < 0 || a >= kAttributeSlots || d >= kMaxDevices) return query_attribute(attribute, d);
  std::atomic<int>& slot = g_attributes[static_cast<size_t>(d)][static_cast<size_t>(a)];
  const int cached = slot.load(std::memory_order_relaxed);
  if (cached > 0) [[likely]] return cached - 1;
  const int v = query_attribute(attribute, d);  // the same answer every time: a race stores it twice
  slot.store(v + 1, std::memory_order_relaxed);
  return v;
}

}  // namespace moetrain::cuda
