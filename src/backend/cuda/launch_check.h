// The limits a CUDA kernel launch must respect, checked in one place before every
// launch (backend/cuda/launch.cuh calls check_launch): grid and block dimensions,
// threads per block (the device's and the kernel's own, which its registers
// lower), and shared memory (the kernel's static part plus the dynamic bytes
// against the device's opt-in limit). An out-of-range launch would otherwise fail
// as "invalid configuration argument" or "too many resources requested" from the
// driver, naming nothing; here it throws moetrain::Error naming the kernel, the
// value, the limit and what the caller can change.
//
// Plain C++ (no CUDA headers): compiled in every build and unit-tested without a
// GPU (tests/backend/launch_check_test.cpp) against the H100/H200's limits.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>

namespace moetrain::cuda {

// Grid or block dimensions, 64-bit so that a count that would wrap the driver's
// 32-bit unsigned is seen before it is cast.
// A count converts implicitly (grid = blocks), as does CUDA's dim3.
struct LaunchDims {
  int64_t x = 1, y = 1, z = 1;
  LaunchDims(int64_t x_ = 1, int64_t y_ = 1, int64_t z_ = 1) : x(x_), y(y_), z(z_) {}  // NOLINT: implicit
  template <class D>
  requires requires(const D& d) {
    d.x;
    d.y;
    d.z;
  }
  LaunchDims(const D& d) : x(d.x), y(d.y), z(d.z) {}  // NOLINT: implicit, from dim3
  int64_t count() const { return x * y * z; }
};

// What the device allows (cudaDeviceProp / cudaDeviceGetAttribute).
struct DeviceLaunchLimits {
  int64_t max_grid[3] = {2147483647, 65535, 65535};
  int64_t max_block[3] = {1024, 1024, 64};
  int64_t max_threads_per_block = 1024;
  int64_t shared_default = 48 * 1024;  // dynamic + static shared memory without opt-in
  int64_t shared_optin = 48 * 1024;    // the most a kernel may opt in to (H100/H200: 227 KiB)
};

// What one compiled kernel allows (cudaFuncGetAttributes).
struct KernelLaunchLimits {
  int64_t max_threads_per_block = 1024;  // lower than the device's when registers run out
  int64_t static_shared = 0;             // __shared__ arrays of the kernel
};

// Hopper's (sm_90: H100, H200) limits, for tests and error text.
DeviceLaunchLimits hopper_launch_limits();

// Throws moetrain::Error when the launch exceeds a limit: names `kernel`, the
// value and the limit, and ends with `what` (what the caller can change) when
// given. Returns true when the dynamic shared memory needs the opt-in
// (cudaFuncAttributeMaxDynamicSharedMemorySize set to `shared_bytes` before the
// launch): when static + dynamic exceeds the default 48 KiB.
bool check_launch(std::string_view kernel, LaunchDims grid, LaunchDims block, int64_t shared_bytes,
                  const DeviceLaunchLimits& device, const KernelLaunchLimits& func, std::string_view what = {});

// This thread's device (runtime.cpp, built with CUDA only): the one it is bound to by cuda::set_device
// (select_device, or any call naming a device: stream(d), the allocator, ...), kept in
// a thread_local, so setting the bound device again and every stream(device) and
// allocation on it cost a compare and a load, no CUDA call; before the first, CUDA's
// current device, asked once. Only cuda::set_device may change a thread's device (a
// direct cudaSetDevice leaves the binding stale). docs/cuda.md, "The launch path and
// the launch counter".
int current_device();

// The last kernel launched through cuda::launch in this process (its name, a string
// literal; nullptr before the first): one relaxed store per launch (launch.cuh). An
// error of a kernel's execution (an illegal address) surfaces at a later CUDA call;
// the allocator's error names this kernel as the likely culprit (runtime.cpp).
inline std::atomic<const char*> g_last_kernel_launched{nullptr};

// The message for a CUDA call that failed with an error other than "out of memory"
// where the caller expected memory: a sticky error left by an earlier kernel
// (cudaErrorIllegalAddress, cudaErrorLaunchFailure, ...) makes every later call fail,
// cudaMalloc and cudaMemGetInfo included, which used to read as "out of memory ... 0
// free of 0". Names the error (cudaGetErrorName, cudaGetErrorString, code), what was
// being done, the last kernel launched, and what to do (docs/cuda.md, "Proof on a GPU").
std::string device_fault_message(std::string_view error_name, std::string_view error_string, int code,
                                 std::string_view during, const char* last_kernel);

}  // namespace moetrain::cuda
